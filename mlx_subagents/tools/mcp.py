"""MCP tools: the tools of MCP servers (a language server, an issue tracker, documentation search),
offered to agents as `mcp__<server>__<tool>` within the same rules as every tool.

A server is defined in Claude Code's format (`{command, args, env}` for stdio, `{type: "http", url,
headers}` for streamable HTTP), read by `parse_servers`; `McpServers` owns the connections of one
runner: a server starts the first time an agent needs it, is shared by every agent of that runner,
and stops at `close`. The official `mcp` SDK's client does the protocol. A server that fails to
start is one warning line and its tools are absent; a call that fails, times out or meets a crashed
server is an error result the model reads, never a crash or a hang. A server that sends a message the
SDK cannot read (nested past its parser's limit, not JSON-RPC) is stopped at once with one warning (the
SDK would log a traceback and leave the start waiting its whole time-out), and one whose tool schemas
nest deeper than `MAX_SCHEMA_DEPTH` is refused at its start, before anything walks them. Past that
depth a result's structured content is one error line, and so is an elicitation's schema (declined,
`mcp_requests.py`); past the SDK's parser the server is stopped with one line; either way the calling
task goes on and the run ends with its real status.

A definition keeps its `${VAR}`s as written: what is listed (`subagent mcp-servers`), asked about
(the consent question) or logged shows them unexpanded; they are expanded only when the server
starts (`McpServerConfig.expanded`, after consent), and an error text that would carry an expanded
value carries `${VAR}` instead (`redact`). A configuration file is read only when an agent names one
of its servers; a file or a server in it that cannot be read is one warning naming the file, the line
and the fix, and the run goes on without it (`load_config`).

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
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from ..errors import McpAuthError, McpConfigError
from ..home import state_home
from ..text import one_line
from ..userfiles import json_line, parse_text, read_text
from .base import Tool, ToolResult, cap_lines, clip_line, error_result
from .mcp_requests import ClientPolicy, McpCaller, ServerRequests, too_deep
from .workspace import Workspace

DEFAULT_STARTUP_TIMEOUT = 30.0  # seconds for a server to start and list its tools
DEFAULT_CALL_TIMEOUT = 120.0  # seconds for one tool call
MAX_RESULT_LINES = 2000
MAX_DESCRIPTION_CHARS = 2000
# Levels of objects and lists in one tool's input schema (a property inside a property adds two): real
# schemas use a handful; the bound keeps every later walk (grammars, events) far from Python's limit.
PREFIX = "mcp__"
SERVER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# `mcp__<server>__<tool>` or `mcp__<server>__*`, as `tools:` and `disallowedTools:` write them.
TOOL_PATTERN = re.compile(r"mcp__([A-Za-z0-9_-]+?)__(\*|[A-Za-z0-9_.-]+)")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
CLIENT_NAME = "mlx-subagents"
_FIELDS = {"type", "command", "args", "env", "cwd", "url", "headers", "startup_timeout", "timeout"}


@dataclass(frozen=True)
class McpServerConfig:
    """One MCP server as defined: stdio (`command`, `args`, `env`) or http (`url`, `headers`).

    Args:
        where: the file that defines it, named in errors and warnings.
        project: it comes with the workspace (`.mcp.json`): it starts only after the user's consent.
        timeout: seconds for one tool call; `startup_timeout` for the start and the tool list.
    """

    name: str
    where: str
    command: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cwd: str = ""
    url: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    project: bool = False
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT
    timeout: float = DEFAULT_CALL_TIMEOUT

    @property
    def transport(self) -> str:
        return "http" if self.url else "stdio"

    def summary(self) -> str:
        """`demo (python server.py)`: the server and what it starts, for the consent question and listings
        (its `${VAR}`s unexpanded)."""
        what = self.url if self.url else " ".join([self.command, *self.args])
        return f"{self.name} ({one_line(what, 120)})"

    def texts(self) -> list[str]:
        """Every field that may hold a `${VAR}`."""
        pairs = [v for pair in (*self.env, *self.headers) for v in pair[1:]]
        return [self.command, *self.args, self.cwd, self.url, *pairs]

    def expanded(self, environ: Mapping[str, str] | None = None) -> McpServerConfig:
        """This definition with its `${VAR}`s expanded, as the server starts with it (never listed or
        saved); an unset variable without a default is one `McpConfigError` line naming it."""
        at = f"{self.where}: MCP server '{self.name}'"

        def ex(text: str) -> str:
            return expand_vars(text, at, environ)

        return replace(
            self,
            command=ex(self.command),
            args=tuple(map(ex, self.args)),
            env=tuple((k, ex(v)) for k, v in self.env),
            cwd=ex(self.cwd),
            url=ex(self.url),
            headers=tuple((k, ex(v)) for k, v in self.headers),
        )

    def redact(self, text: str, environ: Mapping[str, str] | None = None) -> str:
        """`text` with each value a `${VAR}` of this definition expands to written back as `${VAR}`, so an
        error that quotes a URL or a header keeps its secret out of logs, events and transcripts."""
        env = os.environ if environ is None else environ
        names = {m.group(1) for t in self.texts() for m in _VAR.finditer(t)}
        values = sorted(((env[n], n) for n in names if env.get(n)), key=lambda p: -len(p[0]))
        for value, name in values:
            text = text.replace(value, f"${{{name}}}")
        return text


def client_version() -> str:
    """This package's version, as the client tells servers (without importing the package's API)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(CLIENT_NAME)
    except PackageNotFoundError:
        return "0"


