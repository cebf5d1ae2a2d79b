"""Which MCP servers an agent may use and when they start: read from inline definitions, `.mcp.json`
and the home's `mcp.json` only once an agent names a server; a project's (or a client's: an editor's
session) started only after the user's consent; their tools granted by the agent's file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..agents.spec import AgentSpec
from ..errors import ConfirmationRequired
from ..tools import Tool, Workspace
from ..tools.mcp import McpServers
from ..tools.mcp_config import PREFIX, McpServerConfig, agent_servers, load_config, parse_server, pattern_server
from .consent import Consent

# Where a client's MCP servers are said to come from (`McpServerConfig.where`), in the consent question.
CLIENT_SERVERS = "the editor's session"


def client_servers(definitions: Mapping[str, Any]) -> list[McpServerConfig]:
    """A client's MCP servers (`{name: definition}`, as `.mcp.json` writes them), marked the project's:
    they start after the same consent; each problem is one line naming the server."""
    return [parse_server(name, value, CLIENT_SERVERS, project=True) for name, value in definitions.items()]


def with_servers(spec: AgentSpec, servers: Sequence[McpServerConfig]) -> AgentSpec:
    """The agent with a client's MCP servers (an editor's, `subagent acp`): defined inline (over a
    configured server of the same name) and granted whole (`mcp__<name>__*`)."""
    grants = tuple(f"{PREFIX}{c.name}__*" for c in servers if f"{PREFIX}{c.name}__*" not in spec.tools)
    inline = tuple(c for c in spec.mcp_inline if c.name not in {s.name for s in servers})
    return spec.model_copy(update={"tools": spec.tools + grants, "mcp_inline": (*servers, *inline)})


class AgentMcp:
    """The MCP servers of one runner's agents: their configuration, read once, and the project servers
    the user allowed; the running servers are `mcp`'s (shared by the runner's agents)."""

    def __init__(self, cwd: Path, mcp: McpServers, consent: Consent) -> None:
        self.cwd = cwd
        self.mcp = mcp
        self.consent = consent
        self._mcp_config: dict[str, McpServerConfig] | None = None
        self._mcp_unreadable = False  # a configuration file (or a server in it) could not be read
        self._mcp_allowed: set[str] = set()  # project servers the user allowed to start

    def servers(self, spec: AgentSpec) -> list[McpServerConfig]:
        """The MCP servers an agent may use: those its tools name (`mcp__github__*`, by default those its
        `mcpServers:` names or defines); inline definitions first, then `.mcp.json`, then the home's
        `mcp.json`, read only now that an agent names a server. A name defined nowhere is one warning,
        its tools absent; a file or server that cannot be read is one warning too (`load_config`)."""
        if not spec.mcp_inline and not any(pattern_server(tool) for tool in spec.tools):
            return []  # no configuration file is read for an agent that names no server
        if self._mcp_config is None:
            problems: list[str] = []
            self._mcp_config = load_config(self.cwd, warnings=problems)
            self._mcp_unreadable = bool(problems)
            for line in problems:
                self.mcp.warn(line)
        servers, missing = agent_servers(spec.tools, spec.mcp_inline, self._mcp_config)
        for name in missing:
            if self._mcp_unreadable:  # its file's warning said so: no second line for it
                self.mcp.failed.setdefault(name, "left out")
            if name not in self.mcp.failed:
                self.mcp.failed[name] = "not defined"
                self.mcp.warn(
                    f"{spec.path}: MCP server '{name}' is not defined in .mcp.json, the home's mcp.json or "
                    "mcpServers:; its tools are not offered"
                )
        return servers

    def allow(self, spec: AgentSpec) -> None:
        """Ask once before a project `.mcp.json` starts processes, as for a project agent: `--yes`, or the
        prompt, naming the servers it starts; without either, nothing starts and the task is refused."""
        servers = [c for c in self.servers(spec) if c.project and c.name not in self._mcp_allowed]
        if not servers:
            return
        where = servers[0].where
        source = where if where == CLIENT_SERVERS else f"the project file {where}"
        # Whole: it asks to run them; an editor's variables (expanded, maybe secrets) by their names only.
        names = ", ".join(c.summary(max_chars=None, values=c.where != CLIENT_SERVERS) for c in servers)
        origin = f"{source} starts MCP server(s) {names} for agent '{spec.name}'"
        answer = self.consent.mcp_servers(f"mcp {where} {names}", origin)
        if answer is None:
            raise ConfirmationRequired(f"{origin}; they run unsandboxed, as you. Re-run with --yes to allow it.")
        if not answer:
            raise ConfirmationRequired(f"the MCP servers of {where} were not allowed to start (declined).")
        self._mcp_allowed.update(c.name for c in servers)

    async def tools(self, spec: AgentSpec, workspace: Workspace) -> dict[str, Tool]:
        """The MCP tools an agent's file grants, its servers started on first use (shared by the runner's agents)."""
        if not (servers := self.servers(spec)):
            return {}
        tools = await self.mcp.tools_for(servers, workspace)
        return {name: tool for name, tool in tools.items() if spec.grants(name)}

    async def close(self) -> None:
        """Stop the servers its agents started."""
        await self.mcp.close()
