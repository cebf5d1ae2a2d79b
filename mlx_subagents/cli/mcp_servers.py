"""`subagent mcp-servers` and doctor's MCP lines: the configured MCP servers, where each is defined,
whether it needs consent, and which agents get which of its tools, from the same resolution the
runner uses (`agent_servers`), so what is listed is what runs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..agents.discovery import AgentCatalog
from ..agents.spec import AgentSpec
from ..errors import McpConfigError
from ..home import state_home
from ..tools.mcp import McpConnection
from ..tools.mcp_config import McpServerConfig, agent_servers, load_config, pattern_server

Print = Callable[[str], None]


@dataclass
class McpEntry:
    """One defined server and the agents that get its tools (each with the names it grants and denies).

    Args:
        source: `project` (the project's `.mcp.json`), `user` (the home's `mcp.json`) or `agent` (inline).
        needs_consent: it starts only after `--yes` or the prompt (a project file defines it).
    """

    config: McpServerConfig
    source: str
    needs_consent: bool
    agents: dict[str, dict[str, list[str]]] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        c = self.config
        return {
            "name": c.name,
            "source": self.source,
            "file": c.where,
            "transport": c.transport,
            "starts": c.url or " ".join([c.command, *c.args]),
            "needs_consent": self.needs_consent,
            "agents": [{"name": name, **grant} for name, grant in self.agents.items()],
        }


def mcp_entries(catalog: AgentCatalog, root: Path) -> tuple[list[McpEntry], list[str]]:
    """Every configured server (the home's, the project's, each agent's inline ones), sorted by name,
    with the agents whose tools reach it; and one line per server an agent names but nobody defines."""
    entries: dict[tuple[str, str], McpEntry] = {}
    for config in load_config(root).values():
        entries[config.name, config.where] = McpEntry(config, "project" if config.project else "user", config.project)
    missing: list[str] = []
    for spec in sorted(catalog.agents.values(), key=lambda s: s.name):
        for config in spec.mcp_inline:
            entries.setdefault((config.name, config.where), McpEntry(config, "agent", spec.source == "project"))
        servers, undefined = agent_servers(
            spec.tools, spec.mcp_inline, {e.config.name: e.config for e in entries.values() if e.source != "agent"}
        )
        for config in servers:
            entries[config.name, config.where].agents[spec.name] = _grant(spec, config.name)
        missing += [
            f"{spec.path}: MCP server '{name}' is not defined; add it to .mcp.json, the home's mcp.json or mcpServers:"
            for name in undefined
        ]
    return sorted(entries.values(), key=lambda e: (e.config.name, e.config.where)), missing


def _grant(spec: AgentSpec, server: str) -> dict[str, list[str]]:
    """The names an agent's `tools:` and `disallowedTools:` give for one server (`mcp__demo__*`)."""
    return {
        "tools": [t for t in spec.tools if pattern_server(t) == server],
        "denied": [t for t in spec.mcp_denied if pattern_server(t) == server],
    }


def entry_lines(entry: McpEntry) -> list[str]:
    """An entry as text: the server and what it starts, where it is defined, the agents and their tools."""
    c = entry.config
    consent = "; starts after consent (--yes or the prompt)" if entry.needs_consent else ""
    agents = [
        f"{name} ({', '.join(g['tools'])}" + (f"; not {', '.join(g['denied'])}" if g["denied"] else "") + ")"
        for name, g in entry.agents.items()
    ]
    return [
        f"{c.name:<12} {c.transport:<5} {c.url or ' '.join([c.command, *c.args])}",
        f"  {entry.source}: {c.where}{consent}",
        f"  agents: {', '.join(agents) if agents else 'none (name it in an agent mcpServers: or tools:)'}",
    ]


def agent_mcp_line(spec: AgentSpec, entries: list[McpEntry]) -> str | None:
    """`agents --verbose`: the MCP tools an agent gets and from which server's definition; None without any."""
    parts = []
    for name in dict.fromkeys(filter(None, map(pattern_server, spec.tools))):
        entry = next((e for e in entries if spec.name in e.agents and e.config.name == name), None)
        tools = ", ".join(_grant(spec, name)["tools"])
        parts.append(f"{tools} from {entry.config.where}" if entry else f"{tools} (server '{name}' is not defined)")
    return f"mcp tools: {'; '.join(parts)}" if parts else None


async def check_servers(entries: list[McpEntry], root: Path, say: Print, assume_yes: bool) -> bool:
    """Start each server once (all at the same time) and say, one line each in name order, how many
    tools it lists or why it failed; a project's server without `--yes` is not started. True when
    every started server answered."""
    lines = await asyncio.gather(*(_check(entry, root, assume_yes) for entry in entries))
    for line, _ in lines:
        say(line)
    return all(ok for _, ok in lines)


async def _check(entry: McpEntry, root: Path, assume_yes: bool) -> tuple[str, bool]:
    c = entry.config
    if entry.needs_consent and not assume_yes:
        return f"mcp       {c.name}: not started: {c.where} is the project's; re-run with --yes to start it", True
    connection = McpConnection(c, root, state_home() / "logs")
    try:
        await connection.start()
    except McpConfigError as exc:
        return f"mcp       {c.name}: FAILED {exc}", False
    n_tools = len(connection.tools)
    await connection.stop()
    return f"mcp       {c.name}: answers, {n_tools} tool{'s' if n_tools != 1 else ''} ({c.transport}, {c.where})", True


def server_to_sign_in(entries: list[McpEntry], name: str) -> McpServerConfig:
    """The HTTP server `login NAME` signs in to, as a run would find it (the project's definition over
    the home's, then an agent's inline one); one line when there is none or it is not over HTTP."""
    found = [e.config for e in entries if e.config.name == name]
    if not found:
        known = ", ".join(sorted({e.config.name for e in entries})) or "none"
        raise McpConfigError(f"no MCP server named '{name}' is defined here (known: {known}); see subagent mcp-servers")
    config = next((c for c in found if c.project), None) or found[0]
    if not config.url:
        raise McpConfigError(f"MCP server '{name}' ({config.where}) runs over stdio; only servers over HTTP sign in")
    return config
