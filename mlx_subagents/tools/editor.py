"""The person's editor, where a front end has one (`subagent acp`'s client): what the file and command
tools ask of it, passed down to them as an interface, so that no tool imports a front end.

An `Editor` says what it offers. A tool that changes something asks it first (`approve`: the
person allows the call once, always, or rejects it; a rejected call changes nothing and its error
says so); `read`, `edit` and `write` go through its files where it reads or writes them (so the
unsaved text of an open buffer is what the agent reads and changes); `bash` runs in its terminal where
it offers one. What it does not offer, the tool does as it always does. The workspace confinement,
the sandbox and the grants are the tool's and hold either way: the editor only ever sees a path that
`Workspace.resolve` accepted and a command already wrapped in its sandbox.

A tool does not know its call's id, which the editor shows its question on: the session sets
`current_call` around each call (a context variable, so concurrent calls each see their own).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# Why a call the person rejected did nothing (the model reads it and does something else).
REJECTED = "the person rejected this call in the editor; nothing was changed. Do something else or ask what they want"


@dataclass(frozen=True)
class CallRef:
    """Which call of which session a tool runs for: the session's label, its turn and the call's id."""

    label: str
    turn: int
    id: str


current_call: ContextVar[CallRef | None] = ContextVar("current_call", default=None)


@dataclass(frozen=True)
class FileChange:
    """What a write or an edit changes: the file, its text before (None: a new file) and after, for a diff."""

    path: Path
    old_text: str | None
    new_text: str


@dataclass(frozen=True)
class Approval:
    """What a tool asks before it changes something: its name, a title, and the change or the command."""

    tool: str
    title: str
    change: FileChange | None = None
    command: str | None = None


@dataclass(frozen=True)
class CommandOutput:
    """A command run in the editor's terminal: its output (cut to the byte cap) and its exit code (None:
    killed at its time-out)."""

    output: str
    exit_code: int | None
    truncated: bool = False


class Editor(Protocol):
    """What the editor offers the tools of a session (see the module's docstring)."""

    @property
    def reads_files(self) -> bool: ...

    @property
    def writes_files(self) -> bool: ...

    @property
    def runs_commands(self) -> bool: ...

    async def approve(self, approval: Approval) -> bool:
        """Whether the person allows the call (asked, or allowed always before)."""
        ...

    async def read_text(self, path: Path) -> str:
        """The file's text as the editor has it (an open buffer's, saved or not); `FileNotFoundError` if none."""
        ...

    async def write_text(self, path: Path, content: str) -> None:
        """Write the file through the editor (its buffer and the disk)."""
        ...

    async def run_command(self, args: Sequence[str], cwd: Path, timeout: float, max_bytes: int) -> CommandOutput:
        """Run `args` in the editor's terminal, killed after `timeout` seconds or when the call is cancelled."""
        ...


__all__ = ["REJECTED", "Approval", "CallRef", "CommandOutput", "Editor", "FileChange", "current_call"]
