"""MCP tools: the tools of MCP servers (a language server, an issue tracker, documentation search),
offered to agents as `mcp__<server>__<tool>` within the same rules as every tool.

A server is defined in Claude Code's format (`{command, args, env}` for stdio, `{type: "http", url,
headers}` for streamable HTTP), read by `parse_servers` (`mcp_config.py`); `McpServers` owns the
connections of one runner: a server starts the first time an agent needs it, is shared by every agent of that runner,
and stops at `close`. The official `mcp` SDK's client does the protocol. A server that fails to
start is one warning line and its tools are absent; a call that fails, times out or meets a crashed
server is an error result the model reads, never a crash or a hang. A server that sends a message the
SDK cannot read (nested past its parser's limit, not JSON-RPC) is stopped at once with one warning (the
SDK would log a traceback and leave the start waiting its whole time-out), and one whose tool schemas
nest deeper than `MAX_SCHEMA_DEPTH` is refused at its start, before anything walks them. Past that
depth a result's structured content is one error line, and so is an elicitation's schema (declined,
`mcp_requests.py`); past the SDK's parser the server is stopped with one line; either way the calling
task goes on and the run ends with its real status.

A definition keeps its `${VAR}`s as written (`mcp_config.py`): they are expanded only when the server
starts (`McpServerConfig.expanded`, after consent), and an error text that would carry an expanded
value carries `${VAR}` instead (`redact`). A configuration file is read only when an agent names one
of its servers; a file or a server in it that cannot be read is one warning, and the run goes on
without it (`load_config`).

Either revision: a server that answers `server/discover` is spoken to in 2026-07-28 (each request
stateless), any other with the 2025 handshake. What a server asks of the client during a call
(sampling, elicitation, roots) is answered for the calling agent (`mcp_requests.py`); a call answered
with an MCP task is polled to its result within the call's time-out (`mcp_tasks.py`); a server over
HTTP that wants OAuth signs in with the tokens `subagent mcp-servers login` saved (`mcp_auth.py`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ..deadlines import within
from ..errors import McpAuthError, McpConfigError
from ..text import one_line
from .base import Tool, ToolResult, cap_lines, clip_line, error_result, failed_result
from .mcp_config import McpServerConfig, print_warning, tool_name
from .mcp_requests import ClientPolicy, McpCaller, ServerRequests, too_deep
from .workspace import Workspace

MAX_RESULT_LINES = 2000
MAX_DESCRIPTION_CHARS = 2000
CLIENT_NAME = "mlx-subagents"


def client_version() -> str:
    """This package's version, as the client tells servers (without importing the package's API)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(CLIENT_NAME)
    except PackageNotFoundError:
        return "0"


def result_text(content: Iterable[Any], structured: Any) -> str:
    """A tool result as text: its text blocks, other blocks named; structured content as JSON when
    the server gave no text (FastMCP gives both, the same value)."""
    parts = []
    for block in content:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and hasattr(block.resource, "text"):
            parts.append(block.resource.text)
        else:
            parts.append(f"[{kind or 'content'} block: {getattr(block, 'mime_type', '') or 'not text'}]")
    if not parts and structured is not None:
        parts.append(json.dumps(structured, ensure_ascii=False, indent=1))
    return "\n".join(parts)


