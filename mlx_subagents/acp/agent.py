"""`EditorAgent`: the ACP agent's methods, over `EditorSession`s (one per ACP session).

Every method answers a client's mistake with a JSON-RPC error naming it (an unknown session, a prompt
while a turn runs, a saved run that cannot continue here, a bad option), never by dying: a
`SubagentError` becomes `invalid params` with its one line. Session ids are run ids once a session
has a saved turn (`session/list` lists saved runs; `session/load` and `session/resume` continue one,
as `subagent resume` does); a new session's id is its own until then, and both reach it.
"""

from __future__ import annotations

import functools
import json
import secrets
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import acp
from acp.schema import (
    AgentCapabilities,
    AuthenticateResponse,
    ClientCapabilities,
    CloseSessionResponse,
    Implementation,
    InitializeResponse,
    ListSessionsResponse,
    LoadSessionResponse,
    McpCapabilities,
    NewSessionResponse,
    PromptCapabilities,
    PromptResponse,
    ResumeSessionResponse,
    SessionCapabilities,
    SessionCloseCapabilities,
    SessionConfigOptionSelect,
    SessionConfigSelectOption,
    SessionInfo,
    SessionListCapabilities,
    SessionMode,
    SessionModeState,
    SessionResumeCapabilities,
    SetSessionConfigOptionResponse,
    SetSessionModeResponse,
)

from ..errors import RequestError, SubagentError
from ..runs.agent_mcp import client_servers
from ..runs.options import RunOptions
from ..runs.transcripts import RunRecord, list_runs, load_run
from ..serve.state import ServerInfo
from .conversation import prompt_text, replay
from .session import CANCELLED_REQUEST, CLIENT_GONE, Choices, EditorSession, MakeRunner, title_of

T = TypeVar("T")
PAGE = 50  # sessions per `session/list` page
MODES = [
    SessionMode(id="default", name="Default", description="The agent's own tools: it reads, edits and runs commands"),
    SessionMode(id="plan", name="Plan", description="Read-only tools, sub-agents included: it looks and plans"),
]
DEFAULT_MODEL = "default"


