"""The plugin that installs these agents into a coding agent in one step (`subagent plugin path`).

`mlx_subagents/plugin/` (package data, so in every wheel) is one plugin in three formats at once, and
its own marketplace:

- Claude Code: `.claude-plugin/plugin.json`, the MCP server in `.mcp.json`, the built-in agents as
  Claude Code sub-agents (`agents/local-*.md`, each handing its job to the local agent of its name),
  the skill in `skills/`; `.claude-plugin/marketplace.json` lists the folder itself (`"./"`);
- Codex: `.codex-plugin/plugin.json` (the same `.mcp.json` and skill); Codex reads the same marketplace;
- Agent Plugins 1.0 (VS Code, Copilot, Cursor, Kiro): the root `plugin.json`, `mcp.json`, `skills/`.

The server is `bin/subagent-mcp`, which runs `subagent mcp` of the right environment (the one the
plugin sits in, else the one `subagent plugin path` recorded, else the one on PATH), so nobody writes
an absolute path into a client's JSON. The repository's root holds one more file,
`.claude-plugin/marketplace.json`, pointing at this folder: Claude Code and Codex look for a
marketplace there when a person adds the repository itself.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from ..agents.spec import AgentSpec
from ..home import make_state_dir, state_home, write_whole

PLUGIN = "mlx-subagents"
SERVER = "subagents"  # the MCP server's name in the plugin
# The built-in agents a host gets as sub-agents of its own (the orchestrator's job is the host's).
HOST_AGENTS = ("scout", "planner", "reviewer", "worker")
# Claude Code's name for a plugin's MCP tool: mcp__plugin_<plugin>_<server>__<tool>.
RUN_TOOL = f"mcp__plugin_{PLUGIN}_{SERVER}__run_agents"


def plugin_dir() -> Path:
    """`mlx_subagents/plugin/`: the plugin and its marketplace, in a wheel as in a checkout."""
    return Path(__file__).resolve().parents[1] / "plugin"


def recorded_command() -> Path:
    """Where the launcher looks for this environment's `subagent` when the plugin was copied elsewhere."""
    return state_home() / "plugin" / "subagent"


def record_environment() -> Path:
    """Write `recorded_command()`: a script that runs this environment's `subagent` (its Python, this
    package), for the plugin's launcher; rewritten each time, so the latest environment wins."""
    path = recorded_command()
    make_state_dir(path.parent)
    write_whole(path, f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m mlx_subagents.cli "$@"\n')
    path.chmod(0o755)
    return path


# -- the host's sub-agent files (generated from the built-in agents; tests/cli/test_plugin.py checks them) --


def host_agent_file(spec: AgentSpec) -> str:
    """A Claude Code sub-agent that hands its job to the local agent `spec` (its words, its limits)."""
    return (
        "---\n"
        f"name: local-{spec.name}\n"
        f"description: {spec.description} Runs on the local model through the {SERVER} MCP server (free and "
        "private, slower and less capable than you): use it for bounded jobs whose answer you can check.\n"
        f"tools: {RUN_TOOL}\n"
        "---\n\n"
        f"You hand the job you are given to the local agent `{spec.name}` and bring back its answer. Call "
        f'`run_agents` once with `{{"agent": "{spec.name}", "task": "..."}}`, the task written for a new colleague '
        "who cannot ask questions: the goal, every file, symbol and command involved, and the shape of the answer. "
        "Then reply with the agent's answer as it is, and one line saying what it did not cover or what to check. "
        "If the call fails, say why in one line; do not do the job yourself.\n"
    )


def write_host_agents(root: Path | None = None) -> list[Path]:
    """Write `agents/local-*.md` from the built-in agents (regenerate after changing one)."""
    from ..agents.discovery import builtin_agents_dir
    from ..agents.spec import parse_agent_file

    folder = (root or plugin_dir()) / "agents"
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name in HOST_AGENTS:
        spec = parse_agent_file(builtin_agents_dir() / f"{name}.md", source="builtin")
        path = folder / f"local-{name}.md"
        path.write_text(host_agent_file(spec), encoding="utf-8")
        written.append(path)
    return written


__all__ = [
    "PLUGIN",
    "SERVER",
    "host_agent_file",
    "plugin_dir",
    "record_environment",
    "write_host_agents",
]
