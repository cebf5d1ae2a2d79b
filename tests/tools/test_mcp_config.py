""".mcp.json as a cloned repository may write it: read only when an agent names one of its servers, each
problem one warning naming the file, the line and the fix, and its `${VAR}`s never expanded before
the server starts (after consent), nor written expanded anywhere."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.runs.tasks import TaskSpec
from mlx_subagents.tools import Workspace
from mlx_subagents.tools.mcp import McpServers
from mlx_subagents.tools.mcp_config import McpServerConfig, load_config
from tests.helpers import call, go, write_agent
from tests.tools.test_mcp_tools import SERVER, demo_command, pids_in, subagent

SECRET = "s3cret-token-4f9a"


def test_an_agent_that_names_no_server_never_reads_the_file(
    scripted_runner: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mcp_json = tmp_path / ".mcp.json"
    mcp_json.write_text('{\n  "mcpServers": {\n    // ours\n  }\n}\n')
    events: list[Any] = []
    assert go(scripted_runner([{"content": "done"}], events), "run", TaskSpec("worker", "go")).ok
    assert capsys.readouterr().err == ""

    # An agent that names one: the file's problem is one warning, and the run goes on without it.
    write_agent(tmp_path, "user", "read, mcp__demo__echo")
    script = [call("mcp__demo__echo", text="x"), {"content": "done anyway"}]
    result = go(scripted_runner(script, events, assume_yes=True), "run", TaskSpec("user", "go"))
    assert result.output == "done anyway"
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {mcp_json}: invalid JSON at line 3 column 5: Expecting property name enclosed in double quotes; "
        "its MCP servers are left out (write it as plain JSON, without comments)"
    ]


def test_each_server_that_cannot_be_defined_is_one_warning_naming_its_line(tmp_path: Path) -> None:
    servers = {
        "legacy": {"type": "sse", "url": "http://127.0.0.1:9/sse"},
        "odd": {"command": "x", "colour": "red"},
        "kept": {"command": "python", "args": ["-m", "server", "--key", "${UNSET_KEY}"]},  # unset: fine until it starts
    }
    mcp_json = tmp_path / ".mcp.json"
    mcp_json.write_text(json.dumps({"mcpServers": servers}, indent=2))
    warnings: list[str] = []

    config = load_config(tmp_path, warnings=warnings)

    assert list(config) == ["kept"] and config["kept"].args[-1] == "${UNSET_KEY}"
    assert warnings == [
        f"{mcp_json} line 3: MCP server 'legacy': type 'sse' is not supported; use 'stdio' (command) or 'http' (url, "
        "streamable HTTP); it is left out, the others load",
        f"{mcp_json} line 7: MCP server 'odd': unknown field(s) colour; use args, command, cwd, env, headers, "
        "startup_timeout, timeout, type, url; it is left out, the others load",
    ]


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.usefixtures("preloaded_demo")  # the `subagent` commands and the demo server: forks (tests/preloaded.py)
def test_a_secret_stays_unexpanded_until_the_server_starts_and_is_never_written(tmp_path: Path) -> None:
    home, project, pids = tmp_path / "home", tmp_path / "project", tmp_path / "pids"
    (home / "agents").mkdir(parents=True)
    project.mkdir()
    (home / "agents" / "user.md").write_text("---\nname: user\ndescription: u\ntools: read, mcp__demo__echo\n---\nx\n")
    server = {**demo_command("--token", "${DEMO_TOKEN}"), "env": {"DEMO_PIDS": "${PIDS}"}}
    (project / ".mcp.json").write_text(json.dumps({"mcpServers": {"demo": server}}))
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"replies": [call("mcp__demo__echo", text="hi"), {"content": "done"}]}))
    env = {"DEMO_TOKEN": SECRET, "PIDS": str(pids)}

    listed = subagent(project, home, "mcp-servers", "--json", env=env)
    refused = subagent(project, home, "run", "user", "go", "-m", f"scripted:{script}", env=env)
    ran = subagent(project, home, "run", "user", "go", "-m", f"scripted:{script}", "--yes", "--json", env=env)

    assert json.loads(listed.stdout)["servers"][0]["starts"] == " ".join([server["command"], *server["args"]])
    assert refused.returncode == 2 and f"{SERVER} --token ${{DEMO_TOKEN}})" in refused.stderr
    assert ran.returncode == 0, ran.stderr
    assert len(pids_in(pids)) == 1  # expanded as it started: $PIDS reached the server
    saved = "".join(p.read_text(errors="replace") for p in home.rglob("*") if p.is_file())
    assert SECRET not in listed.stdout + refused.stderr + ran.stdout + ran.stderr + saved


def test_an_error_text_carries_the_variable_not_its_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEMO_TOKEN", SECRET)
    (tmp_path / ".mcp.json").write_text(
        json.dumps({"mcpServers": {"web": {"type": "http", "url": "https://h/mcp?key=${DEMO_TOKEN}"}}})
    )
    web = load_config(tmp_path)["web"]
    said = f"HTTPStatusError: Client error '401 Unauthorized' for url '{web.expanded().url}'"
    assert (
        web.redact(said) == "HTTPStatusError: Client error '401 Unauthorized' for url 'https://h/mcp?key=${DEMO_TOKEN}'"
    )


DEEP = str(Path(__file__).parent / "deep_mcp_server.py")


@pytest.mark.process
@pytest.mark.parametrize(
    ("depth", "why"),
    [
        (40, "its tool 'deep' has an input schema nested 81 levels deep, past the 64 accepted"),  # the SDK reads it
        (150, "it sent a message that cannot be read: Invalid JSON: recursion limit exceeded at line 1 column "),
    ],
)
def test_a_deeply_nested_tool_schema_refuses_the_server_at_once_in_one_warning(
    tmp_path: Path, depth: int, why: str, capfd: pytest.CaptureFixture[str]
) -> None:
    # A time-out of 300 s, so that "at once" (a few seconds on a loaded machine) is far from its end.
    config = McpServerConfig(
        "deep", str(tmp_path / ".mcp.json"), command=sys.executable, args=(DEEP, str(depth)), startup_timeout=300
    )
    said: list[str] = []

    async def start() -> tuple[dict[str, Any], float]:
        servers = McpServers(tmp_path, log_dir=tmp_path / "logs", warn=said.append)
        began = time.monotonic()
        try:
            return await servers.tools_for([config], Workspace(tmp_path)), time.monotonic() - began
        finally:
            await servers.close()

    tools, seconds = asyncio.run(start())

    assert tools == {} and seconds < config.startup_timeout / 3  # at once, not at the end of its time-out
    [line] = said
    assert line.startswith(f"MCP server {config.summary()} failed to start ({why}")
    assert line.endswith(
        f"); check its definition in {config.where} and its log {tmp_path / 'logs' / 'mcp-deep.log'}; its tools are not offered"
    )
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.process
@pytest.mark.parametrize(
    ("depth", "mode", "said"),
    [
        (100, "structured", "Error: mcp__deep__deep answered, but its structured content is nested 100 levels deep, past "
         "the 64 accepted; use other tools"),
        (5000, "structured", "Error: MCP server 'deep' stopped (it sent a message that cannot be read: Invalid JSON: "
         "recursion limit exceeded at line 1 column "),
        (400, "elicit", "Error: MCP server 'deep' stopped (it sent a message that cannot be read: Invalid JSON: "
         "recursion limit exceeded at line 1 column "),
    ],
)  # fmt: skip
def test_a_deep_result_or_question_is_one_line_and_the_caller_goes_on(
    tmp_path: Path, depth: int, mode: str, said: str
) -> None:
    """Past the 64 levels accepted, a result is refused in one line; past the SDK's parser, the server is
    stopped with one line; either way the calling task goes on (it was cancelled: exit 130, no JSON)."""
    config = McpServerConfig("deep", str(tmp_path / ".mcp.json"), command=sys.executable, args=(DEEP, str(depth), mode))

    async def call() -> tuple[str, bool]:
        servers = McpServers(tmp_path, log_dir=tmp_path / "logs", warn=lambda _line: None)
        try:
            tools = await servers.tools_for([config], Workspace(tmp_path))
            result = await tools["mcp__deep__deep"].call({})
        finally:
            await servers.close()
        await asyncio.sleep(0)
        return result.output, asyncio.current_task().cancelling() > 0  # type: ignore[union-attr]

    output, cancelled = asyncio.run(call())
    assert output.startswith(said) and output.endswith("; use other tools") and "\n" not in output
    assert not cancelled


@pytest.mark.slow
@pytest.mark.process
def test_a_run_whose_mcp_server_sends_deep_messages_ends_with_its_real_status(
    tmp_path: Path, write_script: Any, run_cli: Any
) -> None:
    servers = {"structured": [DEEP, "5000", "structured"], "elicit": [DEEP, "40", "elicit"]}
    for name, args in servers.items():
        front = f"mcpServers:\n  deep:\n    command: {sys.executable}\n    args: {json.dumps(args)}\n"
        write_agent(tmp_path, name, "[mcp__deep__deep]", front=front)
    model = write_script({"replies": [call("mcp__deep__deep"), "done"]})
    for name in servers:
        code, out, err = run_cli("run", name, "go", "--json", "--yes", "-m", model, "-C", str(tmp_path))
        assert (code, json.loads(out)["status"], json.loads(out)["output"]) == (0, "completed", "done"), err
    assert 'mcp deep asked "tell me": declined: its requested schema is nested 81 levels deep, past the 64' in err
