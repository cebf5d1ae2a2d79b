"""Run a program in a process group of its own, its output read as it arrives under a byte cap.

`bash` and `grep` (rg) run here. Each run gets a new session, so its whole process tree can be
killed at once, and (for `bash`) a mark in its environment, so the processes that left the group
are found too (`processes.py`); and it starts under the tether (`tether.py`), so that it dies with
this process also when nothing here runs to kill it (SIGKILL, a crash). The group dies on timeout, on cancellation of the awaiting task,
when the program returns (leftover background jobs), when output that must not go past its cap
does, and by `kill_all_processes` when the program stops on Ctrl-C, SIGTERM or SIGHUP. A call's kill
runs in a thread of its own (`Spawned.kill`), awaited by the call: the event loop it shares with every
other session's tools, the servers and the model host runs on meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .base import MAX_OUTPUT_BYTES
from .processes import MARK_ENV, kill_call, new_mark, tethered, track_group
from .threads import start_thread

# Once the group is killed, output still buffered in the pipe arrives at once; this only bounds
# the wait for a process that escaped the group (setsid) and still holds the pipe open.
DRAIN_GRACE_SECONDS = 1.0


class OutputBuffer:
    """Keeps the head (and the tail) of a stream under a byte cap, counting everything that passed.

    `text()` is what the model reads of one that keeps its tail (bash's output); one that does not
    (`keep_tail=False`, rg's) holds the first `max_bytes` in `head`, for its caller to read.
    """

    def __init__(self, max_bytes: int = MAX_OUTPUT_BYTES, *, keep_tail: bool = True) -> None:
        self.half = max_bytes // 2
        self.n_head = self.half if keep_tail else max_bytes
        self.n_tail = self.half if keep_tail else 0
        self.head = bytearray()
        self.tail = bytearray()
        self.n_bytes = 0

    @property
    def full(self) -> bool:
        """More passed than the buffer keeps."""
        return self.n_bytes > len(self.head) + len(self.tail)

    def add(self, chunk: bytes) -> None:
        self.n_bytes += len(chunk)
        room = self.n_head - len(self.head)
        self.head += chunk[:room]
        if self.n_tail:
            self.tail += chunk[room:]
            del self.tail[: -self.n_tail]

    def text(self) -> str:
        """The output as the model reads it, at most `2 * half` bytes of UTF-8 and a note.

        Decoding replaces each invalid byte by U+FFFD, three bytes of UTF-8: the cap applies to the
        decoded text, so binary output cannot triple it."""
        head = self.head.decode(errors="replace")
        tail = self.tail.decode(errors="replace")
        if not self.full and len((head + tail).encode()) <= 2 * self.half:
            return head + tail
        note = f"[output truncated: {self.n_bytes} bytes total; showing the first and last {self.half} bytes]"
        head = head.encode()[: self.half].decode(errors="ignore")  # a character cut in two is dropped
        tail = tail.encode()[-self.half :].decode(errors="ignore")
        return f"{head}\n{note}\n{tail}"


class OutputSink(Protocol):
    """Where a program's output goes as it arrives: `OutputBuffer`, or a background command's log."""

    @property
    def full(self) -> bool: ...

    def add(self, chunk: bytes) -> None: ...


class _CommandProtocol(asyncio.SubprocessProtocol):
    """Feeds output into the buffers as it arrives and signals the program's exit apart from EOF.

    `Process.wait()` returns only once every pipe is closed, which a background job holding
    stdout would delay until the timeout; `exited` fires when the program itself is done.
    `overflowed` fires once a capped output passes its cap.
    """

    def __init__(self, output: OutputSink, errors: OutputSink | None, stop_when_full: bool) -> None:
        loop = asyncio.get_running_loop()
        self.buffers = {1: output, 2: errors if errors is not None else output}
        self.stop_when_full = stop_when_full
        self.exited: asyncio.Future[None] = loop.create_future()
        self.overflowed: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        buffer = self.buffers[fd]
        buffer.add(data)
        if self.stop_when_full and fd == 1 and buffer.full and not self.overflowed.done():
            self.overflowed.set_result(None)

    def process_exited(self) -> None:
        self.exited.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set_result(None)


@dataclass
class Spawned:
    """A program started in a process group of its own: its transport, its output protocol, its group
    and the mark its processes carry (None: unmarked)."""

    transport: asyncio.SubprocessTransport
    protocol: _CommandProtocol
    mark: str | None
    _killed: asyncio.Future[None] | None = field(default=None, init=False, repr=False)

    @property
    def pgid(self) -> int:
        return self.transport.get_pid()

    def kill(self) -> asyncio.Future[None]:
        """Start killing the group and every marked process, once, in a thread of its own: the kill
        waits up to `TETHER_WAIT_S` for the tether and sweeps every process's environment, and the event
        loop runs every other session's tools, the servers and the host meanwhile. Done once all are dead."""
        if self._killed is None:
            self._killed = start_thread(kill_call, self.pgid, self.mark, what="kill")
        return self._killed

    async def stop(self) -> None:
        """Kill the group and every marked process (leftover background jobs too), let the output still
        in the pipe arrive and the program be reaped. A cancellation meanwhile waits for the kill to end,
        then goes on: nothing the program started runs once this returns or raises."""
        try:
            await _to_the_end(self.kill())
            await asyncio.wait({self.protocol.closed}, timeout=DRAIN_GRACE_SECONDS)
        finally:
            self.transport.close()


async def _to_the_end(future: asyncio.Future[None]) -> None:
    """Await `future` until it is done, also when the awaiting task is cancelled meanwhile; then raise
    that cancellation."""
    cancelled = False
    while True:
        try:
            await asyncio.shield(future)
            break
        except asyncio.CancelledError:
            if future.cancelled():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


async def spawn_command(
    args: Sequence[str],
    *,
    cwd: Path,
    output: OutputSink,
    errors: OutputSink | None = None,
    stop_when_full: bool = False,
    marked: bool = True,
    stdin: bytes | None = None,
) -> Spawned:
    """Start `args` in a new session (its own process group), its output going to `output`; a
    cancellation while it starts kills what started. The caller waits for it and `stop()`s it."""
    mark = new_mark() if marked else None
    env = {**os.environ, MARK_ENV: mark} if mark is not None else None
    command, lifeline = tethered(args)
    spawn = asyncio.ensure_future(
        asyncio.get_running_loop().subprocess_exec(
            lambda: _CommandProtocol(output, errors, stop_when_full),
            *command,
            cwd=cwd,
            stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if errors is None else subprocess.PIPE,
            start_new_session=True,
            env=env,
            pass_fds=(lifeline,),
        )
    )
    try:
        transport, protocol = await asyncio.shield(spawn)
    except asyncio.CancelledError:
        # Cancelled while the program was starting: it may already run; wait for it, kill its group.
        transport, protocol = await spawn
        await Spawned(transport, protocol, mark).stop()  # type: ignore[arg-type]
        raise
    track_group(transport.get_pid())
    if stdin is not None:  # written as the pipe takes it; a program that never reads it is not waited for
        pipe = transport.get_pipe_transport(0)
        pipe.write(stdin)  # type: ignore[union-attr]
        pipe.write_eof()  # type: ignore[union-attr]
    return Spawned(transport, protocol, mark)  # type: ignore[arg-type]


async def wait_command(spawned: Spawned, timeout: float | None) -> int | None:
    """The exit code once the program exits, or None when `timeout` passed first (or its capped
    output overflowed); the program is not stopped here."""
    protocol = spawned.protocol
    done, _ = await asyncio.wait({protocol.exited, protocol.overflowed}, timeout=timeout, return_when="FIRST_COMPLETED")
    return spawned.transport.get_returncode() if protocol.exited in done else None


async def run_command(
    args: Sequence[str],
    *,
    cwd: Path,
    timeout: float,
    output: OutputSink,
    errors: OutputSink | None = None,
    stop_when_full: bool = False,
    marked: bool = True,
    stdin: bytes | None = None,
) -> int | None:
    """Run `args` to its end; every process it started is dead when this returns or raises.

    Returns the exit code, or None when it was killed: on timeout, or (`stop_when_full`) once its
    standard output passed `output`'s cap, which `output.full` then says.

    Args:
        errors: where standard error goes; None merges it into `output`.
        marked: mark the processes so that those leaving the group are found and killed too
            (a shell's jobs may; a program that starts no others needs no search for them).
        stdin: what the program reads on its standard input (a hook's event), then end of file;
            None: nothing (`/dev/null`).
    """
    spawned = await spawn_command(
        args, cwd=cwd, output=output, errors=errors, stop_when_full=stop_when_full, marked=marked, stdin=stdin
    )
    try:
        return await wait_command(spawned, timeout)
    finally:
        # Also on cancellation: the group and every marked process die before this returns or re-raises.
        await spawned.stop()
