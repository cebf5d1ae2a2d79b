"""`subagent acp` on stdio: the SDK's agent-side connection over checked lines, and its end.

The SDK (`agent-client-protocol`) does the protocol: its router, its types, its requests to the
client. One thing is written here by hand: reading the lines. The SDK's reader logs a line that is
not JSON with a traceback and answers nothing, so a client that sent it waits forever; here such a
line, or one that is not a JSON-RPC request, is answered with the JSON-RPC error (`-32700` parse
error, `-32600` invalid request, `id` null when it has none) and the agent reads on. And the SDK
(0.12.1) does not know ACP's `$/cancel_request` (stable since 2026-06): the lines keep the client's
requests until they are answered, and a `$/cancel_request` of one goes to the agent
(`EditorAgent.cancel_request`: a prompt's turn is interrupted, answered with the stop reason
`cancelled`).

The agent ends when the client closes stdin, or on SIGTERM or SIGHUP: every turn still running is
interrupted and saved, every session closed, the hosts stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import acp
from acp.agent.connection import AgentSideConnection
from acp.task import MessageSender, TaskSupervisor

from ..errors import SubagentError
from ..events import EventSink
from ..runs.hosts import HostPool
from ..runs.options import RunOptions
from ..runs.runner import Runner
from ..serve.state import ServerInfo
from .agent import EditorAgent
from .session import CLIENT_GONE, MakeRunner

# The longest line read (a prompt with files attached); a longer one is answered as too large.
MAX_LINE_BYTES = 50 * 1024 * 1024
STOPPED = "the agent was stopped ({signal})"
CANCEL_REQUEST = "$/cancel_request"
NOT_PIPES = (
    "subagent acp: stdin and stdout must be pipes (a file was given); start it from the editor's agent "
    "settings, or pipe its input and output (cat requests.jsonl | subagent acp | cat)"
)

log = logging.getLogger("mlx_subagents.acp")


class CheckedLines:
    """The client's lines as JSON-RPC messages (the SDK's `Transport`); what is not one is answered here,
    and a `$/cancel_request` of a request not yet answered goes to `on_cancel` with that request."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.supervisor = TaskSupervisor(source="mlx_subagents.acp")
        self.sender = MessageSender(writer, self.supervisor)
        self.pending: dict[Any, dict[str, Any]] = {}  # the client's requests not yet answered, by id
        self.on_cancel: Callable[[dict[str, Any]], None] | None = None

    async def send(self, message: dict[str, Any]) -> None:
        if "method" not in message and isinstance(message.get("id"), (int, str)):  # an answer: its request is done
            self.pending.pop(message["id"], None)
        await self.sender.send(message)

    async def close(self) -> None:
        await self.sender.close()
        await self.supervisor.shutdown()

    async def receive(self) -> dict[str, Any] | None:
        while True:
            try:
                line = await self.reader.readuntil(b"\n")
            except asyncio.IncompleteReadError as exc:
                line = exc.partial
                if not line.strip():
                    return None  # the client closed stdin
            except asyncio.LimitOverrunError as exc:
                await self._skip(exc.consumed)
                await self._error(None, -32600, f"a message over {MAX_LINE_BYTES} bytes was dropped; send it smaller")
                continue
            if not line.strip():
                continue
            message = await self._checked(line)
            if message is None:
                continue
            if message.get("method") == CANCEL_REQUEST and "id" not in message:
                self._cancel(message.get("params"))
                continue
            if "method" in message and isinstance(message.get("id"), (int, str)):
                self.pending[message["id"]] = message
            return message

    def _cancel(self, params: Any) -> None:
        """`$/cancel_request`: the request it names, if it still runs, to `on_cancel` (else nothing: a
        notification is not answered, and a request already answered has nothing left to stop)."""
        named = params.get("requestId") if isinstance(params, dict) else None
        request = self.pending.get(named) if isinstance(named, (int, str)) else None
        if request is not None and self.on_cancel is not None:
            self.on_cancel(request)

    async def _checked(self, line: bytes) -> dict[str, Any] | None:
        """The message a line holds, or None once its error is sent."""
        try:
            message = json.loads(line)
        except (ValueError, RecursionError) as exc:
            await self._error(None, -32700, f"Parse error: the line is not JSON ({one_reason(exc)})")
            return None
        if not isinstance(message, dict):
            await self._error(None, -32600, "Invalid request: a message must be a JSON object")
            return None
        named = message.get("id")
        if isinstance(named, bool) or not isinstance(named, (int, float, str, type(None))):
            await self._error(None, -32600, "Invalid request: 'id' must be a string or a number")
            return None
        if "method" in message and not isinstance(message["method"], str):
            await self._error(message.get("id"), -32600, "Invalid request: 'method' must be a string")
            return None
        if "method" not in message and "id" not in message:
            await self._error(None, -32600, "Invalid request: a message needs a 'method' (or an 'id', for a response)")
            return None
        return message

    async def _skip(self, n: int) -> None:
        """Drop an over-long line: what was read, then the rest up to its end."""
        await self.reader.readexactly(n)
        while True:
            try:
                await self.reader.readuntil(b"\n")
                return
            except asyncio.LimitOverrunError as exc:
                await self.reader.readexactly(exc.consumed)
            except asyncio.IncompleteReadError:
                return

    async def _error(self, id: Any, code: int, message: str) -> None:
        await self.send({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})


def one_reason(exc: Exception) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


def runner_factory(options: RunOptions, processor_factory: Any = None) -> MakeRunner:
    """Each session's runner over one `HostPool` for the process (one copy of each model, one KV budget)."""
    pool = HostPool(options, processor_factory)

    def make(cwd: Path, *, on_event: EventSink, ask: Any, model: str | None, plan: bool) -> Runner:
        changes = {"plan": options.plan or plan} | ({"model": model} if model else {})
        return Runner(cwd, replace(options, **changes), interactive=True, ask=ask, on_event=on_event, host_pool=pool)

    make.pool = pool  # type: ignore[attr-defined]  # closed by `serve_stdio`
    return make


async def serve_stdio(
    make_runner: MakeRunner, options: RunOptions, version: str, server: ServerInfo | None = None
) -> None:
    """Run the agent on stdin and stdout until the client goes or a signal stops it; with `server`, each
    session's chat runs on that `subagent serve`."""
    try:
        reader, writer = await acp.stdio_streams(limit=MAX_LINE_BYTES)
    except ValueError:  # asyncio reads and writes pipes, sockets and terminals only
        raise SubagentError(NOT_PIPES) from None
    lines = CheckedLines(reader, writer)
    agent = EditorAgent(make_runner, options, version, server)
    lines.on_cancel = agent.cancel_request
    conn = AgentSideConnection(agent, lines, listening=False, use_unstable_protocol=True)
    listening = asyncio.ensure_future(conn.listen())
    stopped: list[str] = []
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, lambda s=sig: (stopped.append(s.name), listening.cancel()))
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await listening
    finally:
        await agent.close_all(STOPPED.format(signal=stopped[0]) if stopped else CLIENT_GONE)
        pool = getattr(make_runner, "pool", None)
        if pool is not None:
            await pool.close()
        with contextlib.suppress(Exception):
            await conn.close()
        sys.stdout.flush()
