"""Agents that use MCP tools (issue 32): a real stdio server (tests/tools/mcp_demo_server.py, the SDK's
`MCPServer`), its tools as `mcp__demo__<tool>`, started once per runner and stopped at its close."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.agents.discovery import discover_agents
from mlx_subagents.cli.mcp_servers import check_servers, mcp_entries
from mlx_subagents.errors import McpConfigError
from mlx_subagents.runs.tasks import TaskSpec
from mlx_subagents.tools.mcp_config import load_config
from tests.helpers import REPO, alive, call, go, wait_listening, write_agent

pytestmark = [pytest.mark.process, pytest.mark.usefixtures("preloaded_demo")]  # the demo server or `subagent`

SERVER = str(Path(__file__).parent / "mcp_demo_server.py")
# What stands for `python` in the demo servers' definitions and the `subagent` commands: while `preloaded_demo`
# (conftest.py) holds it, the worker's preloaded process (`preloaded_python`), whose fork is the server or the
# command (1-2 s of CPU a start otherwise).
PYTHON = [sys.executable]
# The terminal width of the `subagent` commands: the preloaded process's (rich's consoles read it at their import).
COLUMNS = "200"


def demo_command(*args: str, script: str = SERVER, own: bool = False) -> dict[str, Any]:
    """The `command` and `args` of a stdio definition that starts `script ARGS` (the demo server); `own`: a
    process of its own, not a fork, for a test of when the server process ends."""
    python = [sys.executable] if own else PYTHON
    return {"command": python[0], "args": [*python[1:], script, *args]}


def inline_demo(pids: Path, own: bool = False) -> str:
    """Front-matter lines defining the demo server inline, its starts counted in `pids`."""
    definition = {**demo_command(own=own), "env": {"DEMO_PIDS": str(pids)}}
    return f"mcpServers:\n  - demo: {json.dumps(definition)}\n"


def tool_outputs(runner: Any, session: str) -> list[str]:
    """The tool results a session's last model call was sent, in order."""
    return [m["content"] for m in _history(runner)[session][-1] if m["role"] == "tool"]


def _history(runner: Any) -> dict[str, list[list[dict[str, Any]]]]:
    return next(iter(runner.preparer.hosts.values())).history


