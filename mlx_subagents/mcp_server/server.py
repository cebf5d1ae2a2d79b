"""`subagent mcp`: the sub-agents as an MCP server over stdio, for Claude Code, Codex, Cursor, ...

A front end like the CLI: it builds one `Runner` (on the first call, once the workspace is known)
and keeps it for the life of the process, so every call reuses the resident host, its KV pool and
the agents' shared prefixes. The tools:

- `list_agents`: the agents the server can run, and the project agents it withholds without `--yes`;
- `run_agents`: the `subagent` tool's three forms (one task, parallel tasks, a chain), read by
  `tools/subagent.py` (`parse_delegation`, `format_outcome`); the tasks run at the top level through
  `Runner.delegate`;
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
to `$MLX_SUBAGENTS_HOME/logs/mcp.log`: stdout is the protocol channel.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import signal
import sys
import time
import warnings
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import unquote, urlparse

import anyio
import mcp_types as types
from mcp.server import Server, ServerRequestContext
from mcp.server.caching import CacheHint
from mcp.server.session import ServerSession
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError
from pydantic import BaseModel

from .. import __version__
from ..agents.context import repository_root
from ..agents.spec import AgentSpec
from ..caps import MAX_TASKS
from ..errors import ConfirmationRequired, SubagentError, ToolError
from ..events import Event, EventSink, TaskEndData, ToolCallData
from ..home import make_state_dir, state_home
from ..results import ChildrenUsage, MultiRunResult, RunResult, RunUsage, Status, StopReason, stop_reason
from ..runs.board import TaskBoard
from ..runs.runner import Runner
from ..runs.task import TaskHandle
from ..runs.workflow import find_workflow, load_workflow
from ..text import terminal_text
from ..tools.background import status_line
from ..tools.base import ToolResult
from ..tools.delegation import FORMS, Delegation, delegation_schema, parse_delegation
from ..tools.subagent import fit_answers, format_outcome
from .budget import DEFAULT_CALL_BUDGET, budget_text
from .call_tasks import CallTasks, declares
from .notices import ClientLog, Progress, quiet
from .stdio import StdinLines, stop_signals
from .tasks import CANCELLED_BY_CLIENT, ServerTasks

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
LOG_FILE = "mcp.log"
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
T = TypeVar("T")

log = logging.getLogger("mlx_subagents.mcp")


# -- what the tools return ----------------------------------------------------------------------------


class AgentInfo(BaseModel):
    name: str
    description: str
    tools: list[str]
    model: str
    source: str


class UnconfirmedAgent(BaseModel):
    name: str
    path: str


class AgentList(BaseModel):
    """`list_agents`'s structured content."""

    workspace: str
    agents: list[AgentInfo]
    withheld: list[UnconfirmedAgent]  # the field's name is what clients read
    note: str | None = None


class TaskOutcome(BaseModel):
    label: str
    agent: str
    status: Status
    stop_reason: StopReason
    error: str | None
    answer: str
    usage: RunUsage
    duration_s: float
    model: str
    transcript: str | None
    children: ChildrenUsage | None = None  # what its sub-agents used: the total and one entry per sub-agent


class RunOutcome(BaseModel):
    """`run_agents`'s structured content: every task in input order (those that finished, when the call
    budget ended first: `running` has the ids of the others, read with `agent_output`)."""

    mode: str
    ok: bool
    succeeded: int
    total: int
    run_id: str | None
    error: str | None
    tasks: list[TaskOutcome]
    running: list[str] = []


# The request an event belongs to: child tasks inherit the context of the call that started them.
_progress: contextvars.ContextVar[Progress | None] = contextvars.ContextVar("mcp_progress", default=None)
# The client whose call started the event's task, and that call's request id: its log messages.
_client: contextvars.ContextVar[tuple[ClientLog, Any] | None] = contextvars.ContextVar("mcp_client", default=None)


