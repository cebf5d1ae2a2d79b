"""`subagent mcp`: the sub-agents as an MCP server over stdio, for Claude Code, Codex, Cursor, ...

A front end like the CLI: it builds one `Runner` (on the first call, once the workspace is known)
and keeps it for the life of the process, so every call reuses the resident host, its KV pool and
the agents' shared prefixes. The tools:

- `list_agents`: the agents the server can run, and the project agents it withholds without `--yes`
  (`agent_list.py`);
- `run_agents`: the `subagent` tool's three forms (one task, parallel tasks, a chain), read by
  `tools/delegation.py` (`parse_delegation`); the tasks run at the top level through `Runner.delegate`,
  and the call answers within its budget or as an MCP task (`run_agents.py`; its answer, `run_outcome.py`);
- `start_agents`, `agent_status`, `agent_output`, `send_to_agent`, `cancel_agent`: the same forms
  started in the background on the server's one task board, then watched, read, steered and
  stopped by id (`tasks.py`).

Both revisions on one endpoint: the SDK serves a 2025 handshake or 2026-07-28 requests as they come;
a 2026-07-28 client that declares the Tasks extension gets `run_agents` as an MCP task (`call_tasks.py`).

A call with a progress token gets one progress notification per runner event that says something
(turns, tool calls, tokens), in order. A cancelled call cancels its children (their `bash` groups
are killed as they unwind) and, as the protocol requires, is not answered. Every bad call is a
result with `isError`; nothing a client sends stops the server (a malformed request is answered
by `stdio.py`). A stop signal (SIGINT, SIGTERM, SIGHUP) aborts every task, lets the calls in progress
answer with what was done, saves, and `serve_stdio` returns 128 + the signal. Logs go to stderr and
to `$MLX_SUBAGENTS_HOME/logs/mcp.log` (`server_log.py`): stdout is the protocol channel.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import warnings
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import mcp_types as types
from mcp.server import Server, ServerRequestContext
from mcp.server.caching import CacheHint
from mcp.server.session import ServerSession
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError

from .. import __version__
from ..deadlines import within
from ..errors import SubagentError
from ..events import EventSink
from ..results import stop_reason
from ..runs.board import TaskBoard
from ..runs.runner import Runner
from .agent_list import LIST_AGENTS_DESCRIPTION, AgentList, agent_lines, agent_list, list_result, unconfirmed_agents
from .budget import DEFAULT_CALL_BUDGET
from .call_tasks import CallTasks
from .notices import ClientLog, call_client, on_event, quiet
from .run_agents import RunAgents, describe_run_agents, parsed, refused_or, run_schema
from .run_outcome import RunOutcome
from .server_log import log_path, setup_logging
from .stdio import StdinLines, stop_signals
from .tasks import ServerTasks, error

SERVER_NAME = "mlx-subagents"
TOOL_NAMES = (
    "list_agents",
    "run_agents",
    "start_agents",
    "agent_status",
    "agent_output",
    "send_to_agent",
    "cancel_agent",
)
# How long a stop signal waits for the calls in progress to answer with their aborted tasks.
STOP_WAIT_S = 15.0
ANSWER_GRACE_S = 0.2
# Why a server an agent calls here gets no answer to its elicitation: this server does not pass it on.
NO_PERSON = "nobody can answer through subagent mcp (its MCP client is not asked)"
# The JSON-RPC error code of a method refused for the server's set-up (no workspace): a server error.
REFUSED = -32000
# How long a 2026-07-28 client may keep `tools/list` (the agents' files are read again at each call).
LIST_TTL_MS = 30_000
MakeRunner = Callable[[Path, EventSink], Runner]

log = logging.getLogger("mlx_subagents.mcp")


# -- the server ---------------------------------------------------------------------------------------


class AgentsServer:
    """The tools over one lazily built, resident `Runner` and its board of started tasks.

    Args:
        make_runner: builds the runner for a workspace with an event sink (the CLI passes its own
            options through this, so the server runs exactly what `subagent run` would).
        cwd: the workspace; None to take the client's first root (else the working directory).
        here: the working directory a client without roots works in (default: this process's; a
            relayed client's is its own process's).
    """

    def __init__(
        self,
        make_runner: MakeRunner,
        cwd: Path | None = None,
        call_budget: float | None = DEFAULT_CALL_BUDGET,
        *,
        here: Path | None = None,
        calls: CallTasks | None = None,
    ) -> None:
        self.make_runner = make_runner
        self.cwd = cwd
        self.here = here
        self.runner: Runner | None = None
        self.tasks: ServerTasks | None = None
        self.calls = calls or CallTasks()  # the calls answered with an MCP task (a server's own, or shared)
        self.run_agents = RunAgents(call_budget, self.calls, self._runner, lambda runner: self._tasks(runner).board)
        self._lock = asyncio.Lock()
        self._calls = 0  # tool calls being answered
        self._idle = asyncio.Event()
        self._idle.set()
        # Each client connection's log level and messages (the SDK makes a ServerSession per request).
        self._logs: weakref.WeakKeyDictionary[Any, ClientLog] = weakref.WeakKeyDictionary()

    @property
    def call_budget(self) -> float | None:
        """The seconds a `run_agents` call may take (`budget.py`); None: no budget."""
        return self.run_agents.call_budget

    def server(self) -> Server[Any]:
        return make_server(self.list_tools, self.call_tool, self.set_level, self.calls)

    async def stop(self, reason: str, wait: float = STOP_WAIT_S) -> None:
        """A stop signal: abort every task, started or in a call, with `reason`; return once the calls
        have answered with what was done (at most `wait` seconds)."""
        if self.tasks is not None:
            self.tasks.board.cancel_all(reason)
        if self.runner is not None:
            self.runner.cancel(reason=reason)
        try:
            await within(self._idle.wait(), wait)
        except asyncio.TimeoutError:
            log.warning("%d call(s) still running after %gs; stopping anyway", self._calls, wait)

    async def close(self) -> None:
        """Cancel the started tasks that still run (their processes killed, their work saved), then stop."""
        if self.tasks is not None:
            await self.tasks.close()
        await self.run_agents.close()
        for client in list(self._logs.values()):
            await client.close()
        if self.runner is not None:
            await self.runner.close()

    # -- handlers ---------------------------------------------------------------------------------

    def client_log(self, session: ServerSession) -> ClientLog:
        """The log of the connection `session` belongs to, made at its first request."""
        connection = getattr(session, "_connection", session)  # the SDK's per-request session is a proxy
        client = self._logs.get(connection)
        if client is None:
            client = self._logs[connection] = ClientLog()
        client.session = session
        return client

    async def set_level(self, ctx: ServerRequestContext[Any], params: types.SetLevelRequestParams) -> types.EmptyResult:
        """`logging/setLevel`: the connection's log messages from now on are those at `level` and above."""
        self.client_log(ctx.session).level = params.level
        log.info("the client set its log level to %s", params.level)
        return types.EmptyResult()

    async def list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        try:
            runner = await self._runner(ctx)
        except SubagentError as exc:  # the same refusal a call gets, as this method's JSON-RPC error
            log.warning("tools/list refused: %s", exc)
            raise MCPError(REFUSED, str(exc)) from None
        return types.ListToolsResult(
            tools=[
                types.Tool(
                    name="list_agents",
                    description=LIST_AGENTS_DESCRIPTION,
                    input_schema={"type": "object", "properties": {}, "additionalProperties": False},
                    output_schema=AgentList.model_json_schema(),
                    annotations=types.ToolAnnotations(read_only_hint=True, open_world_hint=False),
                ),
                types.Tool(
                    name="run_agents",
                    description=describe_run_agents(runner, self.call_budget),
                    input_schema=run_schema(runner),
                    output_schema=RunOutcome.model_json_schema(),
                    annotations=types.ToolAnnotations(destructive_hint=True, open_world_hint=False),
                ),
                *self._tasks(runner).tools(run_schema(runner), agent_lines(runner)),
            ]
        )

    async def call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult | dict[str, Any]:
        started = time.perf_counter()
        log.info("call %s %s", params.name, _brief(params.arguments))
        self._calls += 1
        self._idle.clear()
        client = self.client_log(ctx.session)
        client.calls.add(ctx.request_id)
        reset = call_client.set((client, ctx.request_id))  # the tasks it starts log to this client
        try:
            result = await self._call(ctx, params, started)
            await client.flush()
            return result
        finally:
            call_client.reset(reset)
            client.calls.discard(ctx.request_id)
            self._calls -= 1
            if not self._calls:
                self._idle.set()

    async def _call(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams, started: float
    ) -> types.CallToolResult | dict[str, Any]:
        try:
            if params.name == "list_agents":
                result = list_result(agent_list(await self._runner(ctx)))
            elif params.name == "run_agents":
                result = await self.run_agents.answer(ctx, params.arguments or {}, started)
            elif params.name == "start_agents":
                result = await self._start_agents(ctx, params.arguments or {})
            elif (call := self._tasks(await self._runner(ctx)).handler(params.name)) is not None:
                result = await call(params.arguments or {})
            else:
                names = ", ".join(TOOL_NAMES[:-1]) + f" and {TOOL_NAMES[-1]}"
                result = error(f"unknown tool '{params.name}'; this server has {names}")
        except asyncio.CancelledError:
            log.info("call %s cancelled by the client after %.1fs", params.name, time.perf_counter() - started)
            raise
        except SubagentError as exc:  # the workspace or the agents cannot be loaded
            log.warning("call %s refused: %s", params.name, exc)
            result = error(str(exc))
        except Exception as exc:  # never let one call stop the server
            log.exception("call %s failed", params.name)
            result = error(f"internal error: {type(exc).__name__}: {exc}; the server log is {log_path()}")
        log.info("call %s %s in %.1fs", params.name, _verdict(result), time.perf_counter() - started)
        return result

    # -- start_agents -----------------------------------------------------------------------------------

    async def _start_agents(self, ctx: ServerRequestContext[Any], arguments: dict[str, Any]) -> types.CallToolResult:
        """`run_agents`'s forms, read by the same parser, started on the board: the ids at once."""
        runner = await self._runner(ctx)
        tasks = self._tasks(runner)
        call = parsed(runner, {**arguments, "background": True}, "start_agents")
        if isinstance(call, types.CallToolResult):
            return call
        started = await refused_or(runner, call, "start_agents", lambda: runner.start_background(call, tasks.board))
        if isinstance(started, types.CallToolResult):
            return started
        return tasks.started([h.id for h in started])

    def _tasks(self, runner: Runner | None = None) -> ServerTasks:
        """The server's started tasks, on one board made with the runner."""
        if self.tasks is None:
            assert runner is not None
            self.tasks = ServerTasks(TaskBoard(runner.workspace, on_event=runner.on_event), wait_cap=self.call_budget)
        return self.tasks

    # -- the workspace and the runner --------------------------------------------------------------------

    async def _runner(self, ctx: ServerRequestContext[Any]) -> Runner:
        """The resident runner, its agents read again: a file added since the last call is seen now."""
        async with self._lock:
            if self.runner is None:
                root = self.cwd or await client_root(ctx.session) or working_directory(self.here)
                self.runner = self.make_runner(root.resolve(), on_event)
                self.runner.no_person = NO_PERSON
                unconfirmed = ", ".join(a.name for a in unconfirmed_agents(self.runner)) or "none"
                log.info("workspace %s; project agents withheld: %s", self.runner.cwd, unconfirmed)
            else:
                self.runner.refresh_agents()
            return self.runner


