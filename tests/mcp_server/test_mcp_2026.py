"""`subagent mcp` to a 2026-07-28 client (issue 65), through the SDK's own client: discovered without a
handshake, `tools/list` with its cache hint, and `run_agents` as an MCP task (the Tasks extension):
a handle at once, polled to its result or cancelled; a client without the extension, or on 2025-11-25,
gets what it always got."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.extension import ClientExtension
from mcp.client.stdio import StdioServerParameters
from mcp.shared.exceptions import MCPError

from mlx_subagents.tools import mcp_tasks
from tests.helpers import alive, call
from tests.mcp_server import test_mcp_server
from tests.mcp_server.test_mcp_server import answers, server_env, text

pytestmark = [pytest.mark.slow, pytest.mark.process, pytest.mark.usefixtures("preloaded_mcp")]


class Announced(ClientExtension):
    """The Tasks extension declared, its results claimed (parsed as a handle), settled by the test."""

    identifier = mcp_tasks.EXTENSION

    def claims(self) -> list[Any]:
        return [mcp_tasks.claim()]


@asynccontextmanager
async def client(*args: str | Path, mode: str = "auto", tasks: bool = True) -> AsyncIterator[Client]:
    """The SDK's `Client` on `subagent mcp ARGS` over stdio: `auto` discovers the revision (2026-07-28 here)."""
    python, *first = test_mcp_server.MCP_PYTHON
    argv = [*first, "-m", "mlx_subagents.cli", "mcp", *map(str, args)]
    params = StdioServerParameters(command=python, args=argv, env=server_env())
    async with Client(params, mode=mode, extensions=[Announced()] if tasks else None) as connected:
        yield connected


async def get(connected: Client, task_id: str) -> mcp_tasks.DetailedTask:
    request = mcp_tasks.GetTask(params=mcp_tasks.TaskIdParams(taskId=task_id))
    return await connected.session.send_request(request, mcp_tasks.DetailedTask)


async def until(connected: Client, task_id: str, done: Any, within: float = 30) -> mcp_tasks.DetailedTask:
    """`tasks/get` until `done(task)`, as a client polls (every 50 ms here)."""
    with anyio.fail_after(within):
        while not done(task := await get(connected, task_id)):
            await anyio.sleep(0.05)
    return task


def test_a_2026_client_discovers_the_server_with_tasks_and_a_cache_hint(tmp_path: Path, write_script: Any) -> None:
    model = write_script(["unused"])

    async def main() -> tuple[Any, ...]:
        async with client("--cwd", tmp_path, "--model", model) as modern:
            listed = await modern.list_tools(cache_mode="refresh")
            return modern.protocol_version, modern.server_capabilities, listed

    version, capabilities, listed = anyio.run(main)
    assert version == "2026-07-28"
    assert capabilities.extensions == {mcp_tasks.EXTENSION: {}}
    assert (listed.ttl_ms, listed.cache_scope) == (30_000, "private")
    assert [t.name for t in listed.tools] == [
        "list_agents", "run_agents", "start_agents", "agent_status", "agent_output", "send_to_agent", "cancel_agent",
    ]  # fmt: skip


def test_run_agents_as_a_task_answers_at_once_and_is_polled_to_its_result(tmp_path: Path, write_script: Any) -> None:
    """The agent's first turn waits in bash for a file the test writes once it holds the handle: the
    handle came before the agent could finish, and the polls see its turn and last tool call."""
    gate = tmp_path / "gate"
    wait = f"while [ ! -e {gate} ]; do sleep 0.05; done; echo opened"
    model = write_script({"agents": {"scout": {"replies": [call("bash", command=wait), "the gate opened"]}}})
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with client("--cwd", tmp_path, "--model", model) as modern:
            args = {"agent": "scout", "task": "wait for the gate"}
            handle = await modern.session.call_tool("run_agents", args, allow_claimed=True)
            seen["handle"] = handle
            seen["working"] = await until(modern, handle.task_id, lambda t: "last: $ while" in (t.status_message or ""))
            seen["status"] = text(await modern.call_tool("agent_status", {}))
            gate.touch()
            seen["done"] = await until(modern, handle.task_id, lambda t: t.status == "completed")
            seen["again"] = await get(modern, handle.task_id)

    anyio.run(main)
    handle = seen["handle"]
    assert isinstance(handle, mcp_tasks.TaskHandle) and handle.status == "working"
    assert len(handle.task_id) >= 32  # unguessable: the id is the only key to the task
    assert handle.model_extra is not None and handle.model_extra["ttlMs"] == 86_400_000
    assert handle.poll_interval_ms == 1000
    working = seen["working"]
    assert working.status == "working" and working.result is None
    assert working.status_message.startswith("scout#1 (scout) running: turn 1, ")
    assert seen["status"].startswith("scout#1 (scout) running: turn 1, ")  # the board holds it too
    result = types.CallToolResult.model_validate(seen["done"].result, by_name=False)
    assert not result.is_error and answers(result) == [("scout", "completed", "the gate opened")]
    assert text(result).startswith("the gate opened\n\n[sub-agent run ")
    assert seen["done"].status_message.startswith("completed: scout#1 (scout) completed: turn 2, ")
    assert seen["again"].result == seen["done"].result  # kept, read again


