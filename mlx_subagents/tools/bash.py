"""`bash`: run a shell command in the workspace root, in its own process group.

Each command gets a new session, so its whole process tree can be killed at once, and a mark in
its environment, so the processes that left the group are found too (`processes.py`): on timeout,
on cancellation of the awaiting task, when the command returns (leftover background jobs), and
by `kill_all_processes` when the program stops on Ctrl-C, SIGTERM or SIGHUP.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from typing import Any

from pydantic import BaseModel, Field

from .base import MAX_OUTPUT_BYTES, Tool, ToolResult, error_result, one_line
from .processes import MARK_ENV, kill_call, new_mark, track_group

DEFAULT_BASH_TIMEOUT = 120
MAX_BASH_TIMEOUT = 600
# Once the group is killed, output still buffered in the pipe arrives at once; this only bounds
# the wait for a process that escaped the group (setsid) and still holds the pipe open.
DRAIN_GRACE_SECONDS = 1.0


class OutputBuffer:
    """Keeps the head and tail of a stream under a byte cap, counting everything that passed."""

    def __init__(self, max_bytes: int = MAX_OUTPUT_BYTES) -> None:
        self.half = max_bytes // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.n_bytes = 0

    def add(self, chunk: bytes) -> None:
        self.n_bytes += len(chunk)
        room = self.half - len(self.head)
        self.head += chunk[:room]
        self.tail += chunk[room:]
        del self.tail[: -self.half]

    def text(self) -> str:
        """The output as the model reads it, at most `2 * half` bytes of UTF-8 and a note.

        Decoding replaces each invalid byte by U+FFFD, three bytes of UTF-8: the cap applies to the
        decoded text, so binary output cannot triple it."""
        head = self.head.decode(errors="replace")
        tail = self.tail.decode(errors="replace")
        whole = self.n_bytes <= len(self.head) + len(self.tail)
        if whole and len((head + tail).encode()) <= 2 * self.half:
            return head + tail
        note = f"[output truncated: {self.n_bytes} bytes total; showing the first and last {self.half} bytes]"
        head = head.encode()[: self.half].decode(errors="ignore")  # a character cut in two is dropped
        tail = tail.encode()[-self.half :].decode(errors="ignore")
        return f"{head}\n{note}\n{tail}"


class _CommandProtocol(asyncio.SubprocessProtocol):
    """Feeds output into the buffer as it arrives and signals bash's exit apart from EOF.

    `Process.wait()` returns only once every pipe is closed, which a background job holding
    stdout would delay until the timeout; `exited` fires when bash itself is done.
    """

    def __init__(self, output: OutputBuffer) -> None:
        loop = asyncio.get_running_loop()
        self.output = output
        self.exited: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.output.add(data)

    def process_exited(self) -> None:
        self.exited.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set_result(None)


class BashTool(Tool):
    name = "bash"
    description = (
        "Run a bash command in the workspace root and return its combined stdout and stderr. "
        "No stdin; background processes are killed when the command returns."
    )
    read_only = False

    class Params(BaseModel):
        command: str = Field(min_length=1, description="The bash command to run.")
        timeout: int = Field(
            default=DEFAULT_BASH_TIMEOUT,
            ge=1,
            le=MAX_BASH_TIMEOUT,
            description=f"Seconds before the command is killed (at most {MAX_BASH_TIMEOUT}).",
        )

    async def run(self, params: Params) -> ToolResult:
        output = OutputBuffer()
        returncode = await self._run_command(params.command, params.timeout, output)
        text = output.text().rstrip("\n")
        if returncode is None:
            killed = f"command timed out after {params.timeout}s; its process group was killed"
            return error_result("\n".join(filter(None, [killed, text])))
        text = text or "(no output)"
        return ToolResult(text if returncode == 0 else f"{text}\n[exit code {returncode}]")

    async def _run_command(self, command: str, timeout: int, output: OutputBuffer) -> int | None:
        """The exit code, or None on timeout; every process it started is dead when this returns or raises."""
        mark = new_mark()
        spawn = asyncio.ensure_future(
            asyncio.get_running_loop().subprocess_exec(
                lambda: _CommandProtocol(output),
                "bash",
                "-c",
                command,
                cwd=self.workspace.root,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, MARK_ENV: mark},
            )
        )
        try:
            transport, protocol = await asyncio.shield(spawn)
        except asyncio.CancelledError:
            # Cancelled while bash was starting: it may already run; wait for it, kill its group.
            transport, _ = await spawn
            kill_call(transport.get_pid(), mark)
            transport.close()
            raise
        pgid = transport.get_pid()
        track_group(pgid)
        try:
            done, _ = await asyncio.wait({protocol.exited}, timeout=timeout)
            return transport.get_returncode() if done else None
        finally:
            # Also on cancellation: kill the group and every marked process (leftover background
            # jobs too), let the output still in the pipe arrive and bash be reaped, then return
            # or re-raise.
            kill_call(pgid, mark)
            try:
                await asyncio.wait({protocol.closed}, timeout=DRAIN_GRACE_SECONDS)
            finally:
                transport.close()

    def describe(self, arguments: dict[str, Any]) -> str:
        return f"$ {one_line(str(arguments.get('command', '')))}"