def make_server(
    list_tools: Callable[
        [ServerRequestContext[Any], types.PaginatedRequestParams | None], Awaitable[types.ListToolsResult]
    ],
    call_tool: Callable[[ServerRequestContext[Any], types.CallToolRequestParams], Awaitable[Any]],
    set_level: Callable[[ServerRequestContext[Any], types.SetLevelRequestParams], Awaitable[types.EmptyResult]],
    calls: CallTasks,
) -> Server[Any]:
    """The MCP server over these handlers (`AgentsServer`'s own, or a front that picks one per client),
    for both revisions on one endpoint: the SDK serves a 2025 handshake or a 2026-07-28 request as it
    comes; `calls` adds the Tasks extension; `tools/list` carries a cache hint for 2026-07-28 clients."""
    with quiet():  # the SDK's deprecation warning for logging (see notices.py)
        server: Server[Any] = Server(
            SERVER_NAME,
            version=__version__,
            instructions=INSTRUCTIONS,
            cache_hints={"tools/list": CacheHint(ttl_ms=LIST_TTL_MS, scope="private")},
            on_list_tools=list_tools,
            on_call_tool=call_tool,
            on_set_logging_level=set_level,
        )
    calls.install(server)
    return server


async def client_root(session: ServerSession) -> Path | None:
    """The client's first `file://` root, when it declares roots and answers."""
    caps = session.client_capabilities
    if caps is None or caps.roots is None or not session.can_send_request:  # 2026-07-28: no request to the client
        return None
    try:
        with warnings.catch_warnings():  # roots are deprecated in the 2026-07-28 revision, still served before
            warnings.simplefilter("ignore")
            listed = await session.list_roots()
    except Exception as exc:
        log.warning("the client declares roots but did not list them (%s); using the working directory", exc)
        return None
    for root in listed.roots:
        url = urlparse(str(root.uri))
        if url.scheme == "file" and Path(unquote(url.path)).is_dir():
            return Path(unquote(url.path))
    return None