def answers(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """A method whose `SubagentError` (a client's mistake, said in one line) is a JSON-RPC error."""

    @functools.wraps(method)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return await method(*args, **kwargs)
        except SubagentError as exc:
            raise acp.RequestError(-32602, str(exc)) from None

    return wrapper


class EditorAgent:
    """The agent the client talks to: its sessions, by id.

    Args:
        make_runner: makes each session's runner (the process's hosts shared between them).
        options: the command's options (the agents' scope, the models offered).
        version: the package's version, for `agentInfo`.
        server: the running `subagent serve` the sessions' chats run on (None: here).
    """

    def __init__(
        self, make_runner: MakeRunner, options: RunOptions, version: str, server: ServerInfo | None = None
    ) -> None:
        self.make_runner = make_runner
        self.options = options
        self.version = version
        self.server = server
        self.conn: Any = None
        self.capabilities = ClientCapabilities()
        self.sessions: dict[str, EditorSession] = {}

    def on_connect(self, conn: Any) -> None:
        self.conn = conn

    async def initialize(
        self, protocol_version: int, client_capabilities: ClientCapabilities | None = None, **_: Any
    ) -> InitializeResponse:
        self.capabilities = client_capabilities or ClientCapabilities()
        capabilities = AgentCapabilities(
            load_session=True,
            prompt_capabilities=PromptCapabilities(embedded_context=True),
            mcp_capabilities=McpCapabilities(http=True),
            session_capabilities=SessionCapabilities(
                list=SessionListCapabilities(), resume=SessionResumeCapabilities(), close=SessionCloseCapabilities()
            ),
        )
        return InitializeResponse(
            protocol_version=min(protocol_version, acp.PROTOCOL_VERSION),
            agent_capabilities=capabilities,
            auth_methods=[],  # a local model: nothing to sign in to
            agent_info=Implementation(name="mlx-subagents", title="mlx-subagents", version=self.version),
        )

    async def authenticate(self, method_id: str, **_: Any) -> AuthenticateResponse:
        return AuthenticateResponse()  # a local model: nothing to sign in to

    # -- sessions -----------------------------------------------------------------------------------

    @answers
    async def new_session(self, cwd: str, mcp_servers: list[Any] | None = None, **_: Any) -> NewSessionResponse:
        session = self._session(f"acp-{secrets.token_hex(8)}", cwd, mcp_servers)
        return NewSessionResponse(
            session_id=session.id, modes=self._modes(session), config_options=self._options(session)
        )

    @answers
    async def load_session(
        self, cwd: str, session_id: str, mcp_servers: list[Any] | None = None, **_: Any
    ) -> LoadSessionResponse:
        session = await self._continue(cwd, session_id, mcp_servers)
        for update in replay(session.conversation()):
            await self.conn.session_update(session_id=session.id, update=update)
        return LoadSessionResponse(modes=self._modes(session), config_options=self._options(session))

    @answers
    async def resume_session(
        self, cwd: str, session_id: str, mcp_servers: list[Any] | None = None, **_: Any
    ) -> ResumeSessionResponse:
        session = await self._continue(cwd, session_id, mcp_servers)
        return ResumeSessionResponse(modes=self._modes(session), config_options=self._options(session))

    @answers
    async def list_sessions(self, cwd: str | None = None, cursor: str | None = None, **_: Any) -> ListSessionsResponse:
        start = int(cursor) if cursor and cursor.isdigit() else 0
        where = Path(cwd).resolve() if cwd else None
        saved = [r for r in list_runs(limit=10_000) if continuable(r) is None]
        saved = [r for r in saved if where is None or Path(r.cwd) == where]
        page = saved[start : start + PAGE]
        infos = [session_info(r) for r in page]
        more = str(start + PAGE) if start + PAGE < len(saved) else None
        return ListSessionsResponse(sessions=infos, next_cursor=more)

    @answers
    async def close_session(self, session_id: str, **_: Any) -> CloseSessionResponse:
        session = self._get(session_id)
        for key in [k for k, s in self.sessions.items() if s is session]:
            del self.sessions[key]
        await session.close()
        return CloseSessionResponse()

    # -- choices ------------------------------------------------------------------------------------

    @answers
    async def set_session_mode(self, session_id: str, mode_id: str, **_: Any) -> SetSessionModeResponse:
        session = self._get(session_id)
        if mode_id not in {m.id for m in MODES}:
            raise RequestError(f"unknown mode '{mode_id}'; the modes are default and plan")
        await session.reopen(Choices(session.choices.agent, session.choices.model, mode_id == "plan"))
        return SetSessionModeResponse()

    @answers
    async def set_config_option(
        self, config_id: str, session_id: str, value: str | bool, **_: Any
    ) -> SetSessionConfigOptionResponse:
        session = self._get(session_id)
        offered = {o.id: [c.value for c in o.options] for o in self._options(session)}  # type: ignore[union-attr]
        if config_id not in offered:
            raise RequestError(f"unknown config option '{config_id}'; the options are {', '.join(offered)}")
        if value not in offered[config_id]:
            raise RequestError(
                f"'{value}' is not a value of {config_id}; choose one of {', '.join(offered[config_id])}"
            )
        agent, model, plan = session.choices.agent, session.choices.model, session.choices.plan
        if config_id == "agent":
            agent = str(value)
        elif config_id == "model":
            model = None if value == DEFAULT_MODEL else str(value)
        else:
            plan = value == "plan"
        await session.reopen(Choices(agent, model, plan))
        return SetSessionConfigOptionResponse(config_options=self._options(session))

    # -- turns --------------------------------------------------------------------------------------

    @answers
    async def prompt(self, session_id: str, prompt: list[Any], **_: Any) -> PromptResponse:
        session = self._get(session_id)
        response = await session.prompt(prompt_text(prompt))
        if session.run_id is not None:
            self.sessions[session.run_id] = session  # from now on its run id reaches it too
        return response

    async def cancel(self, session_id: str, **_: Any) -> None:
        session = self.sessions.get(session_id)
        if session is not None:  # a notification: nothing to answer, even for an unknown session
            session.cancel()

    def cancel_request(self, request: dict[str, Any]) -> None:
        """`$/cancel_request` of a request still running: a prompt's turn interrupted as by session/cancel
        (the prompt answers with the stop reason `cancelled`); the other requests end soon and answer."""
        params = request.get("params")
        if request.get("method") == "session/prompt" and isinstance(params, dict):
            session = self.sessions.get(str(params.get("sessionId")))
            if session is not None:
                session.cancel(CANCELLED_REQUEST)

    async def close_all(self, reason: str = CLIENT_GONE) -> None:
        """The client went away: every turn interrupted and saved, every session closed."""
        for session in {id(s): s for s in self.sessions.values()}.values():
            await session.close(reason)
        self.sessions.clear()

    # -- helpers ------------------------------------------------------------------------------------

    def _get(self, session_id: str) -> EditorSession:
        session = self.sessions.get(session_id)
        if session is None:
            raise RequestError(
                f"unknown session '{session_id}'; start one with session/new, or continue a saved one with "
                "session/load (session/list lists them)"
            )
        return session

    def _session(self, session_id: str, cwd: str, mcp_servers: list[Any] | None) -> EditorSession:
        root = Path(cwd)
        if not root.is_absolute() or not root.is_dir():
            raise RequestError(
                f"cwd '{cwd}' is not an absolute path of a folder on this machine; give the project's folder"
            )
        servers = dict(client_server(s) for s in mcp_servers or [])
        client_servers(servers)  # each problem is one line now, not at the first prompt
        session = EditorSession(
            session_id,
            root.resolve(),
            self.conn,
            self.capabilities,
            self.make_runner,
            self.options,
            self.server,
            mcp_servers=servers,
        )
        self.sessions[session_id] = session
        return session

    async def _continue(self, cwd: str, session_id: str, mcp_servers: list[Any] | None) -> EditorSession:
        """A saved run continued as a session (the live one when it is open here already)."""
        if (live := self.sessions.get(session_id)) is not None:
            return live
        record = load_run(session_id)
        if (problem := continuable(record)) is not None:
            raise RequestError(f"run {record.run_id} {problem}")
        if Path(record.cwd) != Path(cwd).resolve():
            raise RequestError(f"run {record.run_id} was made in {record.cwd}, not in {cwd}; load it with that cwd")
        session = self._session(record.run_id, cwd, mcp_servers)
        try:
            await session.open(resume=record.run_id)
        except BaseException:
            self.sessions.pop(record.run_id, None)
            raise
        session.title = saved_title(record)
        return session

    def _modes(self, session: EditorSession) -> SessionModeState:
        return SessionModeState(current_mode_id="plan" if session.choices.plan else "default", available_modes=MODES)

    def _options(self, session: EditorSession) -> list[Any]:
        """The session's config options: its agent, its model and its mode."""
        from ..agents.discovery import discover_agents
        from ..runs.model_grants import imported_names

        catalog = discover_agents(session.cwd, scope=self.options.scope)
        agents = [
            SessionConfigSelectOption(value=n, name=n, description=catalog.get(n).description) for n in catalog.names()
        ]
        named = [self.options.model, *self.options.allow_models, *imported_names(), session.choices.model]
        models = [DEFAULT_MODEL, *dict.fromkeys(m for m in named if m)]
        choices = session.choices
        return [
            select("agent", "Agent", choices.agent, agents, None),
            select("model", "Model", choices.model or DEFAULT_MODEL, [option(m) for m in models], "model"),
            select(
                "mode", "Mode", "plan" if choices.plan else "default", [option(m.id, m.name) for m in MODES], "mode"
            ),
        ]


def option(value: str, name: str | None = None) -> SessionConfigSelectOption:
    return SessionConfigSelectOption(value=value, name=name or value)


def select(id: str, name: str, current: str, options: list[Any], category: Any) -> SessionConfigOptionSelect:
    return SessionConfigOptionSelect(
        id=id, name=name, type="select", current_value=current, options=options, category=category
    )


def client_server(server: Any) -> tuple[str, dict[str, Any]]:
    """A client's MCP server as a definition of ours (stdio or http, as `.mcp.json` writes it)."""
    if getattr(server, "command", None) is not None:
        value: dict[str, Any] = {
            "command": server.command,
            "args": list(server.args),
            "env": {v.name: v.value for v in server.env},
        }
    elif getattr(server, "type", None) == "http":
        value = {"type": "http", "url": server.url, "headers": {h.name: h.value for h in server.headers}}
    else:
        raise RequestError(
            f"MCP server '{server.name}': only stdio and http servers are supported here (mcpCapabilities); "
            "give it as one of those"
        )
    return server.name, value


def continuable(record: RunRecord) -> str | None:
    """Why a saved run cannot continue as a session (None: it can): one task with a saved conversation."""
    if len(record.tasks) != 1:
        return f"has {len(record.tasks)} tasks (a {record.mode} run); only a run of one agent continues as a session"
    if record.tasks[0].file is None:
        return "never started: it has no conversation to continue"
    return None


def saved_title(record: RunRecord) -> str:
    """A saved session's title: its first message (the task of its transcript's first record)."""
    try:
        with record.transcript_path(record.tasks[0]).open("rb") as file:
            first = json.loads(file.readline(64 * 1024) or b"{}")
        task = str(first.get("task") or "").strip()
    except (OSError, ValueError, AttributeError, SubagentError):
        task = ""
    return title_of(task) or record.tasks[0].label


def session_info(record: RunRecord) -> SessionInfo:
    path = record.transcript_path(record.tasks[0])
    try:
        updated = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat()
    except OSError:
        updated = None
    return SessionInfo(session_id=record.run_id, cwd=record.cwd, title=saved_title(record), updated_at=updated)
