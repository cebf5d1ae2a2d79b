"""What `subagent chat` shows on the terminal: the parent's reply as it streams (`ReplyStream`, stdout)
and the chat's events as lines (`ChatView`, stderr), each clear of the other and above the prompt
while the user types."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import TextIO, cast

from rich.console import Console

from ..events import Event, ReasoningData
from ..render import EventLines
from ..text import terminal_text
from .promptline import PromptLine


class ReplyStream:
    """Writes the parent's reply as it is generated (the host streams only visible text: tool calls
    show up as events), without the whitespace a reply may start with."""

    def __init__(self, file: TextIO) -> None:
        self.file = file
        self.reset()
        self.dirty = False

    def reset(self) -> None:
        """A new reply starts."""
        self.started = False
        self.wrote = False

    def __call__(self, text: str) -> None:
        self._write(text)

    def end_line(self) -> None:
        if self.dirty:
            self.file.write("\n")
            self.file.flush()
            self.dirty = False

    def _write(self, text: str) -> None:
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        if text:
            self.file.write(terminal_text(text) if self.file.isatty() else text)
            self.file.flush()
            self.wrote = True
            self.dirty = not text.endswith("\n")


class ChatView:
    """The chat's events on stderr (`EventLines`, chat layout), each line clear of the streamed reply,
    and above the prompt while the user types."""

    def __init__(self, err: Console, stream: ReplyStream | None) -> None:
        self.stream = stream
        self.lines = EventLines(err, "chat")
        self.prompt: PromptLine | None = None
        self.in_background: Callable[[str], bool] = lambda _label: False  # its end is told by its notice
        self.thought = 0  # characters of reasoning streamed in the reply so far

    @property
    def parent(self) -> str:
        return self.lines.root

    @parent.setter
    def parent(self, label: str) -> None:
        self.lines.root = label

    def show(self, markup: str, *, console: Console | None = None, soft_wrap: bool = False) -> None:
        """Print one line of markup (on stderr unless `console` is given) where the user sees it;
        `soft_wrap`: never fold it (an address to copy)."""
        if self.stream is not None:
            self.stream.end_line()
        with self.prompt.above() if self.prompt is not None else nullcontext():
            (console or self.lines.console).print(markup, soft_wrap=soft_wrap)

    def handle(self, event: Event) -> None:
        if event.label == self.parent and event.kind == "reasoning":
            self.thought += len(cast(ReasoningData, event.data)["text"])
        if self.stream is not None and event.label == self.parent and event.kind == "turn_start":
            self.stream.end_line()
            self.stream.reset()
        if event.label == self.parent and event.kind in ("turn_start", "usage") and self.thought:
            # the reasoning folded to one dim line; `/think` unfolds it
            self.show(f"[dim](thought: {self.thought:,} characters; /think shows it)[/]")
            self.thought = 0
        if event.kind == "task_end" and self.in_background(event.label):
            return
        markup = self.lines.line(event)
        if markup is not None:
            self.show(markup)
