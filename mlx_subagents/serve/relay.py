"""`subagent mcp` with a server running: the client's stdio relayed to `subagent serve`, line for line.

What client configurations already start (`subagent mcp ...`) then shares the one server: its
messages go to the server's unix socket and the server's come back, unchanged, so the client's
roots requests, cancellations and progress pass through as they would to a server of its own. The
relay answers malformed lines itself (`StdinLines`), tells the server its flags, working directory
and `--cwd`, and nothing more.

If the server goes away:

- killed or crashed (its connection ends without a word): every call in flight is answered with
  one error line, and the relay serves the client in-process from there on (`serve_stdio` with a
  `Takeover`: the client's handshake replayed, its answer dropped), loading the model itself;
- stopped on purpose (`subagent serve --stop`; the server says so first): its calls are answered
  with what their tasks had done, then the relay exits (0); the client starts `subagent mcp` again
  when it reconnects, in-process while no server runs.

A stop signal (SIGINT, SIGTERM, SIGHUP) closes the connection, which cancels (and saves) the calls
the server was running for this client, and exits with 128 + the signal.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import mcp_types as types
from mcp.shared.message import SessionMessage

from ..mcp_server.server import REFUSED, MakeRunner, Takeover, serve_stdio
from ..mcp_server.stdio import StdinLines, stop_signals
from .client import Connection, connect
from .protocol import STOPPING_NOTICE, Hello
from .state import ServerInfo
from .wire import Oversized

CLIENT_GONE, SERVER_GONE = "client", "server"  # which end of the relay ended first
# The id the replayed handshake's `initialize` carries: its answer is the relay's, never the client's.
TAKEOVER_ID = "mlx-subagents-takeover"


log = logging.getLogger("mlx_subagents.mcp")


class Stdout:
    """The relay's output to the client, one line at a time; `drop` is an answer id not to forward."""

    def __init__(self, drop: Any = None) -> None:
        self.drop = drop

    async def write(self, text: str) -> None:
        if self.drop is not None and self._answers(text, self.drop):
            self.drop = None
            return
        sys.stdout.buffer.write(text.encode("utf-8"))

    async def flush(self) -> None:
        sys.stdout.buffer.flush()

    async def send(self, message: SessionMessage) -> None:
        """`StdinLines.answers`: a malformed line's error, written straight back."""
        await self.write(message.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n")
        await self.flush()

    @staticmethod
    def _answers(text: str, request_id: Any) -> bool:
        try:
            message = json.loads(text)
        except ValueError:
            return False
        return isinstance(message, dict) and message.get("id") == request_id and "method" not in message


class Relay:
    """One client's session relayed to the server; see the module docstring."""

    def __init__(self, connection: Connection, info: ServerInfo) -> None:
        self.connection = connection
        self.info = info
        self.lines = StdinLines()
        self.out = Stdout()
        self.lines.answers = self.out
        self.pending: dict[Any, str] = {}  # the client's requests the server has not answered: id -> method
        self.handshake: list[dict[str, Any]] = []  # its initialize request and initialized notification
        self.stopping = False

    async def up(self) -> str:
        """The client's lines to the server until the client closes its end (`client`), or the server's
        connection breaks (`server`)."""
        async for line in self.lines:
            message = _message(line)
            if message is not None and "method" in message:
                if message["method"] in ("initialize", "notifications/initialized"):
                    self.handshake.append(message)
                if "id" in message:
                    self.pending[message["id"]] = message["method"]
            try:
                self.connection.writer.write(line.encode("utf-8") + b"\n")
                await self.connection.writer.drain()
            except ConnectionError:
                return SERVER_GONE
        return CLIENT_GONE

    async def down(self) -> str:
        """The server's lines to the client until the server's end (`server`), or the client's output
        breaks (`client`)."""
        async for line in self.connection.lines:
            if isinstance(line, Oversized):
                continue
            message = _message(line)
            if message is not None and message.get("method") == STOPPING_NOTICE:
                self.stopping = True
                continue
            if message is not None and "method" not in message:
                self.pending.pop(message.get("id"), None)
            try:
                await self.out.write(line + "\n")
                await self.out.flush()
            except OSError:  # a broken pipe: the client has gone
                return CLIENT_GONE
        return SERVER_GONE

    async def answer_pending(self) -> None:
        """One error per call in flight: the server went away under it."""
        text = (
            f"the mlx-subagents server (pid {self.info.pid}) stopped during this call; what its tasks had done is "
            "saved (subagent runs lists it). This server now runs the agents itself: call again"
        )
        for request_id in list(self.pending):
            error = types.ErrorData(code=REFUSED, message=text)
            await self.out.send(SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error)))
        self.pending.clear()

    def takeover(self) -> Takeover:
        """The session from here on, for `serve_stdio`: the handshake replayed (its answer dropped), then the client's lines."""
        replay = [dict(m, id=TAKEOVER_ID) if "id" in m else m for m in self.handshake]

        async def stdin() -> AsyncIterator[str]:
            for message in replay:
                yield json.dumps(message)
            async for line in self.lines:
                yield line

        return Takeover(self.lines, stdin(), Stdout(drop=TAKEOVER_ID if replay else None))


async def relay(
    info: ServerInfo, hello: Hello, make_runner: MakeRunner, cwd: Path | None, call_budget: float | None
) -> int:
    """Relay this process's stdio to the server; the exit code. A server that refuses or cannot be
    reached raises before anything is read (the caller serves in-process instead)."""
    connection = await connect(info, hello)
    session = Relay(connection, info)
    stopped: list[signal.Signals] = []
    log.info("relaying to the server %s", info.where())

    def on_signal(signum: signal.Signals) -> None:
        stopped.append(signum)
        connection.close()  # the server cancels and saves this client's calls
        session.lines.end()

    with stop_signals(on_signal):
        up, down = asyncio.ensure_future(session.up()), asyncio.ensure_future(session.down())
        done, _ = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
    ended = {task.result() for task in done if not task.cancelled() and task.exception() is None}
    if stopped or CLIENT_GONE in ended or not ended:  # the client is leaving (or a signal came)
        for task in (up, down):
            task.cancel()
        connection.close()
        session.lines.restore()
        return 128 + stopped[0] if stopped else 0
    up.cancel()
    down.cancel()
    await session.answer_pending()
    if session.stopping:
        print(f"mlx-subagents: the server (pid {info.pid}) was stopped; this relay exits", file=sys.stderr)
        session.lines.restore()
        return 0
    print(f"mlx-subagents: the server (pid {info.pid}) went away; serving in-process from now on", file=sys.stderr)
    return await serve_stdio(make_runner, cwd, call_budget, takeover=session.takeover())


def _message(line: str) -> dict[str, Any] | None:
    try:
        message = json.loads(line)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


__all__ = ["relay"]