def pids_in(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


@pytest.mark.slow
def test_agent_calls_server_tools_with_its_schema_disallowed_removed_errors_as_results(
    tmp_path: Path, scripted_runner: Any
) -> None:
    pids = tmp_path / "pids"
    folder = tmp_path / ".claude" / "agents"
    folder.mkdir(parents=True)
    (folder / "demo-user.md").write_text(
        "---\nname: demo-user\ndescription: uses demo\ntools: Read, mcp__demo__*\ndisallowedTools: mcp__demo__add\n"
        f"{inline_demo(pids, own=True)}---\nUse the tools.\n"
    )
    script = [
        call("mcp__demo__echo", text="hi"),
        call("mcp__demo__add", a=1, b=2),
        call("mcp__demo__fail", reason="no"),
        call("mcp__demo__crash"),
        call("mcp__demo__echo", text="again"),
        {"content": "done"},
    ]
    runner = scripted_runner(script, assume_yes=True)

    async def main() -> Any:
        async with runner:
            [prepared] = await runner.preparer.prepare([TaskSpec("demo-user", "x")], workspace=runner.workspace)
            schema = prepared.mcp_tools["mcp__demo__echo"].schema()["function"]
            return list(prepared.mcp_tools), schema, await runner.run(TaskSpec("demo-user", "go"))

    names, schema, result = asyncio.run(main())
    assert names == [
        "mcp__demo__ask_name",
        "mcp__demo__crash",
        "mcp__demo__echo",
        "mcp__demo__fail",
        "mcp__demo__roots",
        "mcp__demo__slow",
        "mcp__demo__summarise",
    ]
    assert schema == {
        "name": "mcp__demo__echo",
        "description": "Say the text back.",
        "parameters": {
            "properties": {"text": {"title": "Text", "type": "string"}},
            "required": ["text"],
            "type": "object",
            "title": "echoArguments",
        },
    }
    assert result.status == "completed"
    outputs = tool_outputs(runner, "demo-user")
    assert outputs[0] == "echo: hi"
    assert outputs[1].startswith("Error: unknown tool 'mcp__demo__add'; available tools: read, mcp__demo__ask_name")
    assert outputs[2] == "Error executing tool fail"  # the SDK's words, not "Error: Error executing ..."
    assert outputs[3] == "Error: mcp__demo__crash failed: MCPError: Connection closed"
    assert outputs[4] == "Error: mcp__demo__echo failed: MCPError: Connection closed"  # a crashed server stays an error
    assert len(pids_in(pids)) == 1  # one start for the prepare and the run: one server per runner
    assert not alive(pids_in(pids)[0])


@pytest.mark.slow
def test_one_server_for_parallel_agents_stopped_at_close_and_never_for_a_child_without_it(
    tmp_path: Path, scripted_runner: Any
) -> None:
    pids = tmp_path / "pids"
    write_agent(tmp_path, "demo-user", front=inline_demo(pids, own=True))
    write_agent(tmp_path, "relay", tools="read, subagent", front="agents: [demo-user]\n")
    script = {
        "agents": {
            "demo-user": {"replies": [call("mcp__demo__echo", text="x"), {"content": "ok"}] * 2},
            "relay": {"replies": [call("subagent", agent="demo-user", task="echo"), {"content": "relayed"}]},
        }
    }
    runner = scripted_runner(script, assume_yes=True)

    async def main() -> Any:
        async with runner:
            both = await runner.parallel([TaskSpec("demo-user", "a"), TaskSpec("demo-user", "b")])
            running = [alive(pid) for pid in pids_in(pids)]
            return both, running

    both, running = asyncio.run(main())
    assert [r.status for r in both.results] == ["completed", "completed"]
    assert [tool_outputs(runner, label) for label in ("demo-user-1", "demo-user-2")] == [["echo: x"], ["echo: x"]]
    assert running == [True]  # one server served both agents
    assert not alive(pids_in(pids)[0])  # the runner's close stopped it

    pids.unlink()
    runner = scripted_runner(script, assume_yes=True)
    result = go(runner, "run", TaskSpec("relay", "go"))
    child = [name for name in _history(runner) if name.startswith("relay > ")][0]
    assert result.status == "completed"
    assert tool_outputs(runner, child) == [
        "Error: mcp__demo__* is not available to 'demo-user' here: its parent 'relay' lacks it, and a sub-agent's "
        f"tools never exceed its parent's without a grant (agents: [demo-user!] in {tmp_path / '.mlx-subagents' / 'agents' / 'relay.md'})"
    ]
    assert pids_in(pids) == []  # a child whose parent lacks the server never starts it


@pytest.mark.slow
def test_cancelled_slow_call_sends_the_cancellation_and_leaves_no_process(tmp_path: Path, scripted_runner: Any) -> None:
    pids = tmp_path / "pids"
    write_agent(tmp_path, "demo-user", front=inline_demo(pids, own=True))
    runner = scripted_runner([call("mcp__demo__slow", seconds=30), {"content": "never"}], assume_yes=True)

    async def main() -> Any:
        async with runner:
            handle = await runner.start(TaskSpec("demo-user", "wait"))
            for _ in range(200):
                if (tmp_path / "slow-started").exists():
                    break
                await asyncio.sleep(0.05)
            handle.cancel("stop")
            return await handle.wait()

    result = asyncio.run(main())
    assert result.status == "aborted"
    for _ in range(100):  # the server writes it as the cancellation reaches it
        if (tmp_path / "cancelled").exists():
            break
        time.sleep(0.05)
    assert (tmp_path / "cancelled").read_text() == "yes"
    assert not alive(pids_in(pids)[0])


@pytest.mark.slow
def test_cli_project_mcp_json_needs_consent_and_the_agent_gets_its_tools(tmp_path: Path) -> None:
    home, project, pids = tmp_path / "home", tmp_path / "project", tmp_path / "pids"
    (home / "agents").mkdir(parents=True)
    project.mkdir()
    (home / "agents" / "demo-user.md").write_text(
        "---\nname: demo-user\ndescription: uses demo\nmcpServers: [demo]\n---\nUse the tools.\n"
    )
    server = {"command": sys.executable, "args": [SERVER], "env": {"DEMO_PIDS": "${DEMO_PIDS_FILE}"}}
    (project / ".mcp.json").write_text(json.dumps({"mcpServers": {"demo": server}}))
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"replies": [call("mcp__demo__echo", text="from cli"), {"content": "done"}]}))
    args = ["run", "demo-user", "echo it", "--model", f"scripted:{script}"]
    run = lambda *more: subagent(project, home, *args, *more, env={"DEMO_PIDS_FILE": str(pids)})  # noqa: E731

    refused = run()
    assert refused.returncode != 0
    shown = f"demo (DEMO_PIDS=${{DEMO_PIDS_FILE}} {sys.executable} {SERVER})"  # its environment too, unexpanded
    assert f"the project file {project / '.mcp.json'} starts MCP server(s) {shown}" in refused.stderr.replace("\n", " ")
    assert "Re-run with --yes to allow it." in refused.stderr
    assert not pids.exists()  # nothing started

    allowed = run("--yes", "--json")
    assert allowed.returncode == 0, allowed.stderr
    data = json.loads(allowed.stdout)
    assert data["status"] == "completed"
    records = [json.loads(line) for line in Path(data["transcript"]).read_text().splitlines()]
    results = [r["data"] for r in records if r.get("kind") == "tool_result"]
    assert results == [{"name": "mcp__demo__echo", "is_error": False, "output": "echo: from cli", "id": "call_1"}]
    assert not alive(pids_in(pids)[0])  # the CLI's exit stopped the server