def test_a_cancelled_task_kills_its_bash_and_is_saved(tmp_path: Path, write_script: Any) -> None:
    model = write_script(
        {"agents": {"worker": {"replies": [call("bash", command="sleep 60 & echo $! > sleep.pid; wait")]}}}
    )
    pid_file = tmp_path / "sleep.pid"
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with client("--cwd", tmp_path, "--model", model) as modern:
            handle = await modern.session.call_tool(
                "run_agents", {"agent": "worker", "task": "sleep"}, allow_claimed=True
            )
            with anyio.fail_after(30):
                while not pid_file.exists() or not pid_file.read_text().strip():
                    await anyio.sleep(0.05)
            seen["pid"] = int(pid_file.read_text())
            cancel = mcp_tasks.CancelTask(params=mcp_tasks.TaskIdParams(taskId=handle.task_id))
            seen["ack"] = await modern.session.send_request(cancel, types.EmptyResult)
            seen["task"] = await until(modern, handle.task_id, lambda t: t.status != "working")
            seen["output"] = await modern.call_tool("agent_output", {"id": "worker#1"})

    anyio.run(main)
    assert not alive(seen["pid"])
    task = seen["task"]
    assert task.status == "cancelled" and task.result is None and task.error is None
    assert task.status_message.startswith("cancelled: worker#1 (worker) aborted: turn 1, ")
    assert task.status_message.endswith("; cancelled by the MCP client")
    assert text(seen["output"]).startswith("worker#1 aborted: cancelled by the MCP client")
    runs = sorted((Path(os.environ["MLX_SUBAGENTS_HOME"]) / "runs").iterdir())
    records = [json.loads(line) for line in next(runs[-1].glob("*.jsonl")).read_text().splitlines()]
    assert (records[-1]["result"]["status"], records[-1]["result"]["error"]) == (
        "aborted",
        "cancelled by the MCP client",
    )


def test_without_the_extension_or_on_2025_11_25_a_call_answers_as_always(tmp_path: Path, write_script: Any) -> None:
    model = write_script({"agents": {"scout": {"replies": ["found it"] * 2}}})
    seen: dict[str, Any] = {}

    async def main() -> None:
        args = {"agent": "scout", "task": "find it"}
        async with client("--cwd", tmp_path, "--model", model, tasks=False) as plain:
            seen["plain"] = await plain.call_tool("run_agents", args)
            for method, params in [
                ("tasks/get", {"taskId": "x"}), ("tasks/update", {"taskId": "x", "inputResponses": {}}),
                ("tasks/cancel", {"taskId": "x"}),
            ]:  # fmt: skip
                try:
                    await plain.session.send_request(
                        types.Request[dict, str](method=method, params=params), types.EmptyResult
                    )
                except MCPError as exc:
                    seen[method] = exc.error
        async with client("--cwd", tmp_path, "--model", model, mode="legacy") as old:
            seen["legacy"] = (old.protocol_version, await old.call_tool("run_agents", args))
        async with client("--cwd", tmp_path, "--model", model) as modern:
            try:
                await get(modern, "no-such-task")
            except MCPError as exc:
                seen["unknown"] = exc.error

    anyio.run(main)
    assert answers(seen["plain"]) == [("scout", "completed", "found it")]
    version, result = seen["legacy"]
    assert version == "2025-11-25" and answers(result) == [("scout", "completed", "found it")]
    for method in ("tasks/get", "tasks/update", "tasks/cancel"):
        error = seen[method]
        assert (error.code, error.message) == (-32021, "Missing required client capability")
        assert error.data == {"requiredCapabilities": {"extensions": {mcp_tasks.EXTENSION: {}}}}
    assert (seen["unknown"].code, seen["unknown"].message) == (-32602, "Failed to retrieve task: Task not found")


def test_a_refused_call_is_an_error_result_not_a_task(tmp_path: Path, write_script: Any) -> None:
    model = write_script(["unused"])

    async def main() -> Any:
        async with client("--cwd", tmp_path, "--model", model) as modern:
            args = {"agent": "scout", "task": "x", "cwd": "../elsewhere"}
            return await modern.session.call_tool("run_agents", args, allow_claimed=True)

    result = anyio.run(main)
    assert isinstance(result, types.CallToolResult) and result.is_error
    assert text(result).startswith("Error: cwd: ")