def working_directory(here: Path | None = None) -> Path:
    """The server's own folder (or `here`) as the workspace, unless it is `/` or home (Cursor starts
    servers in `/`)."""
    here = (here or Path.cwd()).resolve()
    if here in (Path(here.anchor), Path.home().resolve()):
        raise SubagentError(
            f"no workspace: the server runs in {here} and the client gave no root; add --cwd PROJECT_FOLDER to the "
            "server's command in the MCP client configuration"
        )
    return here


INSTRUCTIONS = (
    "Local coding sub-agents on a small model running on this machine: free, private, slower and less capable "
    "than you. Hand them bounded, checkable jobs (map a module, find every caller, review a file, run the tests "
    "and report) with run_agents, and keep the reasoning for yourself. list_agents says who can do what."
)


def _verdict(result: types.CallToolResult | dict[str, Any]) -> str:
    """How a call answered, for the log: ok, error, or the MCP task it became."""
    if isinstance(result, dict):
        return f"as task {result['taskId'][:8]}..."
    return "error" if result.is_error else "ok"


def _brief(arguments: dict[str, Any] | None) -> str:
    text = repr(arguments or {})
    return text if len(text) <= 300 else text[:300] + "..."


# -- running ------------------------------------------------------------------------------------------


@dataclass
class Takeover:
    """A relayed session served here from where `subagent serve` left it (`relay.py`): the relay's input
    lines, read on from the client's handshake replayed first (`stdin`), and an output that drops the
    replayed handshake's answer (`stdout`)."""

    lines: StdinLines
    stdin: Any
    stdout: Any


