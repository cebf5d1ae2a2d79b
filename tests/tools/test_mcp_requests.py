"""What an MCP server asks of the client mid-call (issue 45): sampling answered on the agent's model
(the tiny real model through mlx-lm, forced to an exact text), refused in one line where it may not;
elicitation declined with a reason where nobody can answer; roots: the calling agent's workspace.
The server is tests/tools/mcp_demo_server.py (the SDK's `MCPServer`) in its own process."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.events import Event
from mlx_subagents.runs.runner import NO_PERSON
from mlx_subagents.runs.tasks import TaskSpec
from mlx_subagents.runs.transcripts import load_run, read_transcript
from mlx_subagents.testing import tool_call_text
from mlx_subagents.tools.subagent import parse_delegation
from tests.helpers import call, go, write_agent
from tests.tools.test_mcp_tools import demo_command, inline_demo, subagent, tool_outputs

pytestmark = [pytest.mark.slow, pytest.mark.process, pytest.mark.usefixtures("preloaded_demo")]


def of_kind(events: list[Event], kind: str) -> list[dict[str, Any]]:
    return [dict(e.data) for e in events if e.kind == kind]


def test_sampling_is_answered_by_the_agents_model_and_counted_in_its_usage(
    tmp_path: Path, forced_runner: Any, tiny_qwen3: Any
) -> None:
    """The demo server twice (the second time bounded by its `maxTokens`), then the MCP project's own
    server-everything (from npm), whose `trigger-sampling-request` is offered to clients that sample."""
    from tests.mcp_server.conformance import conformance_suite

    command, *args = conformance_suite().bin("mcp-server-everything")
    everything = json.dumps({"command": command, "args": args})
    front = inline_demo(tmp_path / "pids") + f"  - every: {everything}\n"
    write_agent(tmp_path, "demo-user", tools="mcp__demo__summarise, mcp__every__trigger-sampling-request", front=front)
    summary = "A short summary."
    calls = [
        tool_call_text("mcp__demo__summarise", {"text": "a long text", "max_tokens": 40}),
        tool_call_text("mcp__demo__summarise", {"text": "a long text", "max_tokens": 3}),
        tool_call_text("mcp__every__trigger-sampling-request", {"prompt": "Say hello", "maxTokens": 20}),
    ]
    replies = {
        "demo-user": [*calls, "done"],
        "demo-user > sampling#1": [summary],  # the host session each sampling request runs on
        "demo-user > sampling#2": [summary],
        "demo-user > sampling#3": ["Hello."],
    }
    events: list[Event] = []
    runner, scripts = forced_runner(replies, on_event=events.append, assume_yes=True)
    result = go(runner, "run", TaskSpec("demo-user", "summarise it"))

    assert result.status == "completed"
    assert [scripts.remaining(f"demo-user > sampling#{n}") for n in (1, 2, 3)] == [0, 0, 0]
    model = runner.options.model
    sampled = of_kind(events, "sampling")
    n_summary = len(tiny_qwen3[1].encode(summary, add_special_tokens=False))
    assert [(s["server"], s["model"], s["output_tokens"], s["stop_reason"], s["error"]) for s in sampled] == [
        ("demo", model, n_summary + 1, "endTurn", None),  # the text and its end-of-turn token
        ("demo", model, 3, "maxTokens", None),  # cut at the request's maxTokens
        ("every", model, len(tiny_qwen3[1].encode("Hello.", add_special_tokens=False)) + 1, "endTurn", None),
    ]
    assert all(s["input_tokens"] > 0 for s in sampled)
    assert sampled[0]["cached_tokens"] == 0 and sampled[1]["cached_tokens"] > 0  # the same prompt again: reused
    # The agent's usage after each turn and each sampling, in order: each sampling's tokens are added to it.
    usage = [(u["output_tokens"], u["input_tokens"]) for u in of_kind(events, "usage")]
    assert len(usage) == 7  # four turns, three samplings between them
    added = [(usage[i + 1][0] - usage[i][0], usage[i + 1][1] - usage[i][1]) for i in (0, 2, 4)]
    assert added == [(s["output_tokens"], s["input_tokens"]) for s in sampled]
    assert result.usage.output_tokens == usage[-1][0]
    outputs = tool_outputs_of(result)
    cut = tiny_qwen3[1].decode(tiny_qwen3[1].encode(summary, add_special_tokens=False)[:3])
    assert outputs[:2] == [f"{model} said: {summary} (endTurn)", f"{model} said: {cut} (maxTokens)"]
    head, _, body = outputs[2].partition("\n")
    assert head == "LLM sampling result: " and json.loads(body) == {
        "model": model,
        "stopReason": "endTurn",
        "role": "assistant",
        "content": {"type": "text", "text": "Hello."},
    }
    record = load_run(result.run_id)
    log = read_transcript(record.transcript_path(record.tasks[0]))
    assert [r["data"] for r in log.records if r.get("type") == "event" and r["kind"] == "sampling"] == sampled


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
    server = demo_command()
    (tmp_path / ".mcp.json").write_text(json.dumps({"mcpServers": {"proj": server}}))
    (tmp_path / "user-agents").mkdir()
    write_agent(tmp_path, "proj-user", tools="mcp__proj__*")
    events.clear()
    runner = scripted_runner([call("mcp__proj__summarise", text="x"), "done"], events.append, assume_yes=False)
    # A person at a terminal says yes to each question: the project agent and its server.
    runner.preparer.consent.interactive, runner.preparer.consent.confirm = True, lambda _question: True
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
    home = Path(os.environ["MLX_SUBAGENTS_HOME"])  # the test's (isolated_home)
    proc = subagent(tmp_path, home, "run", "demo-user", "ask", "-m", f"scripted:{script}", "--yes")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "asked" in line]
    assert lines == [f'mcp demo asked "What is your name?": declined: {NO_PERSON}']
    assert proc.stdout.strip() == "done"


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


class Present:
    """A person who would accept anything: here only to show when nobody asks them."""

    asked: list[str] = []

    async def elicit(self, server: str, params: Any) -> Any:
        self.asked.append(server)
        raise AssertionError("a background task's server asked the person")

    async def confirm(self, question: str) -> bool:
        raise AssertionError("not asked here")


def test_a_background_task_and_subagent_mcp_decline_with_their_own_reasons(
    tmp_path: Path, scripted_runner: Any
) -> None:
    import anyio
    from mcp.client.session import ClientSession
    from mcp.shared.memory import create_client_server_memory_streams

    from mlx_subagents.events import Fanout
    from mlx_subagents.mcp_server.server import NO_PERSON as NO_PERSON_IN_MCP
    from mlx_subagents.mcp_server.server import AgentsServer
    from mlx_subagents.runs.task import NO_PERSON_IN_BACKGROUND
    from tests.helpers import make_runner, scripted_host

    write_agent(tmp_path, "demo-user", front=inline_demo(tmp_path / "pids"))
    script = [call("mcp__demo__ask_name"), "done"]
    events: list[Event] = []
    runner = scripted_runner(script, events.append, assume_yes=True)
    runner.person = Present()

    async def in_background() -> None:
        async with runner:
            await (await runner.start(TaskSpec("demo-user", "ask"))).wait()

    asyncio.run(in_background())
    assert [e["reason"] for e in of_kind(events, "elicitation")] == [NO_PERSON_IN_BACKGROUND]

    events.clear()
    host = scripted_host(script)
    agents = AgentsServer(lambda root, sink: make_runner(root, host, Fanout([sink, events.append]), assume_yes=True))
    agents.cwd = tmp_path

    async def through_mcp() -> None:
        server = agents.server()
        async with create_client_server_memory_streams() as ((c_read, c_write), (s_read, s_write)):
            async with anyio.create_task_group() as group:
                group.start_soon(lambda: server.run(s_read, s_write, server.create_initialization_options()))
                async with ClientSession(c_read, c_write) as client:
                    await client.initialize()
                    await client.call_tool("run_agents", {"agent": "demo-user", "task": "ask"})
                await agents.close()
                group.cancel_scope.cancel()

    anyio.run(through_mcp)
    assert [e["reason"] for e in of_kind(events, "elicitation")] == [NO_PERSON_IN_MCP]
    assert Present.asked == []