class McpTool(Tool):
    """One tool of one MCP server: the server's name, description and JSON schema, called through its connection."""

    read_only = False
    # What a server's tool changes is the server's own affair: only the built-in tools count as writers.
    writes = False

    def __init__(
        self, workspace: Workspace, connection: McpConnection, tool: Any, caller: McpCaller | None = None
    ) -> None:
        super().__init__(workspace)
        self.connection = connection
        self.tool = tool
        self.caller = caller  # the agent session that calls it: its servers' requests are answered for it
        self.remote_name: str = tool.name
        self.name = tool_name(connection.config.name, tool.name)  # type: ignore[misc]
        self.description = one_line(tool.description or f"the {tool.name} tool of MCP server {connection.config.name}")[
            :MAX_DESCRIPTION_CHARS
        ]  # type: ignore[misc]
        self.parameters: dict[str, Any] = dict(tool.input_schema or {"type": "object", "properties": {}})

    def schema(self) -> dict[str, Any]:  # type: ignore[override]
        """The OpenAI function-tool schema, its parameters the server's own JSON schema."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}  # fmt: skip

    def for_caller(self, caller: McpCaller) -> McpTool:
        """This tool as one agent session calls it (`AgentSession` binds each of its MCP tools)."""
        return McpTool(self.workspace, self.connection, self.tool, caller)

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        """Call the server; its error, a time-out or a dead server is an error result (cancellation goes through)."""
        return await self.connection.call(self.remote_name, arguments, self.caller)

    def describe(self, arguments: dict[str, Any]) -> str:
        return f"{self.name} {one_line(json.dumps(arguments, ensure_ascii=False, default=str), 60)}"


@dataclass
class McpConnection:
    """One running server: a task that holds the SDK's transport and session open until `stop`.

    The SDK's context managers must be entered and left in one task (anyio's rule), so one task
    per server owns them; calls come from any agent's task through the session.
    """

    config: McpServerConfig
    cwd: Path
    log_dir: Path | None = None
    tools: list[Any] = field(default_factory=list)
    error: str = ""  # why it is not usable (failed start, crash), for the error results
    policy: ClientPolicy = field(default_factory=ClientPolicy)
    roots: tuple[Path, ...] = ()  # the roots it is told at first (default: `cwd`)

    def __post_init__(self) -> None:
        config = self.config
        self.requests = ServerRequests(
            config.name, config.where, config.project, self.policy, [*self.roots] or [self.cwd]
        )
        self._client: Any = None
        self._stop = asyncio.Event()
        self._ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the server and list its tools within its start-up time-out; raise `McpConfigError` (one line) if not."""
        self._task = asyncio.create_task(self._serve(), name=f"mcp {self.config.name}")
        try:
            await within(asyncio.shield(self._ready), self.config.startup_timeout)
        except TimeoutError:
            await self.stop()
            raise McpConfigError(
                f"MCP server {self.config.summary()} did not answer within {self.config.startup_timeout:g} s; "
                f"check its command in {self.config.where} or raise its startup_timeout"
            ) from None
        except BaseException:
            await self.stop()
            raise

    def _new_client(self, stack: AsyncExitStack) -> Any:
        """The SDK's client of this server, on its transport, its callbacks answering what the server
        asks. Either revision: `server/discover` first (2026-07-28: each request stateless, what the
        server asks comes back as input-required results), else the 2025 handshake."""
        import mcp_types as types
        from mcp import Client

        from .mcp_tasks import Tasks

        requests = self.requests
        return Client(
            self._transport(stack),
            mode="auto",
            sampling_callback=requests.sampling,
            elicitation_callback=requests.elicitation,
            list_roots_callback=requests.list_roots,
            message_handler=self._incoming,
            client_info=types.Implementation(name=CLIENT_NAME, version=client_version()),
            extensions=[Tasks()],
            cache=None,
        )

    async def _serve(self) -> None:
        try:
            async with AsyncExitStack() as stack:
                client = await stack.enter_async_context(self._new_client(stack))
                listed = await client.list_tools()
                if problem := schema_problem(listed.tools):
                    self.error = problem
                    raise McpConfigError(problem)
                await self.requests.started(client.session)
                self.tools = sorted(listed.tools, key=lambda t: t.name)  # stable order: the cached prefix survives
                self._client = client
                self._ready.set_result(None)
                await self._stop.wait()
        except BaseException as exc:
            problem = self.config.redact(self.error or _problem(exc))
            self.error = problem
            if not self._ready.done():
                if isinstance(signed_out := _innermost(exc), McpAuthError):  # said as it is: one line
                    self._ready.set_exception(McpAuthError(str(signed_out)))
                    return
                self._ready.set_exception(
                    McpConfigError(
                        f"MCP server {self.config.summary()} failed to start ({problem}); check its definition in "
                        f"{self.config.where}"
                        + (f" and its log {self._log_path()}" if self.log_dir and not self.config.url else "")
                    )
                )
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self._client = None
            self.error = self.error or "the server stopped"

    async def _incoming(self, message: Any) -> None:
        """The SDK's other messages: one it could not read ends the connection now, with why (its
        requests would otherwise wait for an answer that never comes)."""
        if isinstance(message, Exception) and self._task is not None and not self.error:
            errors = message.errors() if hasattr(message, "errors") else []  # pydantic's: its first says why
            why = errors[0].get("msg", "") if errors and isinstance(errors[0], dict) else str(message)
            self.error = f"it sent a message that cannot be read: {one_line(why, 160)}"
            self._task.cancel()

    def _transport(self, stack: AsyncExitStack) -> Any:
        config = self.config.expanded()  # its `${VAR}`s, only now that it starts
        if config.url:
            import httpx2
            from mcp.client.streamable_http import streamable_http_client

            from .mcp_auth import has_authorization, run_auth

            # OAuth unless the definition sends its own Authorization header: the stored tokens, refreshed;
            # a new sign-in only with a person at hand (the caller's), else one line saying to log in.
            auth = None if has_authorization(config.headers) else run_auth(config.name, config.url, self._person)
            client = httpx2.AsyncClient(headers=dict(config.headers), timeout=config.timeout, auth=auth)
            return streamable_http_client(config.url, http_client=client)
        from mcp.client.stdio import StdioServerParameters, get_default_environment, stdio_client

        _quiet_parse_tracebacks()

        # The SDK passes a short whitelist of variables unless `env` is given: pass ours, as a shell would.
        env = {**os.environ, **get_default_environment(), **dict(config.env)}
        cwd = self.cwd / config.cwd if config.cwd else self.cwd
        params = StdioServerParameters(command=config.command, args=list(config.args), env=env, cwd=cwd)
        return stdio_client(params, errlog=self._errlog(stack))

    def _person(self) -> Any:
        """Who can sign in now: the person of the agent calling the server, if any."""
        caller = self.requests.caller()
        return caller.person if caller is not None else None

    def _log_path(self) -> Path:
        assert self.log_dir is not None
        return self.log_dir / f"mcp-{self.config.name}.log"

    def _errlog(self, stack: AsyncExitStack) -> TextIO:
        """Where the server's stderr goes: the log folder (so it never garbles a terminal or a protocol channel)."""
        if self.log_dir is None:
            return sys.stderr
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            return stack.enter_context(self._log_path().open("a", encoding="utf-8"))
        except OSError:
            return sys.stderr

    async def call(self, name: str, arguments: dict[str, Any], caller: McpCaller | None = None) -> ToolResult:
        """One tool call within the server's call time-out, its server's requests meanwhile answered for
        `caller`; cancelling it sends MCP's cancellation."""
        where = f"MCP server '{self.config.name}'"
        if self._client is None:
            return error_result(f"{where} is not running ({self.error}); use other tools")
        try:
            async with self.requests.calling(caller):
                result = await within(self._client.call_tool(name, arguments), self.config.timeout)
        except TimeoutError:
            return error_result(
                f"{tool_name(self.config.name, name)} did not answer within {self.config.timeout:g} s; "
                "call it with a smaller request or use other tools"
            )
        except Exception as exc:  # a crashed server, garbage on its stdout, a protocol error
            if isinstance(signed_out := _innermost(exc), McpAuthError):
                return error_result(f"{signed_out}; use other tools meanwhile")
            if self._client is None or self.error:  # the connection ended, and says why
                return error_result(f"{where} stopped ({self.error or 'the server stopped'}); use other tools")
            why = one_line(self.config.redact(str(exc)), 400)
            return error_result(f"{tool_name(self.config.name, name)} failed: {type(exc).__name__}: {why}")
        if deep := too_deep(result.structured_content, "its structured content is"):
            return error_result(f"{tool_name(self.config.name, name)} answered, but {deep}; use other tools")
        text = result_text(result.content, result.structured_content)
        output = cap_lines((clip_line(line) for line in text.splitlines()), MAX_RESULT_LINES, "lines", "ask for less")
        if result.is_error:
            return failed_result(output)
        return ToolResult(output)

    async def stop(self) -> None:
        """Close the session and stop the server (its process group, so what it started goes too)."""
        self._stop.set()
        if self._task is not None and not self._task.done():
            # `wait`, not `wait_for`: a connection that ended cancelled (a message it could not read)
            # must not raise its CancelledError here, which would end the whole run as interrupted.
            await asyncio.wait({self._task}, timeout=5)
            if not self._task.done():
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)


