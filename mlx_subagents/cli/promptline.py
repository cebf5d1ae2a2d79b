"""The chat's prompt line: the user's next line read in a thread, so the event loop keeps running
(background sub-agents work, their notices print) while the user types.

On a terminal, `input()` gives line editing and history through `readline` where the platform has
it; off one, the line is read from stdin's descriptor (`_read_piped`). A line
printed while the prompt is shown goes above it: `above()` clears the prompt line, lets the caller
print, then draws the prompt again with what the user had typed so far (`readline`'s buffer), so
typing carries on where it was, the cursor where readline has it. Reading is on demand, one line per
`read()`: lines typed during a turn wait in the terminal for the next prompt, as they always have.

Why not prompt_toolkit (`patch_stdout`): it holds the terminal in raw mode while prompting, so Ctrl-C
stops arriving as SIGINT (the chat's one way to stop work), and it needs a second input path for a
piped stdin anyway; readline is what `input()` already uses, with no new dependency.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import sys
import termios
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from ..text import terminal_text

CLEAR_LINE = "\r\x1b[K"


class PromptLine:
    """Reads lines after `prompt`; `interactive` (a terminal on stdin and stdout) enables the redraw."""

    def __init__(self, prompt: str, *, file: TextIO | None = None) -> None:
        self._prompt = ""
        self.prompt = prompt
        self.file = file or sys.stdout
        self.interactive = _is_terminal(sys.stdin) and _is_terminal(self.file)
        self._readline: Any = None
        self._point: ctypes.c_int | None = None
        self._pending: asyncio.Future[str] | None = None
        self._saved_mode: list[Any] | None = None
        if self.interactive:
            try:
                import readline  # line editing and history for input()

                self._readline = readline
                self._point = _readline_point(readline)
            except ImportError:
                pass
            self._saved_mode = termios.tcgetattr(sys.stdin.fileno())

    @property
    def prompt(self) -> str:
        """What the line starts with: a question may quote an MCP server's text, shown, never obeyed."""
        return self._prompt

    @prompt.setter
    def prompt(self, text: str) -> None:
        self._prompt = terminal_text(text)

    @property
    def shown(self) -> bool:
        """Whether the prompt is on the screen, waiting for the user."""
        return self._pending is not None and not self._pending.done()

    async def read(self) -> str:
        """The next line (without its newline); `EOFError` at the end of input (Ctrl-D).

        Cancelling the caller leaves the read pending: the next `read()` gets that line.
        """
        if self._pending is None or self._pending.done():
            self._pending = asyncio.get_running_loop().create_future()
            threading.Thread(target=self._read_line, args=(self._pending,), daemon=True, name="chat-prompt").start()
        pending = self._pending
        line = await asyncio.shield(pending)
        self._pending = None
        return line

    def _read_line(self, future: asyncio.Future[str]) -> None:
        loop = future.get_loop()
        try:
            line = input(self.prompt) if self.interactive else self._read_piped()
        except BaseException as exc:  # EOFError, or an OSError from a closed terminal
            loop.call_soon_threadsafe(_settle, future, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, future, line, None)

    def _read_piped(self) -> str:
        """`input()` off a terminal, on stdin's file descriptor. `input()` would wait inside
        `sys.stdin`'s buffer, holding its lock, and a chat that ends meanwhile (a stop signal at the
        prompt) then aborts at interpreter shutdown ("could not acquire lock for <stdin>")."""
        try:
            fd = sys.stdin.fileno()
        except (AttributeError, ValueError, OSError):  # no descriptor (a StringIO): no lock is held
            return input(self.prompt)
        self.file.write(self.prompt)
        self.file.flush()
        data = bytearray()
        while not data.endswith(b"\n"):
            byte = os.read(fd, 1)  # a byte at a time: what follows the line stays for the next read
            if not byte:
                if not data:
                    raise EOFError("EOF when reading a line")
                break
            data += byte
        return data.decode(sys.stdin.encoding or "utf-8", errors="replace").removesuffix("\n")

    @contextmanager
    def above(self) -> Iterator[None]:
        """Print in the block: on a terminal with the prompt shown, above the prompt and the typing."""
        if not (self.interactive and self.shown):
            yield
            return
        self.file.write(CLEAR_LINE)
        self.file.flush()
        try:
            yield
        finally:
            typed = self._readline.get_line_buffer() if self._readline is not None else ""
            after = typed[len(self._typed_before_cursor(typed)) :]  # the cursor goes back where it was
            self.file.write(self.prompt + typed + "\b" * len(after))
            self.file.flush()

    def _typed_before_cursor(self, typed: str) -> str:
        """What is left of readline's cursor (`rl_point`, a byte offset); all of it when unknown."""
        if self._point is None:
            return typed
        return typed.encode()[: self._point.value].decode(errors="ignore")

    def typed(self) -> str:
        """What the person has typed at the prompt so far ("" off a terminal, where it cannot be seen)."""
        if not (self.interactive and self.shown) or self._readline is None:
            return ""
        return str(self._readline.get_line_buffer())

    def take_down(self) -> None:
        """The chat ends while the prompt waits for a line (a stop signal): on a terminal, clear the
        prompt and the typing off the screen; elsewhere end the prompt's line, so what follows starts
        a line of its own."""
        if not self.shown:
            return
        self.file.write(CLEAR_LINE if self.interactive else "\n")
        self.file.flush()

    def restore_terminal(self) -> None:
        """Put the terminal back as it was (the chat may end while `readline` holds it in its own mode)."""
        if self._saved_mode is not None:
            try:
                termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, self._saved_mode)
            except (termios.error, OSError):  # the terminal is gone (SIGHUP)
                pass


def _readline_point(readline: Any) -> ctypes.c_int | None:
    """readline's cursor offset in the line (GNU readline and libedit both export `rl_point`)."""
    try:
        return ctypes.c_int.in_dll(ctypes.CDLL(readline.__file__), "rl_point")
    except (OSError, ValueError, AttributeError):  # a build without it: the cursor is put at the end
        return None


def _settle(future: asyncio.Future[str], line: str | None, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        assert line is not None
        future.set_result(line)


def _is_terminal(file: Any) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError, OSError):
        return False


__all__ = ["PromptLine"]
