"""Short forms of text for one-line displays: a notice, an event line, a table cell, an error.

Four ways to shorten, each for its own place: `first_line` (an answer's or an output's first line,
for a notice or an event), `one_line` (a call's text in a line, marked when more follows), `clip`
(a table cell) and `squash` (a parser's message, whitespace made single spaces).
"""

from __future__ import annotations

MORE = " ..."
NO_ANSWER = "(no answer)"


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
