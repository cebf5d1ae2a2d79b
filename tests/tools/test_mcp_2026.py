"""Agents calling MCP servers that speak 2026-07-28 (issue 65): each request stateless, what the server
asks answered through its call's input-required result (the same person, consent and bounds as a 2025
server's request), and a long call answered with an MCP task polled to its result within the call's
time-out, cancelled with the agent's turn. The servers: tests/tools/mcp_demo_server.py (both
revisions; `--legacy` for 2025 only) and tests/mcp_server/tasks_server.py (the Tasks extension)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.events import Event
from mlx_subagents.runs.tasks import TaskSpec
from tests.helpers import REPO, call, go, write_agent
from tests.tools.test_mcp_requests import of_kind
from tests.tools.test_mcp_tools import demo_command, tool_outputs

pytestmark = [pytest.mark.slow, pytest.mark.process, pytest.mark.usefixtures("preloaded_demo")]

TASKS_SERVER = str(REPO / "tests" / "mcp_server" / "tasks_server.py")


class Answers:
    """A person at a terminal who fills every form with the same answer."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def elicit(self, server: str, params: Any) -> Any:
        import mcp_types as types

        self.asked.append(f"{server}: {params.message}")
        return types.ElicitResult(action="accept", content={"name": "Grace", "age": 36, "colour": "red"})

    async def confirm(self, question: str) -> bool:
        return True


def demo(*args: str) -> str:
    definition = demo_command(*args)
    return f"mcpServers:\n  - demo: {json.dumps(definition)}\n"


def tasks_server(log: Path, timeout: float | None = None) -> str:
    definition: dict[str, Any] = {
        **demo_command(script=TASKS_SERVER),
        "env": {"TASKS_LOG": str(log), "PYTHONPATH": str(REPO)},
    }
    if timeout is not None:
        definition["timeout"] = timeout
    return f"mcpServers:\n  - jobs: {json.dumps(definition)}\n"


@pytest.mark.parametrize("era", ["2026-07-28", "2025-11-25"])
def test_a_form_is_answered_by_the_person_in_either_revision(tmp_path: Path, scripted_runner: Any, era: str) -> None:
    """2026-07-28: the server answers the call with the form (input required), the person fills it, the
    call is made again with the answer; 2025-11-25: the server asks during the call. The same answer."""
    write_agent(tmp_path, "demo-user", front=demo(*(["--legacy"] if era == "2025-11-25" else [])))
    events: list[Event] = []
    runner = scripted_runner([call("mcp__demo__ask_name"), "done"], events.append, assume_yes=True)
    runner.person = person = Answers()
    go(runner, "run", TaskSpec("demo-user", "ask"))
    [answer] = tool_outputs(runner, "demo-user")
    assert json.loads(answer) == {
        "action": "accept",
        "content": {"name": "Grace", "age": 36, "colour": "red"},
        "meta": None,
    }
    assert person.asked == ["demo: What is your name?"]
    assert [(e["server"], e["action"], e["reason"]) for e in of_kind(events, "elicitation")] == [
        ("demo", "accept", None)
    ]


def test_a_call_answered_with_a_task_is_polled_to_its_result(tmp_path: Path, scripted_runner: Any) -> None:
    log = tmp_path / "tasks.log"
    write_agent(tmp_path, "jobs-user", front=tasks_server(log))
    runner = scripted_runner(
        [call("mcp__jobs__slow_compute", seconds=1, label="a"), call("mcp__jobs__failing_job"), "done"],
        assume_yes=True,
    )
    go(runner, "run", TaskSpec("jobs-user", "compute"))
    assert tool_outputs(runner, "jobs-user") == ["computed a in 1s", "Error: the job failed: nothing to do"]
    assert log.read_text().splitlines() == ["started a"]


def test_a_task_is_cancelled_with_the_agents_turn_and_at_the_call_time_out(
    tmp_path: Path, scripted_runner: Any
) -> None:
    log = tmp_path / "tasks.log"
    write_agent(tmp_path, "jobs-user", front=tasks_server(log, timeout=2))
    runner = scripted_runner([call("mcp__jobs__slow_compute", seconds=300, label="timed"), "done"], assume_yes=True)
    started = time.monotonic()
    go(runner, "run", TaskSpec("jobs-user", "compute"))
    assert time.monotonic() - started < 120  # cut at the call's 2 s time-out, not at the job's 300 s (load slack)
    assert tool_outputs(runner, "jobs-user") == [
        "Error: mcp__jobs__slow_compute did not answer within 2 s; call it with a smaller request or use other tools"
    ]
    assert log.read_text().splitlines() == ["started timed", "cancelled timed"]

    log.unlink()
    write_agent(tmp_path, "jobs-user", front=tasks_server(log))
    runner = scripted_runner([call("mcp__jobs__slow_compute", seconds=60, label="turn")], assume_yes=True)

    async def cancel_the_turn() -> Any:
        async with runner:
            handle = await runner.start(TaskSpec("jobs-user", "compute"))
            while not log.exists():
                await asyncio.sleep(0.05)
            handle.cancel("stopped by the test")
            return await handle.wait()

    result = asyncio.run(cancel_the_turn())
    assert result.status == "aborted"
    for _ in range(600):  # the server hears `tasks/cancel` before the runner closes it (30 s: a loaded machine)
        if log.read_text().splitlines() == ["started turn", "cancelled turn"]:
            break
        time.sleep(0.05)
    assert log.read_text().splitlines() == ["started turn", "cancelled turn"]


@pytest.mark.parametrize("era", ["2026-07-28", "2025-11-25"])
def test_a_sampling_request_is_answered_by_the_agents_model_in_either_revision(
    tmp_path: Path, scripted_runner: Any, era: str
) -> None:
    """2026-07-28: the server answers `summarise` with its sampling request (input required), the agent's
    model answers it on its own host session, the call is made again with the answer; 2025-11-25: the
    server asks during the call. The same answer, the same sampling event."""
    write_agent(tmp_path, "demo-user", front=demo(*(["--legacy"] if era == "2025-11-25" else [])))
    script = {
        "agents": {"demo-user": {"replies": [call("mcp__demo__summarise", text="a long text"), "done"]}},
        "sessions": {"demo-user > sampling#1": {"replies": ["A short summary."]}},
    }
    events: list[Event] = []
    runner = scripted_runner(script, events.append, assume_yes=True)
    result = go(runner, "run", TaskSpec("demo-user", "summarise it"))
    assert result.status == "completed"
    assert tool_outputs(runner, "demo-user") == ["scripted:memory said: A short summary. (endTurn)"]
    [sampled] = of_kind(events, "sampling")
    assert (sampled["server"], sampled.get("error")) == ("demo", None)
