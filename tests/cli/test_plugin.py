"""The plugin (`mlx_subagents/plugin/`): one folder that Claude Code, Codex and Agent Plugins clients
install in one step, its MCP server found with no path written in any client's configuration (issue 65).

Each format is read by its own reader: `agent-plugins` (the Agent Plugins 1.0 reader for Python: the
manifest, the skill, and the stdio server resolved as a client resolves it), Claude Code 2.1.328
(`claude plugin validate`, `marketplace add`, `install`, `details`, `mcp list`) and Codex 0.169.0
(`codex plugin marketplace add`, `plugin add`, `mcp list --json`, then the server it names, started).
Claude Code and Codex come from npm, installed once into the test cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
import pytest
from agent_plugins import Plugin
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from mlx_subagents import __version__
from mlx_subagents.agents.discovery import builtin_agents_dir
from mlx_subagents.agents.spec import parse_agent_file
from mlx_subagents.cli.plugin import HOST_AGENTS, PLUGIN, SERVER, host_agent_file, plugin_dir
from tests.helpers import REPO
from tests.mcp_server.conformance import npm_packages
from tests.serve.test_endpoint_clients import CLAUDE_CODE

REGENERATE = "python -c 'from mlx_subagents.cli.plugin import write_host_agents; write_host_agents()'"
CODEX = {"@openai/codex": "0.169.0"}
NO_SUBAGENT_PATH = "/usr/bin:/bin"  # no `subagent` on it: the plugin must find its environment itself


def test_the_three_formats_name_one_plugin_and_its_agents_are_the_built_in_ones() -> None:
    root = plugin_dir()
    portable = Plugin(root)  # reads plugin.json, mcp.json and skills/ as Agent Plugins 1.0 says
    claude, codex = (json.loads((root / f / "plugin.json").read_text()) for f in (".claude-plugin", ".codex-plugin"))
    described = (PLUGIN, __version__, portable.manifest.description)
    assert (portable.manifest.name, portable.manifest.version, portable.manifest.description) == described
    assert [(m["name"], m["version"], m["description"]) for m in (claude, codex)] == [described, described]
    assert [s.name for s in portable.skills] == ["local-agents"]
    assert (list(portable.mcp.servers), portable.mcp.issues) == ([SERVER], ())
    assert json.loads((root / ".mcp.json").read_text()) == {
        "mcpServers": {SERVER: {"command": "${CLAUDE_PLUGIN_ROOT}/bin/subagent-mcp", "args": []}}
    }
    assert (codex["skills"], codex["mcpServers"]) == ("./skills/", "./.mcp.json")
    assert os.access(root / "bin" / "subagent-mcp", os.X_OK)
    # The repository's marketplace (a person adds the repository) and the plugin's own (`subagent plugin path`).
    for market in (REPO, root):
        [entry] = json.loads((market / ".claude-plugin" / "marketplace.json").read_text())["plugins"]
        assert (entry["name"], (market / entry["source"]).resolve()) == (PLUGIN, root)
    assert sorted(p.name for p in (root / "agents").iterdir()) == sorted(f"local-{n}.md" for n in HOST_AGENTS)
    for name in HOST_AGENTS:
        spec = parse_agent_file(builtin_agents_dir() / f"{name}.md", source="builtin")
        assert (root / "agents" / f"local-{name}.md").read_text() == host_agent_file(spec), f"run {REGENERATE}"


async def list_agents(params: StdioServerParameters, roots: list[Path]) -> types.CallToolResult:
    """`list_agents` from the server `params` start, through the SDK's client, which lists `roots`."""

    async def list_roots(_ctx: Any) -> types.ListRootsResult:
        return types.ListRootsResult(roots=[types.Root(uri=p.as_uri()) for p in roots])

    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write, list_roots_callback=list_roots if roots else None) as session:
            await session.initialize()
            return await session.call_tool("list_agents", {})


def user_env() -> dict[str, str]:
    """A person's environment (the test's HOME and state folder) with mlx-subagents installed but not on PATH."""
    return {**os.environ, "PATH": NO_SUBAGENT_PATH, "PYTHONPATH": str(REPO)}


@pytest.mark.slow
@pytest.mark.process
def test_plugin_path_records_the_environment_a_copied_plugin_runs(tmp_path: Path) -> None:
    """A client that copies the plugin into its own cache (Codex does) runs its launcher there: the
    environment is the one `subagent plugin path` recorded; before that, one line says what to run."""
    copy = shutil.copytree(plugin_dir(), tmp_path / "cache" / PLUGIN)
    env, project = user_env(), tmp_path / "project"
    project.mkdir()
    before = subprocess.run([copy / "bin" / "subagent-mcp"], env=env, capture_output=True, text=True, timeout=30)
    assert (before.returncode, before.stdout) == (127, "")
    assert before.stderr == (
        "mlx-subagents plugin: no subagent command found; run `subagent plugin path` once in the environment "
        "where mlx-subagents is installed (it records that environment), or put subagent on PATH\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "mlx_subagents.cli", "plugin", "path"], env=env, capture_output=True, text=True
    )
    assert (done.returncode, done.stdout) == (0, f"{plugin_dir()}\n"), done.stderr
    server = Plugin(copy).mcp.resolve_stdio(SERVER, data_dir=tmp_path, base_env=env)  # as a client resolves it
    assert (server.command, server.args) == (str(copy / "bin" / "subagent-mcp"), ())
    params = StdioServerParameters(command=server.command, env=dict(server.env), cwd=server.cwd)
    listing = anyio.run(list_agents, params, [project])
    assert not listing.is_error and listing.structured_content["workspace"] == str(project.resolve())
    assert "scout" in [a["name"] for a in listing.structured_content["agents"]]


