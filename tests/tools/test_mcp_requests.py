"""What an MCP server asks of the client mid-call (issue 45): sampling answered on the agent's model
(the tiny real model through mlx-lm, forced to an exact text), refused in one line where it may not;
elicitation declined with a reason where nobody can answer; roots: the calling agent's workspace.
The server is tests/tools/mcp_demo_server.py (the SDK's `MCPServer`) in its own process."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.events import Event
from mlx_subagents.runs.runner import NO_PERSON
from mlx_subagents.runs.tasks import TaskSpec
from mlx_subagents.runs.transcripts import load_run, read_transcript
from mlx_subagents.testing import tool_call_text
from mlx_subagents.tools.subagent import parse_delegation
from tests.helpers import REPO, call, go, write_agent
from tests.tools.test_mcp_tools import SERVER, inline_demo, tool_outputs

pytestmark = [pytest.mark.slow, pytest.mark.process]


def of_kind(events: list[Event], kind: str) -> list[dict[str, Any]]:
    return [dict(e.data) for e in events if e.kind == kind]


def test_sampling_is_answered_by_the_agents_model_and_counted_in_its_usage(
    tmp_path: Path, forced_runner: Any, tiny_qwen3: Any
) -> None:
    write_agent(tmp_path, "demo-user", front=inline_demo(tmp_path / "pids"))
    summary = "A short summary."
    replies = {
        "demo-user": [tool_call_text("mcp__demo__summarise", {"text": "a long text", "max_tokens": 40}), "done"],
        "demo-user > sampling#1": [summary],  # the host session a sampling request runs on
    }
    events: list[Event] = []
    runner, scripts = forced_runner(replies, on_event=events.append, assume_yes=True)
    result = go(runner, "run", TaskSpec("demo-user", "summarise it"))

    assert result.status == "completed" and scripts.remaining("demo-user > sampling#1") == 0
    model = runner.options.model
    [sampled] = of_kind(events, "sampling")
    n_summary = len(tiny_qwen3[1].encode(summary, add_special_tokens=False))
    assert sampled == {
        "server": "demo",
        "model": model,
        "input_tokens": sampled["input_tokens"],
        "cached_tokens": 0,
        "output_tokens": n_summary + 1,  # the text and its end-of-turn token
        "stop_reason": "endTurn",
        "error": None,
    }
    assert sampled["input_tokens"] > 0
    usage = of_kind(events, "usage")
    before, after = usage[0], usage[1]  # the first turn, then the sampling
    assert after["output_tokens"] - before["output_tokens"] == sampled["output_tokens"]
    assert after["input_tokens"] - before["input_tokens"] == sampled["input_tokens"]
    assert result.usage.output_tokens == usage[-1]["output_tokens"] >= after["output_tokens"]
    assert tool_outputs_of(result) == [f"{model} said: {summary} (endTurn)"]
    record = load_run(result.run_id)
    log = read_transcript(record.transcript_path(record.tasks[0]))
    assert [r["data"] for r in log.records if r.get("type") == "event" and r["kind"] == "sampling"] == [sampled]


def tool_outputs_of(result: Any) -> list[str]:
    record = load_run(result.run_id)
    log = read_transcript(record.transcript_path(record.tasks[0]))
    return [m["content"] for m in log.messages if m["role"] == "tool"]


def test_sampling_is_refused_in_one_line_for_sampling_off_and_a_project_server_without_consent(
    tmp_path: Path, scripted_runner: Any
) -> None:
    pids = tmp_path / "pids"
    path = write_agent(tmp_path, "no-sampling", front=inline_demo(pids) + "sampling: off\n")
    events: list[Event] = []
    runner = scripted_runner([call("mcp__demo__summarise", text="x"), "done"], events.append, assume_yes=True)
    go(runner, "run", TaskSpec("no-sampling", "try"))
    refusal = f"sampling refused: agent 'no-sampling' says sampling: off ({path})"
    # The demo server lets the refusal through as its call's error: the agent reads the one line.
    assert tool_outputs(runner, "no-sampling") == [f"Error: mcp__demo__summarise failed: MCPError: {refusal}"]
    assert [s["error"] for s in of_kind(events, "sampling")] == [refusal]

    # A project server (.mcp.json) allowed to start (a person said yes), but nobody allowed its sampling.
    server = {"command": sys.executable, "args": [SERVER]}
    (tmp_path / ".mcp.json").write_text(json.dumps({"mcpServers": {"proj": server}}))
    (tmp_path / "user-agents").mkdir()
    write_agent(tmp_path, "proj-user", tools="mcp__proj__*")
    events.clear()
    runner = scripted_runner([call("mcp__proj__summarise", text="x"), "done"], events.append, assume_yes=False)
    runner.preparer.interactive, runner.preparer.confirm = True, lambda _question: True
    runner.preparer._trusted.add("proj-user")  # the project agent itself was allowed too
    go(runner, "run", TaskSpec("proj-user", "try"))
    refusal = (
        f"sampling refused: MCP server 'proj' comes with the project ({tmp_path / '.mcp.json'}) and may use the "
        "local model only with consent; re-run with --yes to allow it"
    )
    assert tool_outputs(runner, "proj-user") == [f"Error: mcp__proj__summarise failed: MCPError: {refusal}"]
    assert [s["error"] for s in of_kind(events, "sampling")] == [refusal]


def test_an_elicitation_without_a_person_is_declined_with_the_reason(tmp_path: Path, scripted_runner: Any) -> None:
    write_agent(tmp_path, "demo-user", front=inline_demo(tmp_path / "pids"))
    events: list[Event] = []
    runner = scripted_runner([call("mcp__demo__ask_name"), "done"], events.append, assume_yes=True)
    go(runner, "run", TaskSpec("demo-user", "ask"))
    [output] = tool_outputs(runner, "demo-user")
    assert json.loads(output) == {"action": "decline", "content": None, "meta": {"reason": NO_PERSON}}
    assert of_kind(events, "elicitation") == [
        {"server": "demo", "message": "What is your name?", "mode": "form", "action": "decline", "reason": NO_PERSON}
    ]


def test_subagent_run_says_the_declined_elicitation_in_one_line(tmp_path: Path) -> None:
    write_agent(tmp_path, "demo-user", front=inline_demo(tmp_path / "pids"))
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"replies": [call("mcp__demo__ask_name"), "done"]}))
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_subagents.cli", "run", "demo-user", "ask", "-m", f"scripted:{script}", "--yes"],
        cwd=tmp_path,
        env={**_env(), "COLUMNS": "300"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "asked" in line]
    assert lines == [f'mcp demo asked "What is your name?": declined: {NO_PERSON}']
    assert proc.stdout.strip() == "done"


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(REPO)}


def test_each_server_is_told_the_calling_agents_workspace_as_its_root(tmp_path: Path, scripted_runner: Any) -> None:
    write_agent(tmp_path, "demo-user", front=inline_demo(tmp_path / "pids"))
    (tmp_path / "sub").mkdir()
    events: list[Event] = []
    runner = scripted_runner([call("mcp__demo__roots"), "done"] * 2, events.append, assume_yes=True)

    async def main() -> list[str]:
        async with runner:
            await runner.run(TaskSpec("demo-user", "roots here"))
            call_in_sub = parse_delegation(
                {"agent": "demo-user", "task": "roots there", "cwd": "sub"},
                runner.workspace,
                runner.catalog.agents,
                tool="run_agents",
            )
            await runner.delegate(call_in_sub, None)
        return [r["output"] for r in of_kind(events, "tool_result")]

    assert asyncio.run(main()) == [json.dumps([tmp_path.as_uri()]), json.dumps([(tmp_path / "sub").as_uri()])]


def test_the_filesystem_server_follows_the_calling_agents_workspace(tmp_path: Path, scripted_runner: Any) -> None:
    """`@modelcontextprotocol/server-filesystem` (from npm), started with no folder: it serves the client's
    roots, and lists them again when told they changed."""
    from tests.mcp_server.conformance import conformance_suite

    command, *args = conformance_suite().bin("mcp-server-filesystem")
    definition = json.dumps({"command": command, "args": args})
    write_agent(
        tmp_path, "fs-user", tools="mcp__fs__list_allowed_directories", front=f"mcpServers:\n  - fs: {definition}\n"
    )
    (tmp_path / "sub").mkdir()
    events: list[Event] = []
    runner = scripted_runner([call("mcp__fs__list_allowed_directories"), "done"] * 2, events.append, assume_yes=True)

    async def main() -> None:
        async with runner:
            await runner.run(TaskSpec("fs-user", "where may you go?"))
            there = {"agent": "fs-user", "task": "and now?", "cwd": "sub"}
            await runner.delegate(
                parse_delegation(there, runner.workspace, runner.catalog.agents, tool="run_agents"), None
            )

    asyncio.run(main())
    assert [r["output"] for r in of_kind(events, "tool_result")] == [
        f"Allowed directories:\n{tmp_path}",
        f"Allowed directories:\n{tmp_path / 'sub'}",
    ]
