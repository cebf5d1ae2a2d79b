"""Short forms of text for one-line displays: a notice, an event line, a table cell, an error.

Four ways to shorten, each for its own place: `first_line` (an answer's or an output's first line,
for a notice or an event), `one_line` (a call's text in a line, marked when more follows), `clip`
(a table cell) and `squash` (a parser's message, whitespace made single spaces); and `terminal_text`,
the one sanitizer of text the program did not make on its way to a terminal.
"""

from __future__ import annotations

import re

MORE = " ..."
NO_ANSWER = "(no answer)"
# The longest warning line printed: a warning can name what came with a cloned repository.
MAX_WARNING_CHARS = 300
# How many names a list in one line shows (`name_list`), and how long each may be.
MAX_LISTED_NAMES = 10
MAX_LISTED_NAME_CHARS = 40
# What a terminal obeys rather than shows: C0 controls but tab and newline (ESC starts OSC 52, which
# writes the clipboard, `ESC[2J`, a window title), DEL, the C1 controls (0x9b is a CSI of its own), and
# the bidirectional overrides and isolates that reorder what is shown ("Trojan Source").
_TERMINAL_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def terminal_text(text: str) -> str:
    """`text` as a terminal shows it and does not obey it: every control character (`_TERMINAL_CONTROLS`)
    written as its escape (`\\x1b`, `\\u202e`); tab and newline kept."""
    return _TERMINAL_CONTROLS.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def first_line(text: str, max_chars: int = 120, *, cut: str = MORE) -> str:
    """The first non-empty line of `text`, cut to `max_chars` and then ending in `cut`; "" for blank text."""
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return line[:max_chars] + cut if len(line) > max_chars else line


def one_line(text: str, max_chars: int = 100) -> str:
    """The first line of `text`, shortened, for one-line labels; ` ...` also when more lines follow."""
    first, *rest = text.strip().splitlines() or [""]
    if rest or len(first) > max_chars:
        return first[:max_chars] + MORE
    return first


def clip(text: str, max_chars: int) -> str:
    """`text` in at most `max_chars` characters, ending in `...` when cut (a table cell)."""
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def squash(text: str) -> str:
    """`text` with every run of whitespace, newlines included, made one space."""
    return " ".join(text.split())


def name_list(names: list[str]) -> str:
    """`a, b, c` for a one-line message: at most `MAX_LISTED_NAMES` names of at most
    `MAX_LISTED_NAME_CHARS` each, then `(and N more)`."""
    shown = ", ".join(clip(name, MAX_LISTED_NAME_CHARS) for name in names[:MAX_LISTED_NAMES])
    more = len(names) - MAX_LISTED_NAMES
    return f"{shown} (and {more:,} more)" if more > 0 else shown


def warning_line(text: str) -> str:
    """A warning as one line of at most `MAX_WARNING_CHARS` (whitespace made single spaces)."""
    return clip(squash(text[: 4 * MAX_WARNING_CHARS]), MAX_WARNING_CHARS)
