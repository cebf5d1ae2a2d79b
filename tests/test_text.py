"""The one sanitizer of text on its way to a terminal, and the places that use it: the CLI's consoles
(every print, table, live line and `watch`), the streamed reply and the prompt line."""

from __future__ import annotations

import io
import os
import pty

from rich.control import strip_control_codes
from rich.table import Table
from rich.text import Text

from mlx_subagents.cli.chat_view import ReplyStream
from mlx_subagents.cli.output import TerminalConsole
from mlx_subagents.cli.promptline import PromptLine
from mlx_subagents.text import terminal_text

HOSTILE = "a\x1b]52;c;cHduZWQ=\x07b\x1b[2Jc\x9b2Jd\u202ee\x00f\rg"
SHOWN = "a\\x1b]52;c;cHduZWQ=\\x07b\\x1b[2Jc\\x9b2Jd\\u202ee\\x00f\\rg"


def test_every_control_character_is_shown_as_its_escape_and_tab_and_newline_stay() -> None:
    assert terminal_text(HOSTILE) == SHOWN
    assert terminal_text("one\ttwo\nthree é ✓") == "one\ttwo\nthree é ✓"


def test_the_console_escapes_what_it_prints_on_a_terminal_and_not_on_a_pipe() -> None:
    kept = strip_control_codes(HOSTILE)  # rich itself drops BEL, BS, VT, FF and CR from text
    for is_terminal, expected in ((True, terminal_text(kept)), (False, kept)):
        buffer = io.StringIO()
        console = TerminalConsole(file=buffer, force_terminal=is_terminal, width=500, highlight=False)
        table = Table()
        table.add_column("cell")
        table.add_row(HOSTILE)
        console.print(HOSTILE, markup=False, style="bold")  # a str
        console.print(Text(HOSTILE))  # a Text, as `watch` and the live lines build them
        console.print(table)
        printed = buffer.getvalue()
        assert printed.count(expected) == 3, printed
        if is_terminal:  # its own styles pass; none of the text's sequences do
            assert "\x1b[1m" in printed and "\x1b]" not in printed and "\x1b[2J" not in printed


def test_the_streamed_reply_and_the_prompt_line_escape_it_too() -> None:
    leader, follower = pty.openpty()
    try:
        with open(follower, "w", closefd=False) as terminal:
            stream = ReplyStream(terminal)
            stream(HOSTILE)
        assert os.read(leader, 4096).decode() == SHOWN.replace("\n", "\r\n")
    finally:
        os.close(leader)
        os.close(follower)
    piped = io.StringIO()
    ReplyStream(piped)(HOSTILE)
    assert piped.getvalue() == HOSTILE  # to a pipe, as it is
    line = PromptLine("> ", file=io.StringIO())
    line.prompt = f"mcp asks: {HOSTILE} "  # an elicitation's question
    assert line.prompt == f"mcp asks: {SHOWN} "