def run(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 120) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command[-3:]}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
@pytest.mark.process
def test_claude_code_installs_the_plugin_from_the_repository_and_connects_its_server(tmp_path: Path) -> None:
    folder = npm_packages(
        f"claude-code-{CLAUDE_CODE['@anthropic-ai/claude-code']}", CLAUDE_CODE, "claude", "Claude Code"
    )
    claude = str(folder / "node_modules" / ".bin" / "claude")
    env, project = user_env(), tmp_path / "project"
    project.mkdir()
    run([sys.executable, "-m", "mlx_subagents.cli", "plugin", "path"], project, env)
    for market in (REPO, plugin_dir()):
        assert "Validation passed" in run([claude, "plugin", "validate", str(market)], project, env)
    run([claude, "plugin", "marketplace", "add", str(REPO)], project, env)
    run([claude, "plugin", "install", f"{PLUGIN}@{PLUGIN}"], project, env)
    details = run([claude, "plugin", "details", f"{PLUGIN}@{PLUGIN}"], project, env).splitlines()
    assert "  Skills (1)  local-agents" in details
    assert any(line.startswith("  Agents (4)  ") for line in details)
    assert any(line.startswith(f"  MCP servers (1)  {SERVER}") for line in details)
    # `mcp list` starts each server and says whether it answered (the first start may import for a while).
    listed = run([claude, "mcp", "list"], project, {**env, "MCP_TIMEOUT": "120000"}, timeout=240)
    assert f"plugin:{PLUGIN}:{SERVER}: {plugin_dir() / 'bin' / 'subagent-mcp'}  - ✔ Connected" in listed.splitlines()
    log = (Path(env["MLX_SUBAGENTS_HOME"]) / "logs" / "mcp.log").read_text()
    assert f"workspace {project.resolve()};" in log  # Claude Code starts it in the project


@pytest.mark.slow
@pytest.mark.process
def test_codex_installs_the_plugin_and_its_server_asks_for_a_project_it_is_not_told(tmp_path: Path) -> None:
    """Codex starts a plugin's server in its copy of the plugin and lists no roots (openai/codex#37903):
    the server does not take the plugin's folder for the project but answers in one line."""
    folder = npm_packages(f"codex-{CODEX['@openai/codex']}", CODEX, "codex", "Codex")
    codex = [
        str(folder / "node_modules" / ".bin" / "node"),
        str(folder / "node_modules" / "@openai" / "codex" / "bin" / "codex.js"),
    ]
    env = user_env()
    run([sys.executable, "-m", "mlx_subagents.cli", "plugin", "path"], tmp_path, env)
    run([*codex, "plugin", "marketplace", "add", str(REPO)], tmp_path, env)
    run([*codex, "plugin", "add", f"{PLUGIN}@{PLUGIN}"], tmp_path, env)
    [server] = json.loads(run([*codex, "mcp", "list", "--json"], tmp_path, env))
    transport = server["transport"]
    cache = Path(env["HOME"]) / ".codex" / "plugins" / "cache" / PLUGIN / PLUGIN / __version__
    assert (server["name"], transport["command"], transport["cwd"]) == (
        SERVER,
        str(cache / "bin" / "subagent-mcp"),
        str(cache),
    )
    started_with = {"HOME": env["HOME"], "PATH": env["PATH"], **transport["env"]}  # what Codex passes on
    params = StdioServerParameters(command=transport["command"], env=started_with, cwd=transport["cwd"])
    refused = anyio.run(list_agents, params, [])
    assert refused.is_error and refused.content[0].text == (  # type: ignore[union-attr]
        "no workspace: the server runs in / and the client gave no root; add --cwd PROJECT_FOLDER to the "
        "server's command in the MCP client configuration"
    )
    # The way round that docs/mcp.md gives: a server of the same name in config.toml takes the plugin's
    # server's place, started in the folder codex runs in (no cwd of its own); the plugin stays installed.
    with (Path(env["HOME"]) / ".codex" / "config.toml").open("a") as config:
        config.write(f'\n[mcp_servers.{SERVER}]\ncommand = "/opt/subagents/bin/subagent"\nargs = ["mcp"]\n')
    [server] = json.loads(run([*codex, "mcp", "list", "--json"], tmp_path, env))
    assert (server["name"], server["transport"]["command"], server["transport"].get("cwd")) == (
        SERVER,
        "/opt/subagents/bin/subagent",
        None,
    )