@dataclass
class Delegated:
    """A `run_agents` call's work, started: its result (or the refusal a client reads), and its tasks'
    handles as they start (`begun` once they have)."""

    work: asyncio.Future[MultiRunResult | types.CallToolResult]
    handles: list[TaskHandle]
    begun: asyncio.Event

    @classmethod
    def start(cls, runner: Runner, call: Delegation, var: contextvars.ContextVar[Any], value: Any) -> Delegated:
        """Start the call's tasks at the top level, with `var` set to `value` in their context."""
        handles: list[TaskHandle] = []
        begun = asyncio.Event()

        def on_handles(made: list[TaskHandle]) -> None:
            handles.extend(made)
            begun.set()

        reset = var.set(value)
        try:
            delegate = lambda: runner.delegate(call, None, on_handles=on_handles)  # noqa: E731
            work = asyncio.ensure_future(_refused_or(runner, call, "run_agents", delegate))
        finally:
            var.reset(reset)
        return cls(work, handles, begun)


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
        self.call_budget = call_budget
        self.here = here
        self.runner: Runner | None = None
        self.tasks: ServerTasks | None = None
        self.calls = calls or CallTasks()  # the calls answered with an MCP task (a server's own, or shared)
        self._lock = asyncio.Lock()
        self._calls = 0  # tool calls being answered
        self._idle = asyncio.Event()
        self._idle.set()
        # Each client connection's log level and messages (the SDK makes a ServerSession per request).
        self._logs: weakref.WeakKeyDictionary[Any, ClientLog] = weakref.WeakKeyDictionary()
        self._detached: set[asyncio.Future[Any]] = set()  # run_agents calls answered before their tasks ended

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
            await asyncio.wait_for(self._idle.wait(), wait)
        except asyncio.TimeoutError:
            log.warning("%d call(s) still running after %gs; stopping anyway", self._calls, wait)

    async def close(self) -> None:
        """Cancel the started tasks that still run (their processes killed, their work saved), then stop."""
        if self.tasks is not None:
            await self.tasks.close()
        await asyncio.gather(*self._detached, return_exceptions=True)
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
        reset = _client.set((client, ctx.request_id))  # the tasks it starts log to this client
        try:
            result = await self._call(ctx, params, started)
            await client.flush()
            return result
        finally:
            _client.reset(reset)
            client.calls.discard(ctx.request_id)
            self._calls -= 1
            if not self._calls:
                self._idle.set()

    async def _call(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams, started: float
    ) -> types.CallToolResult | dict[str, Any]:
        try:
            if params.name == "list_agents":
                result = _list_result(agent_list(await self._runner(ctx)))
            elif params.name == "run_agents":
                result = await self._run_agents(ctx, params.arguments or {}, started)
            elif params.name == "start_agents":
                result = await self._start_agents(ctx, params.arguments or {})
            elif (call := self._tasks(await self._runner(ctx)).handler(params.name)) is not None:
                result = await call(params.arguments or {})
            else:
                names = ", ".join(TOOL_NAMES[:-1]) + f" and {TOOL_NAMES[-1]}"
                result = _error(f"unknown tool '{params.name}'; this server has {names}")
        except asyncio.CancelledError:
            log.info("call %s cancelled by the client after %.1fs", params.name, time.perf_counter() - started)
            raise
        except SubagentError as exc:  # the workspace or the agents cannot be loaded
            log.warning("call %s refused: %s", params.name, exc)
            result = _error(str(exc))
        except Exception as exc:  # never let one call stop the server
            log.exception("call %s failed", params.name)
            result = _error(f"internal error: {type(exc).__name__}: {exc}; the server log is {log_path()}")
        log.info("call %s %s in %.1fs", params.name, _verdict(result), time.perf_counter() - started)
        return result

    # -- run_agents -----------------------------------------------------------------------------------

    async def _run_agents(
        self, ctx: ServerRequestContext[Any], arguments: dict[str, Any], started: float
    ) -> types.CallToolResult | dict[str, Any]:
        if "background" in arguments:
            return _error(
                "run_agents waits for its tasks and takes no 'background'; to start them and carry on, call "
                "start_agents with the same arguments"
            )
        runner = await self._runner(ctx)
        call = _parsed(runner, arguments, "run_agents")
        if isinstance(call, types.CallToolResult):
            return call
        if declares(ctx):  # a 2026-07-28 client with Tasks: a handle at once, no call budget in the way
            return await self._run_as_task(runner, call)
        token = (ctx.meta or {}).get("progress_token")
        progress = Progress(ctx.session) if token is not None else None
        # The work copies the context: every child's events find this request's `progress`.
        delegated = Delegated.start(runner, call, _progress, progress)
        work, handles = delegated.work, delegated.handles
        pump = asyncio.ensure_future(progress.pump()) if progress else None
        try:
            outcome = await self._within_budget(work, delegated.begun, started)
        except asyncio.CancelledError:
            # Cancel the children once and wait, shielded, while they kill their processes and save.
            work.cancel()
            if pump is not None:
                pump.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({work, *([pump] if pump else [])})
            raise
        if progress is not None and pump is not None:
            progress.close()
            await pump
        if outcome is None:  # the budget ended first: the tasks go on, on the board, and the answer names them
            self._detach(work)
            assert self.call_budget is not None
            return budget_result(call, handles, self._tasks(runner).board, self.call_budget)
        if isinstance(outcome, types.CallToolResult):  # refused before anything ran
            return outcome
        return run_result(call, outcome, format_outcome(call, outcome))

    async def _run_as_task(self, runner: Runner, call: Delegation) -> types.CallToolResult | dict[str, Any]:
        """`run_agents` answered with an MCP task once its tasks have started: they run on the board (a
        disconnect leaves them running, `agent_status` and `agent_output` see them), the task's status
        is theirs and its result the call's. A call refused before anything ran answers as always."""
        delegated = Delegated.start(runner, call, _client, None)  # the call answers now: its tasks log to no request
        work, handles = delegated.work, delegated.handles
        waiter = asyncio.ensure_future(delegated.begun.wait())
        try:
            await asyncio.wait({work, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if work.done() and isinstance(outcome := work.result(), types.CallToolResult):
            return outcome
        board = self._tasks(runner).board
        for handle in handles:
            if handle.alive:
                handle.hand_over(board)
        self._detach(work)

        async def result() -> types.CallToolResult:
            outcome = await asyncio.shield(work)
            assert isinstance(outcome, MultiRunResult)
            return run_result(call, outcome, format_outcome(call, outcome))

        def describe() -> str:
            return "\n".join(status_line(h.snapshot()) for h in handles) or "starting"

        def cancel() -> None:
            for handle in handles:
                if handle.alive:
                    handle.cancel(CANCELLED_BY_CLIENT)

        return self.calls.start(result(), describe, cancel)

    async def _within_budget(self, work: asyncio.Future[T], begun: asyncio.Event, started: float) -> T | None:
        """What `work` gives, or None when the call budget ends first and its tasks have started (a call
        answers with ids only once there are ids: loading the model the first time counts)."""
        if self.call_budget is None:
            return await asyncio.shield(work)
        left = self.call_budget - (time.perf_counter() - started)
        await asyncio.wait({work}, timeout=max(left, 0.0))  # never cancels `work`, even when cancelled itself
        if not work.done():
            waiter = asyncio.ensure_future(begun.wait())
            try:
                await asyncio.wait({work, waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
        return work.result() if work.done() else None

    def _detach(self, work: asyncio.Future[Any]) -> None:
        """Keep a call's work running after its answer, until its tasks end (or the server stops)."""
        self._detached.add(work)

        def ended(done: asyncio.Future[Any]) -> None:
            self._detached.discard(done)
            if not done.cancelled() and done.exception() is not None:
                log.error("run_agents tasks answered in the background failed: %r", done.exception())

        work.add_done_callback(ended)

    # -- start_agents -----------------------------------------------------------------------------------

    async def _start_agents(self, ctx: ServerRequestContext[Any], arguments: dict[str, Any]) -> types.CallToolResult:
        """`run_agents`'s forms, read by the same parser, started on the board: the ids at once."""
        runner = await self._runner(ctx)
        tasks = self._tasks(runner)
        call = _parsed(runner, {**arguments, "background": True}, "start_agents")
        if isinstance(call, types.CallToolResult):
            return call
        started = await _refused_or(runner, call, "start_agents", lambda: runner.start_background(call, tasks.board))
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


def on_event(event: Event) -> None:
    """The runner's sink: an event goes to the progress of the call it belongs to, if any."""
    progress = _progress.get()
    if progress is not None:
        progress.push(event)
    if (client := _client.get()) is not None:
        client[0].event(event, client[1])
    if event.kind == "tool_call":
        log.debug("%s %s %s", event.label, event.kind, cast(ToolCallData, event.data)["description"])
    elif event.kind == "task_end":
        log.debug("%s %s %s", event.label, event.kind, cast(TaskEndData, event.data)["status"])
    elif event.kind == "task_start":
        log.debug("%s %s ", event.label, event.kind)


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


# -- list_agents ------------------------------------------------------------------------------------


def unconfirmed_agents(runner: Runner) -> list[AgentSpec]:
    """Project agents the server will not run: they need `--yes` at start."""
    if runner.options.assume_yes:
        return []
    return sorted((s for s in runner.catalog.agents.values() if s.source == "project"), key=lambda s: s.name)


def _parsed(runner: Runner, arguments: dict[str, Any], tool: str) -> Delegation | types.CallToolResult:
    """Reads a call's arguments with the delegation parser (as the `subagent` tool does), or says in
    the error result what was wrong with them."""
    try:
        return parse_delegation(
            arguments, runner.workspace, runner.catalog.agents, tool=tool, workflows=bool(runner.workflow_names())
        )
    except ToolError as exc:
        return _error(f"Error: {exc}")


async def _refused_or(
    runner: Runner, call: Delegation, tool: str, work: Callable[[], Awaitable[T]]
) -> T | types.CallToolResult:
    """What `work` gives, or the error result a client reads: a project agent the server withholds,
    a cap, a label clash, an agent or model that cannot start (refused before anything ran)."""
    try:
        check_confirmed(runner, call)
        return await work()
    except SubagentError as exc:
        return _error(f"Error: {tool} call refused: {exc}")


def run_schema(runner: Runner) -> dict[str, Any]:
    """`run_agents`'s and `start_agents`'s forms: the `subagent` tool's, without `background` (the tool's
    name says whether a call waits) and `fork` (a client has no agent conversation to continue), with the
    workflow form where the workspace has named workflows."""
    in_repository = repository_root(runner.workspace.root) is not None
    return delegation_schema(
        background=False,
        workflows=bool(runner.workflow_names()),
        isolation=in_repository,
        forks=False,
        models=runner.preparer.offered_models(None),  # the operator's grants (`--allow-model`), imported models
    )


def check_confirmed(runner: Runner, call: Delegation) -> None:
    """Refuse a call that names a project agent the server withholds (it was started without `--yes`)."""
    unconfirmed = {s.name for s in unconfirmed_agents(runner)}
    named = [t.agent for t in call.tasks]
    if call.workflow:  # its steps' agents, from the workflow file
        named += [s.agent for s in load_workflow(find_workflow(call.workflow, runner.cwd, named=True)).steps]
    if blocked := sorted({a.strip().lower() for a in named} & unconfirmed):
        raise ConfirmationRequired(
            f"project agent(s) withheld: {', '.join(blocked)}; they come with the workspace and can run "
            f"commands in it; {RESTART_WITH_YES}"
        )


def agent_list(runner: Runner) -> AgentList:
    unconfirmed = unconfirmed_agents(runner)
    names = {s.name for s in unconfirmed}
    agents = [
        AgentInfo(
            name=s.name,
            description=s.description,
            tools=list(s.tools),
            model=str(runner.preparer.model_for(s)),
            source=s.source,
        )
        for s in sorted(runner.catalog.agents.values(), key=lambda s: s.name)
        if s.name not in names
    ]
    note = None
    if unconfirmed:
        note = (
            f"{len(unconfirmed)} project agent(s) withheld: {', '.join(sorted(names))}. They come with the workspace and "
            f"can run commands in it; {RESTART_WITH_YES}"
        )
    return AgentList(
        workspace=str(runner.cwd),
        agents=agents,
        withheld=[UnconfirmedAgent(name=s.name, path=str(s.path)) for s in unconfirmed],
        note=note,
    )


def _list_result(listing: AgentList) -> types.CallToolResult:
    lines = [f"Workspace: {listing.workspace}", ""]
    for a in listing.agents:
        lines.append(f"- {a.name} ({a.source}; tools: {', '.join(a.tools)}; model: {a.model}): {a.description}")
    if listing.note:
        lines += ["", listing.note]
    return types.CallToolResult(
        content=[types.TextContent(text="\n".join(lines))], structured_content=listing.model_dump(mode="json")
    )


# -- run_agents results -------------------------------------------------------------------------------


def run_result(call: Delegation, outcome: MultiRunResult, answer: ToolResult) -> types.CallToolResult:
    """The tool's formatted answer plus one status line per task, and the same as structured content."""
    results = outcome.results
    bodies = fit_answers([r.output for r in results], [r.transcript for r in results], "", [], 0)
    tasks = [_task_outcome(r, body) for r, body in zip(results, bodies)]
    structured = RunOutcome(
        mode=call.mode,
        ok=outcome.ok,
        succeeded=outcome.succeeded,
        total=outcome.total,
        run_id=outcome.run_id,
        error=outcome.error,
        tasks=tasks,
    )
    lines = [_status_line(t) for t in tasks]
    if not outcome.ok:
        lines.append(FAILED_HINT)
    text = f"{answer.output}\n\n---\n" + "\n".join(lines)
    return types.CallToolResult(
        content=[types.TextContent(text=text)],
        structured_content=structured.model_dump(mode="json"),
        is_error=answer.is_error,
    )


def budget_result(call: Delegation, handles: list[TaskHandle], board: TaskBoard, budget: float) -> types.CallToolResult:
    """A call whose budget ended first: the finished tasks whole; the others handed over to the server's
    board, under the ids the answer gives (agent_output reads them there)."""
    finished = [h for h in handles if h.result is not None and not h.alive]
    for handle in handles:
        if handle not in finished:
            handle.hand_over(board)
    running = [h.snapshot() for h in handles if h not in finished]
    done = [h.result for h in finished if h.result is not None]
    bodies = fit_answers([r.output for r in done], [r.transcript for r in done], "", [], 0)
    structured = RunOutcome(
        mode=call.mode,
        ok=False,
        succeeded=sum(r.ok for r in done),
        total=len(handles),
        run_id=next((h.run_id for h in handles if h.run_id), None),
        error=None,
        tasks=[_task_outcome(r, b) for r, b in zip(done, bodies)],
        running=[s.id for s in running],
    )
    text = budget_text(done, running, budget, len(handles))
    lines = [_status_line(t) for t in structured.tasks]
    if lines:
        text += "\n\n---\n" + "\n".join(lines)
    failed = any(not r.ok for r in done)
    return types.CallToolResult(
        content=[types.TextContent(text=text)], structured_content=structured.model_dump(mode="json"), is_error=failed
    )


def _task_outcome(result: RunResult, answer: str) -> TaskOutcome:
    """A task's outcome: its result's fields that `TaskOutcome` names, and the answer as it fits."""
    return TaskOutcome(**result.model_dump(include=set(TaskOutcome.model_fields) - {"answer"}), answer=answer)


def _status_line(task: TaskOutcome) -> str:
    u = task.usage
    status = task.status if task.status == "completed" else f"{task.status} ({task.stop_reason})"
    where = f"; transcript {task.transcript}" if task.transcript else ""
    children = ""
    if task.children is not None:
        c = task.children.usage
        children = f"; its {len(task.children.tasks)} sub-agent(s): {c.input_tokens:,} tokens read, {c.output_tokens:,} generated"
    return (
        f"[{task.label}] {task.agent}: {status} in {task.duration_s:.1f}s, {u.turns} turns, "
        f"{u.input_tokens:,} tokens read ({u.cached_tokens:,} cached), {u.output_tokens:,} generated{children}{where}"
    )


def _error(message: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=message)], is_error=True)


def _verdict(result: types.CallToolResult | dict[str, Any]) -> str:
    """How a call answered, for the log: ok, error, or the MCP task it became."""
    if isinstance(result, dict):
        return f"as task {result['taskId'][:8]}..."
    return "error" if result.is_error else "ok"


def _brief(arguments: dict[str, Any] | None) -> str:
    text = repr(arguments or {})
    return text if len(text) <= 300 else text[:300] + "..."


# -- what the calling model reads ---------------------------------------------------------------------

RESTART_WITH_YES = (
    "to allow project agents, add --yes to the server's command in the MCP client configuration and restart it"
)
FAILED_HINT = (
    "A task did not complete: its error says why. Read its transcript to see what it did, then retry with a "
    "narrower task (name the files and what to report), a higher limit, or do that part yourself."
)
INSTRUCTIONS = (
    "Local coding sub-agents on a small model running on this machine: free, private, slower and less capable "
    "than you. Hand them bounded, checkable jobs (map a module, find every caller, review a file, run the tests "
    "and report) with run_agents, and keep the reasoning for yourself. list_agents says who can do what."
)
LIST_AGENTS_DESCRIPTION = (
    "List the sub-agents run_agents can start: name, what each is for, its tools and its model. Project agents "
    "(from the workspace) are listed only when the server was started with --yes; the note says which are withheld."
)


def describe_run_agents(runner: Runner, budget: float | None = None) -> str:
    """When to delegate, how to write a task, the three forms, and the agents of this workspace."""
    listing = agent_lines(runner)
    return (
        f"Run local sub-agents on coding jobs in the workspace {runner.cwd}. Each runs on a small local model "
        "(free, private, slower and weaker than you), starts with an empty context, works with its own tools "
        "(read, grep, find, ls, bash, edit, write as its agent allows) and returns only its final answer.\n"
        "Good jobs are bounded and checkable: find where something is, list every caller of a function, summarise "
        "a module, review one file, run the tests and report failures, make one precisely described change. "
        "Write each task as if to a new colleague who cannot ask questions: the goal, the exact files, symbols "
        "and commands, and what the answer must contain. Verify claims that matter before you act on them.\n"
        f"{FORMS[0].upper()}{FORMS[1:]}.\nIndependent tasks in one call run at the same time and share the loaded model; "
        f"at most {MAX_TASKS} per call. cwd (optional) is a folder inside the workspace.\n"
        "The result gives each answer and, per task, its status, token usage and transcript path; a task that "
        f"failed makes the call an error. To carry on while they work, start_agents takes the same forms.\n"
        + (
            f"A call answers within {budget:g} s: tasks still running then go on in the background, and the answer "
            "gives their ids to read with agent_output.\n"
            if budget is not None
            else ""
        )
        + f"Agents:\n{listing}"
    )


def agent_lines(runner: Runner) -> str:
    """One line per agent the server runs: name, tools, description."""
    unconfirmed = {s.name for s in unconfirmed_agents(runner)}
    listing = "\n".join(
        f"- {s.name} (tools: {', '.join(s.tools)}): {s.description}"
        for s in sorted(runner.catalog.agents.values(), key=lambda s: s.name)
        if s.name not in unconfirmed
    )
    return listing or "- (none)"


# -- running ------------------------------------------------------------------------------------------


def log_path() -> Path:
    """The log this process writes (`setup_logging`'s), default `logs/mcp.log` in the state folder."""
    return _log_file[0] or state_home() / "logs" / LOG_FILE


_log_file: list[Path | None] = [None]
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class TerminalFormatter(logging.Formatter):
    """Log lines for a terminal: what a line quotes from outside (a URL's path, a client's malformed
    line, a server's message: any local process can send `subagent serve` a request) is shown through
    `terminal_text` and never obeyed; the log file keeps it as it came."""

    def format(self, record: logging.LogRecord) -> str:
        return terminal_text(super().format(record))


def setup_logging(path: Path | None = None) -> Path:
    """Our log and the SDK's warnings to stderr and to the log file (default `logs/mcp.log`); nothing to stdout.
    A detached server's stderr is that file already (`start_detached`): each line is written once."""
    path = _log_file[0] = path or log_path()
    make_state_dir(path.parent)
    handlers: list[logging.Handler] = [logging.FileHandler(path, encoding="utf-8")]
    if not _same_file(sys.stderr, path):
        handlers.append(logging.StreamHandler(sys.stderr))
    for handler in handlers:
        on_terminal = isinstance(handler, logging.StreamHandler) and handler.stream.isatty()
        handler.setFormatter((TerminalFormatter if on_terminal else logging.Formatter)(LOG_FORMAT))
    for name, level in (("mlx_subagents", logging.INFO), ("mcp", logging.WARNING)):
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.propagate = False
        for handler in handlers:
            logger.addHandler(handler)
    return path


def _same_file(stream: Any, path: Path) -> bool:
    """Whether `stream` writes to the file at `path`."""
    try:
        mine, its = os.fstat(stream.fileno()), path.stat()
    except (OSError, ValueError, AttributeError):  # no file behind the stream (a test's capture)
        return False
    return (mine.st_dev, mine.st_ino) == (its.st_dev, its.st_ino)


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