def subagent(cwd: Path, home: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`subagent ARGS...` in `cwd` with its own home and `env`, as a user runs it (stdin not a terminal)."""
    env = {"PYTHONPATH": str(REPO), "MLX_SUBAGENTS_HOME": str(home), "PATH": "/usr/bin:/bin", "COLUMNS": COLUMNS} | (
        env or {}
    )
    command = [*PYTHON, "-m", "mlx_subagents.cli", *args]
    return subprocess.run(
        command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60
    )


def listing_project(tmp_path: Path) -> tuple[Path, Path]:
    """A home with an agent defining `own` inline and naming `demo`; a project whose `.mcp.json` defines
    `demo` and a server that cannot start, and whose agent names `demo` and an undefined `gh`."""
    home, project = tmp_path / "home", tmp_path / "project"
    (home / "agents").mkdir(parents=True)
    (home / "mcp.json").write_text(
        json.dumps({"mcpServers": {"docs": {"type": "http", "url": "http://127.0.0.1:9/mcp"}}})
    )
    (home / "agents" / "inl.md").write_text(
        f"---\nname: inl\ndescription: inline\nmcpServers:\n  - own: {json.dumps(demo_command())}\n  - demo\n---\nx\n"
    )
    write_agent(
        project, "demo-user", tools="read, mcp__demo__*, mcp__gh__search", front="disallowedTools: mcp__demo__add\n"
    )
    servers = {"demo": demo_command(), "bad": {"command": str(tmp_path / "missing")}}
    (project / ".mcp.json").write_text(json.dumps({"mcpServers": servers}))
    return home, project


@pytest.mark.slow
def test_cli_mcp_servers_lists_each_server_its_origin_consent_and_agents(tmp_path: Path) -> None:
    home, project = listing_project(tmp_path)
    mcp_json, inl = project / ".mcp.json", home / "agents" / "inl.md"
    demo = " ".join([*PYTHON, SERVER])  # the demo server's command as written

    listed = subagent(project, home, "mcp-servers")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines() == [
        f"bad          stdio {tmp_path / 'missing'}",
        f"  project: {mcp_json}; starts after consent (--yes or the prompt)",
        "  agents: none (name it in an agent mcpServers: or tools:)",
        f"demo         stdio {demo}",
        f"  project: {mcp_json}; starts after consent (--yes or the prompt)",
        "  agents: demo-user (mcp__demo__*), inl (mcp__demo__*)",
        "docs         http  http://127.0.0.1:9/mcp",
        f"  user: {home / 'mcp.json'}",
        "  agents: none (name it in an agent mcpServers: or tools:)",
        f"own          stdio {demo}",
        f"  agent: {inl}",
        "  agents: inl (mcp__own__*)",
    ]
    assert (
        f"warning: {project / '.mlx-subagents' / 'agents' / 'demo-user.md'}: MCP server 'gh' is not defined; add it to "
        ".mcp.json, the home's mcp.json or mcpServers:"
    ) in listed.stderr.replace("\n", " ")

    verbose = subagent(project, home, "agents", "--verbose")
    assert verbose.returncode == 0, verbose.stderr
    mcp_lines = [line.strip() for line in verbose.stdout.splitlines() if "mcp tools:" in line]
    assert mcp_lines == [
        f"mcp tools: mcp__demo__* from {mcp_json}; mcp__gh__search (server 'gh' is not defined)",
        f"mcp tools: mcp__own__* from {inl}; mcp__demo__* from {mcp_json}",
    ]


@pytest.mark.slow
def test_doctor_starts_each_server_once_and_says_its_tools_or_why_not(tmp_path: Path, monkeypatch: Any) -> None:
    # In-process: `subagent doctor` prints these lines first, then imports mlx for its model check (seconds).
    home, project = listing_project(tmp_path)
    monkeypatch.setenv("MLX_SUBAGENTS_HOME", str(home))
    mcp_json = project / ".mcp.json"
    (home / "agents" / "inl.md").unlink()  # one server that answers is enough here (each start costs a second)
    entries, _ = mcp_entries(discover_agents(project), project)

    lines: list[str] = []
    assert asyncio.run(check_servers(entries, project, lines.append, assume_yes=False)) is False  # docs failed
    assert lines[:2] == [
        f"mcp       {name}: not started: {mcp_json} is the project's; re-run with --yes to start it"
        for name in ("bad", "demo")
    ]
    assert lines[2].startswith("mcp       docs: FAILED ") and len(lines) == 3
    lines.clear()
    assert asyncio.run(check_servers(entries, project, lines.append, assume_yes=True)) is False  # a server failed
    assert lines == [
        f"mcp       bad: FAILED MCP server bad ({tmp_path / 'missing'}) failed to start (FileNotFoundError: [Errno 2] "
        f"No such file or directory: '{tmp_path / 'missing'}'); check its definition in {mcp_json} and its log "
        f"{home / 'logs' / 'mcp-bad.log'}",
        f"mcp       demo: answers, 8 tools (stdio, {mcp_json})",
        f"mcp       docs: FAILED MCP server docs (http://127.0.0.1:9/mcp) failed to start (ConnectError: All connection attempts failed); check its definition in {home / 'mcp.json'}",
    ]


@pytest.mark.slow
def test_an_agent_delegates_to_another_instance_through_its_subagent_mcp(tmp_path: Path, scripted_runner: Any) -> None:
    inner_home, inner_script = tmp_path / "inner-home", tmp_path / "inner.json"
    (inner_home / "agents").mkdir(parents=True)
    (inner_home / "agents" / "helper.md").write_text("---\nname: helper\ndescription: helps\ntools: read\n---\nHelp.\n")
    inner_script.write_text(json.dumps({"replies": [{"content": "inner says hi"}]}))
    inner_args = ["mcp", "--model", f"scripted:{inner_script}", "--cwd", str(tmp_path)]  # `subagent mcp`, forked
    inner = {
        "command": PYTHON[0],
        "args": [*PYTHON[1:], "-m", "mlx_subagents.cli", *inner_args],
        "env": {"MLX_SUBAGENTS_HOME": str(inner_home), "PYTHONPATH": str(REPO)},
    }
    write_agent(tmp_path, "orchestrator", tools="mcp__self__*", front=f"mcpServers:\n  - self: {json.dumps(inner)}\n")
    script = [call("mcp__self__run_agents", agent="helper", task="say hi"), {"content": "relayed"}]
    runner = scripted_runner(script, assume_yes=True)

    async def main() -> Any:
        async with runner:
            [prepared] = await runner.preparer.prepare([TaskSpec("orchestrator", "x")], workspace=runner.workspace)
            return sorted(prepared.mcp_tools), await runner.run(TaskSpec("orchestrator", "go"))

    names, result = asyncio.run(main())
    assert "mcp__self__list_agents" in names and "mcp__self__run_agents" in names
    assert result.status == "completed"
    [output] = tool_outputs(runner, "orchestrator")
    answer, status = output.split("\n\n---\n")
    assert re.fullmatch(r"inner says hi\n\n\[sub-agent run [0-9a-f-]+\]", answer)
    assert status.startswith("[helper] helper: completed in ")
    transcript = Path(status.rsplit(" ", 1)[1])
    assert transcript.is_relative_to(inner_home / "runs") and transcript.is_file()  # the other instance ran it


@pytest.mark.slow
def test_streamable_http_server_with_expanded_headers(tmp_path: Path, scripted_runner: Any, monkeypatch: Any) -> None:
    with socket.socket() as probe:  # a free port for the server
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [*PYTHON, SERVER, "http", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_listening(server, port, "the demo MCP server")
        monkeypatch.setenv("DEMO_TOKEN", "s3cret")
        web = {
            "type": "http",
            "url": f"http://127.0.0.1:{port}/mcp",
            "headers": {"Authorization": "Bearer ${DEMO_TOKEN}"},
        }
        write_agent(tmp_path, "web-user", tools="mcp__web__*", front=f"mcpServers:\n  - web: {json.dumps(web)}\n")
        script = [
            call("mcp__web__header", key="Authorization"),
            call("mcp__web__echo", text="over http"),
            {"content": "ok"},
        ]
        result = go(scripted_runner(script, assume_yes=True), "run", TaskSpec("web-user", "go"))
        records = [json.loads(line) for line in Path(result.transcript).read_text().splitlines()]
        outputs = [r["data"]["output"] for r in records if r.get("kind") == "tool_result"]
    finally:
        server.terminate()
        server.wait(10)
    assert result.status == "completed"
    assert outputs == ["Bearer s3cret", "echo: over http"]


def test_vars_stay_as_written_until_the_start_and_an_unset_one_is_one_line_naming_file_server_and_fix(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setenv("DEMO_SET", "given")
    monkeypatch.delenv("DEMO_UNSET", raising=False)
    (tmp_path / ".mcp.json").write_text(
        json.dumps(
            {
                "mcpServers": {
                    "demo": {
                        "command": "${DEMO_CMD:-python}",
                        "args": ["${DEMO_SET:-x}", "${DEMO_UNSET:-}"],
                        "env": {"LEVEL": "${DEMO_LEVEL:-debug}"},
                    }
                }
            }
        )  # fmt: skip
    )
    demo = load_config(tmp_path)["demo"]
    written = ("${DEMO_CMD:-python}", ("${DEMO_SET:-x}", "${DEMO_UNSET:-}"), (("LEVEL", "${DEMO_LEVEL:-debug}"),))
    assert (demo.command, demo.args, demo.env) == written  # listed and asked about as written
    live = demo.expanded()  # as it starts
    assert (live.command, live.args, live.env) == ("python", ("given", ""), (("LEVEL", "debug"),))

    (tmp_path / ".mcp.json").write_text(
        json.dumps(
            {
                "mcpServers": {
                    "web": {"type": "http", "url": "http://h/mcp", "headers": {"Authorization": "Bearer ${DEMO_UNSET}"}}
                }
            }
        )  # fmt: skip
    )
    web = load_config(tmp_path)["web"]  # read without it: needed only to start
    with pytest.raises(McpConfigError) as raised:
        web.expanded()
    assert str(raised.value) == (
        f"{tmp_path / '.mcp.json'}: MCP server 'web': ${{DEMO_UNSET}} is not set; set it or write ${{DEMO_UNSET:-default}}"
    )