def expand_vars(text: str, where: str, environ: Mapping[str, str] | None = None) -> str:
    """`${VAR}` and `${VAR:-default}` replaced as Claude Code does; an unset variable without a
    default is one error line (a server started with a blank token fails later, less clearly)."""
    env = os.environ if environ is None else environ

    def value(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        raise McpConfigError(f"{where}: ${{{name}}} is not set; set it or write ${{{name}:-default}}")

    return _VAR.sub(value, text)


def parse_servers(value: Any, where: str, *, project: bool = False) -> dict[str, McpServerConfig]:
    """The servers of an `mcpServers` mapping (`{name: {command, args, env}}` or `{name: {type: "http",
    url, headers}}`); each problem is one `McpConfigError` line naming the file, the server and the fix."""
    if not isinstance(value, dict):
        raise McpConfigError(f"{where}: 'mcpServers' must be a mapping of server names to definitions")
    return {str(name): parse_server(str(name), item, where, project=project) for name, item in value.items()}


def parse_server(
    name: str, value: Any, where: str, *, project: bool = False, line: int | None = None
) -> McpServerConfig:
    """One server's definition, its `${VAR}`s kept as written (expanded when it starts, `expanded`).

    Args:
        line: the line of the file it starts on, named in an error.
    """
    at = f"{where}{f' line {line}' if line else ''}: MCP server '{name}'"
    if not SERVER_NAME.fullmatch(name):
        raise McpConfigError(f"{at}: use letters, digits, '-' and '_' in server names (at most 64)")
    if not isinstance(value, dict):
        raise McpConfigError(f"{at}: must be a mapping with 'command' (stdio) or 'url' (http)")
    if unknown := sorted(set(value) - _FIELDS):
        raise McpConfigError(f"{at}: unknown field(s) {', '.join(unknown)}; use {', '.join(sorted(_FIELDS))}")
    kind = value.get("type", "http" if "url" in value else "stdio")
    timeouts = {key: _seconds(at, key, value[key]) for key in ("startup_timeout", "timeout") if key in value}
    if kind in ("http", "streamable-http", "streamable_http"):
        url = _text(at, "url", value.get("url"))
        headers = _mapping(at, "headers", value.get("headers", {}))
        return McpServerConfig(
            name, where, url=url, project=project, **timeouts, headers=tuple(headers.items()),
        )  # fmt: skip
    if kind != "stdio":
        raise McpConfigError(
            f"{at}: type {kind!r} is not supported; use 'stdio' (command) or 'http' (url, streamable HTTP)"
        )
    args = value.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, (str, int, float)) for a in args):
        raise McpConfigError(f"{at}: 'args' must be a list of strings")
    env = _mapping(at, "env", value.get("env", {}))
    return McpServerConfig(
        name, where, command=_text(at, "command", value.get("command")), args=tuple(str(a) for a in args),
        env=tuple(env.items()), cwd=str(value.get("cwd") or ""), project=project, **timeouts,
    )  # fmt: skip


def _text(at: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise McpConfigError(f'{at}: \'{key}\' is missing or not text; add "{key}": "..."')
    return value


def _mapping(at: str, key: str, value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, (str, int, float)) for v in value.values()):
        raise McpConfigError(f"{at}: '{key}' must be a mapping of names to text")
    return {str(k): str(v) for k, v in value.items()}