async def serve_stdio(
    make_runner: MakeRunner,
    cwd: Path | None = None,
    call_budget: float | None = DEFAULT_CALL_BUDGET,
    *,
    takeover: Takeover | None = None,
) -> int:
    """Serve until the client closes stdin, or a stop signal; the runner and its hosts live as long.

    Returns the exit code: 0, or 128 + the signal (130, 143, 129) once the tasks it stopped have
    answered their calls and been saved.
    """
    path = setup_logging()
    agents = AgentsServer(make_runner, cwd, call_budget)
    server = agents.server()
    lines = takeover.lines if takeover else StdinLines()
    stopped: list[signal.Signals] = []
    stopping: list[asyncio.Future[None]] = []
    log.info("mlx-subagents %s MCP server on stdio (pid %d); log %s", __version__, os.getpid(), path)
    if takeover is not None:
        log.warning("serving a session relayed to a server that went away, from where it was")

    async def stop(signum: signal.Signals) -> None:
        log.info("%s received: stopping every task", signum.name)
        await agents.stop(stop_reason(signum))
        # The answers are on their way to the transport's writer; the end of the input cancels the
        # handlers that have not handed theirs over yet, so give the writer a moment first.
        await asyncio.sleep(ANSWER_GRACE_S)
        lines.end()

    def on_signal(signum: signal.Signals) -> None:
        stopped.append(signum)
        stopping.append(asyncio.ensure_future(stop(signum)))  # held: a task nobody holds may be collected

    try:
        with stop_signals(on_signal):  # still wired while the tasks save: a second signal exits at once
            try:
                stdin, stdout = (takeover.stdin, takeover.stdout) if takeover else (lines, None)
                async with stdio_server(stdin=stdin, stdout=stdout) as (read_stream, write_stream):
                    lines.answers = write_stream
                    await server.run(read_stream, write_stream, server.create_initialization_options())
            finally:
                await agents.close()
    finally:
        lines.restore()
        log.info("stopped")
    return 128 + stopped[0] if stopped else 0