def schema_problem(tools: Iterable[Any]) -> str | None:
    """Why a server's tools cannot be offered: a schema nested past `MAX_SCHEMA_DEPTH`; None if none is."""
    for tool in tools:
        if problem := too_deep(tool.input_schema or {}, f"its tool '{tool.name}' has an input schema"):
            return problem
    return None


@functools.cache
def _quiet_parse_tracebacks() -> None:
    """The SDK logs a traceback for each line it cannot parse; the connection says it in one line instead."""
    logging.getLogger("mcp.client.stdio").addFilter(
        lambda record: not record.getMessage().startswith("Failed to parse JSONRPC message")
    )


def _innermost(exc: BaseException) -> BaseException:
    """The first real error inside the SDK's task groups."""
    while isinstance(inner := getattr(exc, "exceptions", None), tuple) and inner:  # an exception group
        exc = inner[0]
    return exc


def _problem(exc: BaseException) -> str:
    """`ConnectError: All connection attempts failed`: the first real error inside the SDK's task groups."""
    exc = _innermost(exc)
    return f"{type(exc).__name__}: {one_line(str(exc), 200)}" if str(exc) else type(exc).__name__


class McpServers:
    """The MCP servers of one runner: each started the first time an agent needs it, shared, stopped at `close`.

    Args:
        cwd: the folder stdio servers start in (the runner's workspace).
        log_dir: where each server's stderr goes (`mcp-<name>.log`); None: this process's stderr.
        warn: receives the one line said about a server that failed to start.
    """

    def __init__(
        self,
        cwd: Path,
        log_dir: Path | None = None,
        warn: Callable[[str], None] = print_warning,
        policy: ClientPolicy | None = None,
    ) -> None:
        self.cwd = cwd
        self.log_dir = log_dir
        self.warn = warn
        self.policy = policy or ClientPolicy()  # the run's consent to its servers' sampling
        self.connections: dict[str, McpConnection] = {}
        self.failed: dict[str, str] = {}
        self._lock = asyncio.Lock()

    async def connect(self, config: McpServerConfig, root: Path | None = None) -> McpConnection | None:
        """The running connection to a server, started now if it is not yet (told `root` as its root,
        the workspace of the agent it starts for); None (after one warning) if it cannot start."""
        async with self._lock:
            if config.name in self.failed:
                return None
            if (known := self.connections.get(config.name)) is not None:
                return known
            connection = McpConnection(config, self.cwd, self.log_dir, policy=self.policy, roots=(root or self.cwd,))
            try:
                await connection.start()
            except McpConfigError as exc:
                self.failed[config.name] = str(exc)
                self.warn(f"{exc}; its tools are not offered")
                return None
            self.connections[config.name] = connection
            return connection

    async def tools_for(self, servers: Iterable[McpServerConfig], workspace: Workspace) -> dict[str, Tool]:
        """Every tool of these servers (started as needed), in a stable order: servers by name, tools by name."""
        tools: dict[str, Tool] = {}
        for config in sorted(servers, key=lambda c: c.name):
            connection = await self.connect(config, workspace.root)
            for tool in connection.tools if connection else ():
                made = McpTool(workspace, connection, tool)  # type: ignore[arg-type]
                tools[made.name] = made
        return tools

    async def close(self) -> None:
        """Stop every server this runner started."""
        connections, self.connections = list(self.connections.values()), {}
        await asyncio.gather(*(c.stop() for c in connections))