def _seconds(at: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise McpConfigError(f"{at}: '{key}' must be a positive number of seconds")
    return float(value)


PROJECT_FILE = ".mcp.json"
USER_FILE = "mcp.json"


def load_config(cwd: Path, home: Path | None = None, warnings: list[str] | None = None) -> dict[str, McpServerConfig]:
    """The configured servers: `$MLX_SUBAGENTS_HOME/mcp.json`, then the project's `.mcp.json` (its
    servers replace the home's of the same name, as in Claude Code; they start only after consent).

    A file that cannot be read, or a server in it that cannot be defined, is one line in `warnings`
    (printed when None) naming the file, the line and the fix; the rest loads."""
    said = warnings if warnings is not None else []
    servers: dict[str, McpServerConfig] = {}
    for path, project in (((home or state_home()) / USER_FILE, False), (cwd / PROJECT_FILE, True)):
        if path.is_file():
            servers.update(_config_file(path, project, said))
    if warnings is None:
        for line in said:
            _warn(line)
    return servers


def _config_file(path: Path, project: bool, warnings: list[str]) -> dict[str, McpServerConfig]:
    """One configuration file's servers, each problem one line in `warnings` (that server, or the whole
    file when it is not JSON with an `mcpServers` mapping, left out)."""
    try:
        text = read_text(path, "MCP configuration file", McpConfigError)
        data = parse_text(text, "json", str(path), McpConfigError)
    except McpConfigError as exc:
        warnings.append(f"{exc}; its MCP servers are left out (write it as plain JSON, without comments)")
        return {}
    if not isinstance(data, dict) or not isinstance(data.get("mcpServers"), dict):
        warnings.append(
            f'{path}: no "mcpServers" mapping; write {{"mcpServers": {{"name": {{...}}}}}}; its MCP servers are left out'
        )
        return {}
    servers = {}
    for name, item in data["mcpServers"].items():
        try:
            servers[str(name)] = parse_server(
                str(name), item, str(path), project=project, line=json_line(text, str(name))
            )
        except McpConfigError as exc:
            warnings.append(f"{exc}; it is left out, the others load")
    return servers


def agent_servers(
    tools: Iterable[str], inline: Iterable[McpServerConfig], config: Mapping[str, McpServerConfig]
) -> tuple[list[McpServerConfig], list[str]]:
    """The servers an agent's tools reach (`mcp__github__*`, `mcp__github__search`), each its inline
    definition, else the configured one; and the names defined nowhere. A server none of its tools
    names is left out, so it is never started for that agent."""
    defined = {c.name: c for c in inline}
    found: list[McpServerConfig] = []
    missing: list[str] = []
    for name in dict.fromkeys(filter(None, map(pattern_server, tools))):
        if (server := defined.get(name) or config.get(name)) is not None:
            found.append(server)
        else:
            missing.append(name)
    return found, missing


def tool_name(server: str, tool: str) -> str:
    return f"{PREFIX}{server}__{tool}"


def matches(name: str, pattern: str) -> bool:
    """Whether `mcp__demo__echo` is what `pattern` names: itself, or `mcp__demo__*`."""
    if pattern.endswith("__*"):
        return name.startswith(pattern[:-1]) and name.count("__") == pattern.count("__")
    return name == pattern


def pattern_server(pattern: str) -> str | None:
    """The server an `mcp__<server>__...` name or pattern names, else None."""
    found = TOOL_PATTERN.fullmatch(pattern)
    return found.group(1) if found else None


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
            await asyncio.wait_for(asyncio.shield(self._ready), self.config.startup_timeout)
        except TimeoutError:
            await self.stop()
            raise McpConfigError(
                f"MCP server {self.config.summary()} did not answer within {self.config.startup_timeout:g} s; "
                f"check its command in {self.config.where} or raise its startup_timeout"
            ) from None
        except BaseException:
            await self.stop()
            raise

    async def _serve(self) -> None:
        import mcp_types as types
        from mcp import Client

        from .mcp_tasks import Tasks

        try:
            async with AsyncExitStack() as stack:
                requests = self.requests
                # Either revision: `server/discover` first (2026-07-28: each request stateless, what the
                # server asks comes back as input-required results), else the 2025 handshake.
                client = await stack.enter_async_context(
                    Client(
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
                )
                listed = await client.list_tools()
                if problem := schema_problem(listed.tools):
                    self.error = problem
                    raise McpConfigError(problem)
                await requests.started(client.session)
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
                result = await asyncio.wait_for(self._client.call_tool(name, arguments), self.config.timeout)
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
            return ToolResult(f"Error: {output or 'the tool failed'}", is_error=True)
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


def _warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr)


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
        warn: Callable[[str], None] = _warn,
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
