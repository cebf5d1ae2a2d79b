"""MCP servers as they are defined: Claude Code's format (`{command, args, env}` for stdio, `{type:
"http", url, headers}` for streamable HTTP) in an agent's file, `.mcp.json` or `mcp.json`, each read
into one `McpServerConfig`; and which servers an agent's `mcp__<server>__<tool>` names reach.

A definition keeps its `${VAR}`s as written: what is listed (`subagent mcp-servers`), asked about (the
consent question) or logged shows them unexpanded; they are expanded only when the server starts (`expanded`), and an error
text that would carry an expanded value carries `${VAR}` instead (`redact`). A file or a server in it
that cannot be read is one warning naming the file, the line and the fix (`load_config`).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import McpConfigError
from ..home import state_home
from ..text import clip, squash
from ..userfiles import json_line, parse_text, read_text

DEFAULT_STARTUP_TIMEOUT = 30.0  # seconds for a server to start and list its tools
DEFAULT_CALL_TIMEOUT = 120.0  # seconds for one tool call
PREFIX = "mcp__"
SERVER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# `mcp__<server>__<tool>` or `mcp__<server>__*`, as `tools:` and `disallowedTools:` write them.
TOOL_PATTERN = re.compile(r"mcp__([A-Za-z0-9_-]+?)__(\*|[A-Za-z0-9_.-]+)")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
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

    def summary(self, max_chars: int | None = 400, *, values: bool = True) -> str:
        """`demo (python server.py)`: the server and what it starts, in one line, for listings and errors
        (its `${VAR}`s unexpanded); whole with `max_chars=None`, as the consent question shows it: then also
        the environment it is given, the folder it starts in and the headers sent to its address
        (`demo (PYTHONPATH=vendor python3 -m json.tool; in sub)`); without `values`, their names only
        (`TOKEN=***`: an editor sends its servers' variables expanded, and the question may be logged).

        Every line of every argument is shown (newlines as spaces): a cloned repository's `.mcp.json` could
        otherwise put what really runs after a newline or past the cut, or in its environment (PYTHONPATH,
        LD_PRELOAD, NODE_OPTIONS load its own code into an innocent-looking command), where a question about
        running it unsandboxed would not show it."""
        if max_chars is not None:
            # 400 is whole for any usual path (a venv's python in a deep folder and its script: 145 characters).
            return f"{self.name} ({clip(squash(self.url or ' '.join([self.command, *self.args])), max_chars)})"
        shown = (lambda value: value) if values else (lambda _value: "***")
        if self.url:
            parts = [self.url, *(f"header {key}: {shown(value)}" for key, value in self.headers)]
        else:
            parts = [" ".join([*(f"{key}={shown(value)}" for key, value in self.env), self.command, *self.args])]
            parts += [f"in {self.cwd}"] if self.cwd else []
        return f"{self.name} ({squash('; '.join(parts))})"

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
            print_warning(line)
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


def print_warning(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr)
