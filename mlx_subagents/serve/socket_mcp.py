"""MCP over one connection of the server's unix socket: a relayed `subagent mcp` client's session.

The lines are those of stdio, so the SDK's own stdio transport serves them (`stdio_server` with
explicit streams), with the same checks as on stdio (`stdio.StdinLines`: a malformed request is
answered with what is wrong) and one more: a line over the size limit is dropped and answered.
The connection's end is the client's: the SDK cancels its calls in progress (their tasks are saved
as aborted) and `serve_mcp` returns.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import mcp_types as types
from mcp.server.stdio import stdio_server
from mcp.shared.message import SessionMessage

from ..mcp_server.server import AgentsServer
from ..mcp_server.stdio import StdinLines
from .wire import MAX_LINE_BYTES, Oversized

log = logging.getLogger("mlx_subagents.serve")


class SocketLines(StdinLines):
    """`StdinLines`' checked lines, fed from a socket's lines instead of fd 0 (no thread, no fd)."""

    def __init__(self, lines: AsyncIterator[str | Oversized], on_end: Callable[[], None]) -> None:  # no fd to take
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.answers = None
        self._on_end = on_end
        self._feed = asyncio.ensure_future(self._pump(lines))

    def restore(self) -> None:
        """Nothing to give back: no file descriptor was taken."""

    async def _pump(self, lines: AsyncIterator[str | Oversized]) -> None:
        try:
            async for line in lines:
                if isinstance(line, Oversized):
                    await self._refuse(line)
                else:
                    self._queue.put_nowait(line)
        except ConnectionError:
            pass
        finally:
            self._on_end()  # before the SDK cancels the calls in progress: their tasks say why they stopped
            self._queue.put_nowait(None)

    async def _refuse(self, line: Oversized) -> None:
        message = f"Invalid request: the message is {line.n_bytes:,} bytes, over the limit of {MAX_LINE_BYTES:,}"
        log.warning("oversized message from a relayed client (%d bytes): answered with id null", line.n_bytes)
        if self.answers is not None:
            error = types.ErrorData(code=types.INVALID_REQUEST, message=message)
            await self.answers.send(SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=None, error=error)))


class SocketOut:
    """The transport's output (`stdio_server(stdout=...)`) as lines on the socket; a gone peer is ignored."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer

    async def write(self, text: str) -> None:
        if not self.writer.is_closing():
            self.writer.write(text.encode("utf-8"))

    async def flush(self) -> None:
        try:
            await self.writer.drain()
        except ConnectionError:
            pass


async def serve_mcp(
    agents: AgentsServer,
    lines: AsyncIterator[str | Oversized],
    writer: asyncio.StreamWriter,
    on_end: Callable[[], None],
) -> None:
    """Serve `agents`' tools over the connection until the client closes it (`on_end` is told first)."""
    server = agents.server()
    stdin = SocketLines(lines, on_end)
    async with stdio_server(stdin=stdin, stdout=SocketOut(writer)) as (read_stream, write_stream):  # type: ignore[arg-type]
        stdin.answers = write_stream
        await server.run(read_stream, write_stream, server.create_initialization_options())
