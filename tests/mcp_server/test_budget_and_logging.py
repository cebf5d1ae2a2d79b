"""The server's call budget and its logging capability (issue 45), on the real handlers (`AgentsServer`)
and the SDK's own client over its in-memory transport: a scripted model, no process."""

from __future__ import annotations

import os
import subprocess
import time
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
import pytest
from mcp.client.session import ClientSession
from mcp.shared.memory import create_client_server_memory_streams

from mlx_subagents.errors import RequestError
from mlx_subagents.mcp_server.budget import parse_call_budget
from mlx_subagents.mcp_server.server import AgentsServer
from tests.helpers import REPO, call, make_runner, scripted_host

pytestmark = pytest.mark.slow  # a run of real agents (on a scripted model) over the protocol


@asynccontextmanager
async def connect(
    tmp_path: Path, script: Any, budget: float | None, on_log: Any = None
) -> AsyncIterator[tuple[ClientSession, AgentsServer]]:
    """A client session on `AgentsServer` over in-memory streams, its runner on a scripted host."""
    host = scripted_host(script)
    agents = AgentsServer(lambda root, sink: make_runner(root, host, sink), tmp_path, call_budget=budget)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the SDK's deprecation warnings are handled by the server
        server = agents.server()
    async with create_client_server_memory_streams() as ((c_read, c_write), (s_read, s_write)):
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: server.run(s_read, s_write, server.create_initialization_options()))
            async with ClientSession(c_read, c_write, logging_callback=on_log) as client:
                await client.initialize()
                yield client, agents
            await agents.close()
            group.cancel_scope.cancel()


def text(result: types.CallToolResult) -> str:
    return result.content[0].text  # type: ignore[union-attr]


def test_a_call_longer_than_the_budget_answers_with_ids_and_agent_output_gets_the_answers(tmp_path: Path) -> None:
    script = {
        "agents": {
            "scout": {"replies": ["scout found it"]},
            "reviewer": {"replies": [{"content": "looks fine", "delay": 3.0}]},
        }
    }
    tasks = [{"agent": "scout", "task": "look"}, {"agent": "reviewer", "task": "review"}]

    async def main() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        async with connect(tmp_path, script, budget=0.8) as (client, _):
            started = time.perf_counter()
            seen["call"] = await client.call_tool("run_agents", {"tasks": tasks})
            seen["elapsed"] = time.perf_counter() - started
            seen["tools"] = {t.name: t for t in (await client.list_tools()).tools}
            started = time.perf_counter()
            seen["early"] = await client.call_tool("agent_output", {"id": "reviewer#1", "wait": 100})
            seen["waited"] = time.perf_counter() - started
            for _ in range(20):  # each call waits at most the budget: call again until the reviewer's end
                seen["late"] = await client.call_tool("agent_output", {"id": "reviewer#1", "wait": 100})
                if seen["late"].structured_content["task"]["status"] != "running":
                    break
            seen["status"] = await client.call_tool("agent_status", {})
        return seen

    seen = anyio.run(main)
    result = seen["call"]
    assert seen["elapsed"] < 2.5  # answered at the budget, not after the reviewer's 3 s (slack for a loaded machine)
    assert not result.is_error
    data = result.structured_content
    assert (data["ok"], data["succeeded"], data["total"], data["running"]) == (False, 1, 2, ["reviewer#1"])
    assert [(t["label"], t["status"], t["answer"]) for t in data["tasks"]] == [("scout", "completed", "scout found it")]
    body = text(result)
    assert body.startswith(
        "1 of 2 task(s) finished within this call's budget of 0.8 s; 1 still run in the background.\n\n"
        "### [scout] completed\nscout found it\n\n"
        "Still running: reviewer#1 (reviewer, running). Read each answer with agent_output "
        '({"id": "reviewer#1", "wait": 0.8} waits for it up to the budget); '
    )
    assert "\n\n---\n[scout] scout: completed in " in body

    described = seen["tools"]["run_agents"].description or ""
    assert "\nA call answers within 0.8 s: tasks still running then go on in the background, and the answer gives " in (
        described
    )
    wait = seen["tools"]["agent_output"].input_schema["properties"]["wait"]
    assert wait["description"] == "Seconds to wait for its end (at most 0.8, this server's call budget)."
    early = seen["early"]
    assert 0.7 < seen["waited"] < 2.5  # the wait is capped at the budget, not the 100 s asked (slack for load)
    assert early.structured_content["task"]["status"] == "running"
    assert "It has not finished (waited 0.8 s, this server's call budget: call again); its output so far:" in text(
        early
    )
    late = seen["late"]
    assert (late.is_error, text(late)) == (False, "reviewer#1 completed\n\nlooks fine")
    assert [t["id"] for t in seen["status"].structured_content["tasks"]] == ["reviewer#1"]  # only what outlived


