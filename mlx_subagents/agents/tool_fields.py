"""An agent file's fields that name tools: `tools:` (and a Claude file's `disallowedTools:`), `mcpServers:`
and `agents:` (and Claude's `Task(a, b)` in `tools`), each read into one line naming the file, the
field and the fix when it is bad (`spec.py` reads the rest)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..errors import AgentFileError, McpConfigError
from ..text import name_list
from ..tools import KNOWN_TOOLS, TOOL_NAMES
from ..tools.mcp_config import TOOL_PATTERN, McpServerConfig, parse_server
from .claude import claude_tool, task_grants
from .frontmatter import agent_error as _fail

# Dots are allowed (`dotnet-framework-4.8-expert`); path separators, spaces and leading dots are not;
# at most MAX_NAME_CHARS (64) characters.
NAME_PATTERN = r"[a-z0-9][a-z0-9_.-]{0,63}"


def parse_tools(
    path: Path, meta: dict[str, Any], claude: bool, warnings: list[str], servers: tuple[str, ...] = ()
) -> tuple[str, ...]:
    value = meta.get("tools")
    # No `tools:`: every built-in tool, and the tools of the servers its `mcpServers:` names (not every server).
    every = TOOL_NAMES + tuple(f"mcp__{server}__*" for server in servers)
    tools, dropped = (every, []) if value is None else _tool_list(path, "tools", value, claude)
    if dropped:
        warnings.append(f"{path}: tool(s) not available here, dropped: {name_list(dropped)}")
    if claude and meta.get("disallowedTools") is not None:
        # A Claude denylist must not be lost: dropping it would grant more than the author meant.
        denied, _ = _tool_list(path, "disallowedTools", meta["disallowedTools"], claude, deny=True)
        tools = tuple(tool for tool in tools if tool not in denied)
    return tools


def _tool_list(
    path: Path, key: str, value: Any, claude: bool, *, deny: bool = False
) -> tuple[tuple[str, ...], list[str]]:
    """`(our tool names, the names dropped)`: an unknown name is an error, except in a Claude Code file.

    Args:
        deny: the list takes tools away; a restricted `Bash(git:*)` there denies the whole tool.
    """
    if isinstance(value, str):
        items = split_list(value)
    elif isinstance(value, list) and all(isinstance(item, str) for item in value):
        items = value
    else:
        problem = f"field '{key}' must be a comma-separated string or a list of tool names"
        raise _fail(path, problem, f"e.g. {key}: read, grep, find")
    tools: list[str] = []
    dropped: list[str] = []
    for item in filter(None, (item.strip() for item in items)):
        # `Bash(git:*)` restricts a tool in Claude Code; we cannot, so drop it (never widen) or deny it all.
        name = item.split("(", 1)[0].strip() if deny else item
        tool = _our_tool(name, claude)
        if tool is None and not claude:
            fix = f"use tools from: {', '.join(KNOWN_TOOLS)}, or mcp__<server>__<tool>"
            raise _fail(path, f"field '{key}': unknown tool '{item}'", fix)
        if tool is None:
            dropped.append(item)
        elif tool not in tools:
            tools.append(tool)
    return tuple(tools), dropped


def mcp_denied(path: Path, meta: dict[str, Any], claude: bool) -> tuple[str, ...]:
    """The MCP tools a Claude file's `disallowedTools` names (`mcp__github__*` or exact names)."""
    if not claude or meta.get("disallowedTools") is None:
        return ()
    denied, _ = _tool_list(path, "disallowedTools", meta["disallowedTools"], claude, deny=True)
    return tuple(tool for tool in denied if tool.startswith("mcp__"))


def parse_mcp_servers(path: Path, value: Any) -> tuple[tuple[str, ...], tuple[McpServerConfig, ...]]:
    """`mcpServers:` as Claude Code writes it: a list of server names (from `.mcp.json` or the home's
    `mcp.json`) and inline definitions (`{name: {command, args, env}}`), or one mapping of definitions."""
    if value is None:
        return (), ()
    items = [{name: item} for name, item in value.items()] if isinstance(value, dict) else value
    if not isinstance(items, list):
        raise _fail(
            path, "field 'mcpServers' must be a list of server names or definitions", "e.g. mcpServers: [github]"
        )
    names: list[str] = []
    inline: list[McpServerConfig] = []
    for item in items:
        if isinstance(item, str) and item.strip():
            names.append(item.strip())
            continue
        if not isinstance(item, dict) or len(item) != 1:
            fix = "write a server name, or one definition such as {demo: {command: python, args: [server.py]}}"
            raise _fail(path, "field 'mcpServers': an item is neither a name nor a definition", fix)
        [(name, definition)] = item.items()
        try:
            inline.append(parse_server(str(name), definition, str(path)))
        except McpConfigError as exc:
            raise AgentFileError(str(exc)) from None
        names.append(str(name))
    return tuple(dict.fromkeys(names)), tuple(inline)


def _our_tool(name: str, claude: bool) -> str | None:
    """This project's name for a tool (Claude Code's `Read` is `read`; `mcp__<server>__<tool>` and
    `mcp__<server>__*` as written), None if it has no such tool."""
    if TOOL_PATTERN.fullmatch(name):
        return name
    if (mapped := claude_tool(name, claude)) is not None:
        return mapped
    return name.lower() if name.lower() in KNOWN_TOOLS else None


def split_list(value: str) -> list[str]:
    """`read, Task(scout, worker)` -> `['read', ' Task(scout, worker)']`: commas inside brackets stay.

    One pass over the text (a lookahead per comma made a long list from a cloned repository quadratic)."""
    items, start, depth = [], 0, 0
    for match in re.finditer(r"[(),]", value):
        char = match.group()
        if char == "(":
            depth += 1
        elif char == ")":
            depth = max(depth - 1, 0)
        elif depth == 0:
            items.append(value[start : match.start()])
            start = match.end()
    items.append(value[start:])
    return items


def parse_agents(path: Path, meta: dict[str, Any]) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """The `agents:` grant (plus Claude's `Task(a, b)` in `tools`): who it may start, and which of
    those keep their full tools (`worker!`). None: any agent, tools capped at its own."""
    value, tools = meta.get("agents"), meta.get("tools")
    items: list[str] | None = None
    if value is not None:
        if isinstance(value, str):
            items = value.split(",")
        elif isinstance(value, list) and all(isinstance(item, str) for item in value):
            items = list(value)
        else:
            raise _fail(
                path,
                "field 'agents' must be a comma-separated string or a list of agent names",
                "e.g. agents: scout, worker!",
            )
    tool_items = split_list(tools) if isinstance(tools, str) else tools if isinstance(tools, list) else []
    if (granted := task_grants(tool_items)) is not None:
        items = (items or []) + granted
    if items is None:
        return None, ()
    names: list[str] = []
    full: list[str] = []
    for item in filter(None, (i.strip().lower() for i in items)):
        name = item.removesuffix("!").strip()
        if not re.fullmatch(NAME_PATTERN, name):
            raise _fail(path, f"field 'agents': {item!r} is not an agent name", "e.g. agents: scout, worker!")
        names.append(name)
        if item.endswith("!"):
            full.append(name)
    return tuple(dict.fromkeys(names)), tuple(dict.fromkeys(full))
