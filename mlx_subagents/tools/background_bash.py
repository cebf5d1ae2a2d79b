"""Background commands: a `bash` call with `"background": true` is a task on its agent's board (`bash#1`).

It starts as a foreground command does (a process group of its own, its processes marked, in the
agent's sandbox when it has one) and the call returns its id at once. It runs until it exits, its
`timeout`, a cancel (`task_cancel`, Ctrl-C, SIGTERM) or its agent's end; each of those kills its
process group and sweeps the processes that left it (`processes.py`), leftover jobs included, as a
foreground command's return does. Its output goes to a log file, capped: the first `MAX_KEPT_BYTES`
are kept on disk, past that only the last `TAIL_BYTES` (in memory). Its end is a notice to its agent,
as a background sub-agent's is (`runs/board.py`); the same tools read both (`background.py`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from ..deadlines import within
from ..errors import TaskStateError
from ..results import RunResult, StopReason, TaskStatus
from ..text import one_line
from .command import Spawned, spawn_command, wait_command

MAX_KEPT_BYTES = 1024 * 1024
TAIL_BYTES = 16 * 1024
COMMAND_AGENT = "bash"  # the `agent` a command's status names, and its ids' prefix (`bash#1`)
CommandState = Literal["running", "completed", "failed", "aborted"]


class CommandLog:
    """A background command's output: the first `max_bytes` written to `path` as they arrive, and
    the last `tail_bytes` kept in memory, so the end of a long output is never lost."""

    def __init__(self, path: Path, max_bytes: int = MAX_KEPT_BYTES, tail_bytes: int = TAIL_BYTES) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.max_bytes = max_bytes
        self.tail_bytes = tail_bytes
        self.n_bytes = 0
        self.n_kept = 0
        self._tail = bytearray()
        self._file = path.open("wb")

    @property
    def full(self) -> bool:
        """Never: a background command is not stopped for its output (`OutputSink`)."""
        return False

    def add(self, chunk: bytes) -> None:
        self.n_bytes += len(chunk)
        if self._file is not None and self.n_kept < self.max_bytes:
            kept = chunk[: self.max_bytes - self.n_kept]
            self._file.write(kept)
            self._file.flush()
            self.n_kept += len(kept)
        self._tail += chunk
        del self._tail[: -self.tail_bytes]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def text(self) -> str:
        """Everything kept: the file, then (past the cap) a note and the tail."""
        try:
            head = self.path.read_bytes()[: self.n_kept].decode(errors="replace")
        except OSError as exc:  # its run folder was removed while it ran
            return f"[its output file {self.path} cannot be read: {exc.strerror}]"
        if self.n_bytes <= self.n_kept:
            return head
        tail = bytes(self._tail).decode(errors="ignore")  # a character cut in two is dropped
        note = (
            f"[output truncated: {self.n_bytes:,} bytes in all; the first {self.n_kept:,} are above, "
            f"the last {len(self._tail):,} below]"
        )
        return f"{head}\n{note}\n{tail}"

    def last_line(self) -> str:
        """The last non-empty line so far (what a status line and a notice show)."""
        lines = bytes(self._tail).decode(errors="replace").splitlines()
        return next((line.strip() for line in reversed(lines) if line.strip()), "")


class CommandTask:
    """One background command, held on its agent's board like a background sub-agent (`BoardTask`).

    Args:
        task_id: its id on the board (`bash#1`).
        command: the command as the model wrote it (its status and notice show it).
        timeout: seconds before it is killed.
        on_end: told once when it has ended (its board's notice).
    """

    background = True
    held = False
    run_id: str | None = None
    result: RunResult | None = None  # no agent run: nothing for its parent's `children` usage

    def __init__(
        self,
        task_id: str,
        command: str,
        *,
        cwd: Path,
        timeout: float,
        log: CommandLog,
        on_end: Callable[[CommandTask], None],
    ) -> None:
        self.id = self.label = task_id
        self.agent = COMMAND_AGENT
        self.command = command
        self.cwd = cwd
        self.timeout = timeout
        self.log = log
        self.on_end = on_end
        self.cancel_reason: str | None = None
        self.exit_code: int | None = None
        self.error: str | None = None
        self._state: CommandState = "running"
        self._spawned: Spawned | None = None
        self._watch: asyncio.Task[None] | None = None
        self._done = asyncio.Event()
        self._stop = asyncio.Event()  # set by `cancel()`: a watch that has not run yet still sees it
        self._started = time.monotonic()
        self._ended: float | None = None

    async def start(self, args: Sequence[str]) -> None:
        """Start the program and watch it to its end, in the background."""
        try:
            self._spawned = await spawn_command(args, cwd=self.cwd, output=self.log)
        except BaseException:
            self.log.close()
            raise
        self._watch = asyncio.ensure_future(self._run(self._spawned))

    async def _run(self, spawned: Spawned) -> None:
        code: int | None = None
        ended = asyncio.ensure_future(wait_command(spawned, self.timeout))
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            done, _ = await asyncio.wait({ended, stopped}, return_when=asyncio.FIRST_COMPLETED)
            code = ended.result() if ended in done else None
        except asyncio.CancelledError:
            pass  # the loop is going away; the group dies below either way
        finally:
            ended.cancel()
            stopped.cancel()
            await spawned.stop()
            self.log.close()
        self.exit_code = code
        if code == 0:
            self._state = "completed"
        elif code is not None:
            self._state, self.error = "failed", f"exit code {code}"
        elif self.cancel_reason is not None:
            self._state, self.error = "aborted", self.cancel_reason
        else:
            self._state, self.error = "failed", f"timed out after {self.timeout:g}s; its process group was killed"
        self._ended = time.monotonic()
        self._done.set()
        self.on_end(self)

    # -- what its board and the tools ask of it (`BoardTask`) -------------------------------------------

    @property
    def status(self) -> CommandState:
        return self._state

    @property
    def alive(self) -> bool:
        return self._ended is None

    def snapshot(self) -> TaskStatus:
        end = self._ended if self._ended is not None else time.monotonic()
        return TaskStatus(
            id=self.id,
            agent=self.agent,
            kind="command",
            status=self._state,
            last_tool=f"$ {one_line(self.command)}",
            elapsed_s=round(end - self._started, 1),
            output=self.log.last_line(),
            error=self.error,
            exit_code=self.exit_code,
        )

    def full_output(self) -> str:
        return self.log.text()

    def cancel(self, reason: str | None = None, stop_reason: StopReason = "cancelled") -> bool:
        """Kill it (its group and every process it left); False when it already ended. (It ends aborted
        with `reason`, whatever stopped it: a command has no turns to time out.)"""
        if not self.alive or self.cancel_reason is not None or self._spawned is None:
            return False
        self.cancel_reason = reason or "cancelled"
        self._spawned.kill()  # now (off the event loop), whether or not its watch has run yet; it awaits the kill
        self._stop.set()
        return True

    def send(self, message: str) -> None:
        raise TaskStateError(
            f"task '{self.id}' is a command: it reads no messages (its stdin is empty); "
            "cancel it with task_cancel and start another"
        )

    async def wait(self, timeout: float | None = None) -> RunResult | None:
        """Wait up to `timeout` seconds for it to end (a command has no `RunResult`)."""
        try:
            await within(self._done.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return None

    async def join(self) -> None:
        if self._watch is not None:
            await asyncio.gather(self._watch, return_exceptions=True)

    async def let_go(self, reason: str) -> None:  # nothing held: its output stays readable
        return None