def test_a_call_within_the_budget_or_with_none_answers_whole(tmp_path: Path) -> None:
    script = {"agents": {"scout": {"replies": [{"content": "slow but whole", "delay": 0.5}]}}}

    async def main(budget: float | None) -> types.CallToolResult:
        async with connect(tmp_path, script, budget=budget) as (client, _):
            return await client.call_tool("run_agents", {"agent": "scout", "task": "look"})

    for budget in (5.0, None):
        result = anyio.run(main, budget)
        data = result.structured_content
        assert (data["ok"], data["running"], data["tasks"][0]["answer"]) == (True, [], "slow but whole")
        assert text(result).startswith("slow but whole\n\n")


@pytest.mark.process
def test_subagent_mcp_refuses_a_call_budget_it_cannot_read_in_one_line(
    tmp_path: Path, preloaded_python: list[str]
) -> None:
    cmd = [*preloaded_python, "-m", "mlx_subagents.cli", "mcp", "--call-budget", "soon", "--cwd", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}  # the preloaded process's, whose fork it is
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (
        "error: --call-budget 'soon': give the seconds a call may take (e.g. 50) or 'off' for clients that wait\n"
    )


def test_the_call_budget_option_reads_seconds_or_off() -> None:
    assert (parse_call_budget("50"), parse_call_budget("12.5s"), parse_call_budget(" OFF ")) == (50.0, 12.5, None)
    for bad in ("0", "-3", "soon", "inf"):
        with pytest.raises(RequestError) as info:
            parse_call_budget(bad)
        assert str(info.value) == (
            f"--call-budget {bad!r}: give the seconds a call may take (e.g. 50) or 'off' for clients that wait"
        )


def test_log_messages_follow_the_level_the_client_sets(tmp_path: Path) -> None:
    script = {
        "agents": {
            "scout": {"replies": [call("ls", path="."), "done looking"]},
            "worker": {"replies": [{"content": "x", "delay": 5}]},
        }
    }
    got: list[tuple[str, str | None, Any]] = []

    async def on_log(params: types.LoggingMessageNotificationParams) -> None:
        got.append((params.level, params.logger, params.data))

    async def main() -> list[list[tuple[str, str | None, Any]]]:
        seen = []
        async with connect(tmp_path, script, budget=None, on_log=on_log) as (client, _):
            caps = client.initialize_result.capabilities  # type: ignore[union-attr]
            assert caps.logging is not None  # the capability is declared
            await client.call_tool("run_agents", {"agent": "scout", "task": "look"})  # default: warnings only
            seen.append(list(got))
            got.clear()
            with warnings.catch_warnings():  # the client's own deprecation warning (SEP-2577)
                warnings.simplefilter("ignore")
                assert await client.set_logging_level("info") == types.EmptyResult()
            await client.call_tool("run_agents", {"agent": "scout", "task": "look"})
            seen.append(list(got))
            got.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                await client.set_logging_level("debug")
            await client.call_tool("run_agents", {"tasks": [{"agent": "worker", "task": "wait", "timeout": 0.2}]})
            seen.append(list(got))
        return seen

    quiet, info, debug = anyio.run(main)
    assert quiet == []
    assert info == [
        ("info", "scout", "[scout] started (scout)"),
        ("info", "scout", "[scout] ls ."),
        ("info", "scout", "[scout] done"),
    ]
    assert [(level, logger) for level, logger, _ in debug] == [
        ("info", "worker"),
        ("debug", "worker"),
        ("debug", "worker"),
        ("warning", "worker"),
    ]
    assert debug[1][2] == "[worker] turn 1" and debug[2][2].startswith("[worker] 0 tokens generated, ")
    assert debug[3][2] == "[worker] failed: stopped by the timeout of 0.2s"


def test_a_started_tasks_log_messages_reach_the_client_that_started_it(tmp_path: Path) -> None:
    """`start_agents` answers at once; its task's messages come after, on the connection (none came: the
    task's events went only to the runner's sink, outside the call that started it)."""
    script = {"agents": {"scout": {"replies": [call("ls", path="."), {"content": "done looking", "delay": 0.3}]}}}
    got: list[tuple[str, str | None, Any]] = []

    async def on_log(params: types.LoggingMessageNotificationParams) -> None:
        got.append((params.level, params.logger, params.data))

    async def main() -> None:
        async with connect(tmp_path, script, budget=None, on_log=on_log) as (client, _):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                await client.set_logging_level("info")
            started = await client.call_tool("start_agents", {"agent": "scout", "task": "look"})
            assert started.structured_content["ids"] == ["scout#1"]
            answer = await client.call_tool("agent_output", {"id": "scout#1", "wait": 30})
            assert "done looking" in text(answer)
            with anyio.fail_after(10):
                while len(got) < 3:
                    await anyio.sleep(0.02)

    anyio.run(main)
    assert got == [
        ("info", "scout#1", "[scout#1] started (scout)"),
        ("info", "scout#1", "[scout#1] ls ."),
        ("info", "scout#1", "[scout#1] done"),
    ]
