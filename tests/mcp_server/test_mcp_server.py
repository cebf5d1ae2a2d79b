"""`subagent mcp`: the real server process over stdio, driven by the MCP SDK's own client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
import psutil
import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError

from mlx_subagents.caps import MAX_TASK_CHARS
from mlx_subagents.runs.transcripts import load_run, read_transcript
from tests.helpers import REPO, alive, call, task_text

pytestmark = [pytest.mark.slow, pytest.mark.process, pytest.mark.usefixtures("preloaded_mcp")]

FORMS = (
    'use exactly one of these forms: {"agent": "NAME", "task": "TEXT"} for one task; '
    '{"tasks": [{"agent": "NAME", "task": "TEXT"}, ...]} for up to 8 independent tasks in parallel; '
    '{"chain": [{"agent": "NAME", "task": "TEXT"}, ...]} for steps in order, where {previous} in a task is '
    "the previous step's answer; "
    '{"steps": [{"name": "N", "agent": "NAME", "task": "TEXT", "needs": ["M"]}, ...]} for steps that start '
    "when the steps they need are done, where {M} in a task is step M's answer"
)
BUILTINS = ["orchestrator", "planner", "reviewer", "scout", "worker"]
# The tiny model's server: the real `serve_stdio`, with forced decoding (the only thing a flag cannot pass).
TINY_SERVER = """
import asyncio, json, sys
from pathlib import Path
from mlx_lm.utils import load_tokenizer
from mlx_subagents.mcp_server.server import serve_stdio
from mlx_subagents.runs.options import RunOptions
from mlx_subagents.runs.runner import Runner
from mlx_subagents.testing import ForcedScripts

model, workspace, scripts = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
forced = ForcedScripts(load_tokenizer(Path(model)), scripts)
make = lambda root, sink: Runner(cwd=root, options=RunOptions(model=model), processor_factory=forced, on_event=sink)
asyncio.run(serve_stdio(make, workspace))
"""


# What stands for `python` when a test starts `subagent mcp`: while `preloaded_mcp` (tests/conftest.py) holds
# it, the worker's preloaded process (`preloaded_python`), whose fork is the server (2-3 s of CPU otherwise).
MCP_PYTHON = [sys.executable]


def server_env() -> dict[str, str]:
    """What the server needs from the test's environment (the SDK passes only a safe few by default)."""
    names = ("HOME", "MLX_SUBAGENTS_HOME", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    return {**{name: os.environ[name] for name in names}, "PYTHONPATH": str(REPO)}  # this checkout


@asynccontextmanager
async def connect(
    *args: str | Path, command: list[str] | None = None, roots: list[Path] | None = None, cwd: Path | None = None
) -> AsyncIterator[ClientSession]:
    """An initialized client session on `subagent mcp ARGS` (or on `command`), started in `cwd`."""
    python, *first = [sys.executable] if command else MCP_PYTHON
    argv = command or ["-m", "mlx_subagents.cli", "mcp", *map(str, args)]
    params = StdioServerParameters(command=python, args=[*first, *argv], env=server_env(), cwd=cwd)

    async def list_roots(_ctx: Any) -> types.ListRootsResult:
        return types.ListRootsResult(roots=[types.Root(uri=p.as_uri()) for p in roots or []])

    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write, list_roots_callback=list_roots if roots else None) as session:
            await session.initialize()
            yield session


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    return anyio.run(main)


def text(result: types.CallToolResult) -> str:
    assert len(result.content) == 1 and isinstance(result.content[0], types.TextContent)
    return result.content[0].text


def answers(result: types.CallToolResult) -> list[tuple[str, str, str]]:
    return [(t["label"], t["status"], t["answer"]) for t in result.structured_content["tasks"]]


def test_initialize_list_tools_and_list_agents(tmp_path: Path, write_script: Any) -> None:
    model = write_script(["unused"])

    async def main() -> tuple[Any, Any]:
        async with connect("--cwd", tmp_path, "--model", model) as client:
            tools = await client.list_tools()
            return tools, await client.call_tool("list_agents", {})

    tools, listing = run(main)
    by_name = {t.name: t for t in tools.tools}
    assert list(by_name) == [
        "list_agents",
        "run_agents",
        "start_agents",
        "agent_status",
        "agent_output",
        "send_to_agent",
        "cancel_agent",
    ]

    schema = by_name["run_agents"].input_schema
    # `label` in every form and each item's own choices (issue 26, item 8).
    # `isolation` on every form and each item (issue 30), offered only inside a git repository.
    # The single form takes the items' choices, `steps` is an inline workflow (issue 44, items 3 and 4);
    # `model` only where the operator grants models (`--allow-model`, imported ones).
    # Each task and step's own contract: its answer's schema, its tools, prompt, thinking, task file (issue 66).
    choices = {"task_file", "output_schema", "allowed_tools", "system_prompt", "thinking", "single_shot"}
    forms = {"agent", "task", "label", "tasks", "chain", "steps", "input", "cwd", "max_turns", "timeout", *choices}
    assert set(schema["properties"]) == forms
    item = {"agent", "task", "label", "cwd", "max_turns", "timeout", *choices}
    assert set(schema["properties"]["tasks"]["items"]["properties"]) == item
    assert set(schema["properties"]["chain"]["items"]["properties"]) == item
    step = {"name", "agent", "task", "needs", "max_turns", "timeout", *choices}
    assert set(schema["properties"]["steps"]["items"]["properties"]) == step
    assert by_name["start_agents"].input_schema == schema  # the same forms
    assert set(by_name["agent_output"].input_schema["properties"]) == {"id", "wait", "offset"}
    assert schema["additionalProperties"] is False
    description = by_name["run_agents"].description or ""
    assert f"in the workspace {tmp_path.resolve()}." in description
    assert "- scout (tools: read, grep, find, ls, bash): Finds where things are" in description
    assert not listing.is_error
    data = listing.structured_content
    assert data["workspace"] == str(tmp_path.resolve()) and data["withheld"] == [] and data["note"] is None
    assert [a["name"] for a in data["agents"]] == BUILTINS
    scout = data["agents"][3]
    assert scout == {
        "name": "scout",
        "description": "Finds where things are in the codebase and reports exact file locations. Never edits files.",
        "tools": ["read", "grep", "find", "ls", "bash"],
        "model": model,
        "source": "builtin",
    }
    assert f"- scout (builtin; tools: read, grep, find, ls, bash; model: {model}): Finds" in text(listing)


def test_parallel_run_returns_exact_answers_usage_and_transcripts(tmp_path: Path, write_script: Any) -> None:
    (tmp_path / "app.py").write_text("print('hi')\n")
    model = write_script(
        {
            "agents": {
                "scout": {"replies": [call("ls", path="."), "app.py is the only file"]},
                "reviewer": {"replies": ["app.py: no problems"]},
            }
        }
    )
    tasks = [{"agent": "scout", "task": "list the files"}, {"agent": "reviewer", "task": "review app.py"}]

    async def main() -> Any:
        async with connect("--cwd", tmp_path, "--model", model) as client:
            return await client.call_tool("run_agents", {"tasks": tasks})

    result = run(main)
    assert not result.is_error
    assert answers(result) == [
        ("scout", "completed", "app.py is the only file"),
        ("reviewer", "completed", "app.py: no problems"),
    ]
    data = result.structured_content
    assert (data["mode"], data["ok"], data["succeeded"], data["total"]) == ("parallel", True, 2, 2)
    scout, reviewer = data["tasks"]
    assert (scout["usage"]["turns"], reviewer["usage"]["turns"]) == (2, 1)
    assert scout["usage"]["cached_tokens"] > 0  # its second turn reused its first
    for task in data["tasks"]:
        assert Path(task["transcript"]).parent.name == data["run_id"]
        assert Path(task["transcript"]).is_file()
    body, footer = text(result).split("\n\n---\n")
    assert body == (
        "Parallel: 2/2 tasks completed\n\n### [scout] completed\napp.py is the only file\n\n"
        f"### [reviewer] completed\napp.py: no problems\n\n[sub-agent run {data['run_id']}]"
    )
    lines = footer.splitlines()
    assert lines[0].startswith("[scout] scout: completed in ") and ", 2 turns, " in lines[0]
    assert lines[0].endswith(f"; transcript {scout['transcript']}")
    assert len(lines) == 2 and lines[1].startswith("[reviewer] reviewer: completed in ")
    log = (Path(os.environ["MLX_SUBAGENTS_HOME"]) / "logs" / "mcp.log").read_text()
    assert "call run_agents {'tasks': [" in log and "call run_agents ok in " in log


def test_progress_notifications_arrive_in_order_for_each_call(tmp_path: Path, write_script: Any) -> None:
    scout = [{**call("ls", path="."), "delay": 0.3}, "done"]
    model = write_script(
        {"agents": {"scout": {"replies": scout}, "reviewer": {"replies": [{"content": "ok", "delay": 0.3}]}}}
    )
    seen: dict[str, list[tuple[float, str | None]]] = {"scout": [], "reviewer": []}
    results: dict[str, Any] = {}

    async def main() -> None:
        async with connect("--cwd", tmp_path, "--model", model) as client:

            async def run_one(agent: str) -> None:
                async def progress(value: float, total: float | None, message: str | None) -> None:
                    seen[agent].append((value, message))

                arguments = {"agent": agent, "task": "look"}
                results[agent] = await client.call_tool("run_agents", arguments, progress_callback=progress)

            async with anyio.create_task_group() as group:  # two calls at once: each gets only its own progress
                group.start_soon(run_one, "scout")
                group.start_soon(run_one, "reviewer")

    run(main)
    run_id = results["scout"].structured_content["run_id"]
    assert text(results["scout"]).startswith(f"done\n\n[sub-agent run {run_id}]\n\n---\n[scout] scout: completed")
    messages = [m for _, m in seen["scout"]]
    assert messages[:4] == ["[scout] started (scout)", "[scout] turn 1", messages[2], "[scout] ls ."]
    assert messages[2].startswith("[scout] ") and messages[2].endswith(" read (0 cached)")
    assert messages[4:6] == ["[scout] turn 2", messages[5]] and "tokens generated" in messages[5]
    assert messages[6:] == ["[scout] done"]
    reviewer = [m for _, m in seen["reviewer"]]
    assert reviewer == ["[reviewer] started (reviewer)", "[reviewer] turn 1", reviewer[2], "[reviewer] done"]
    for values in seen.values():
        assert [v for v, _ in values] == list(range(1, len(values) + 1))


def test_bad_calls_are_errors_and_the_server_keeps_answering(tmp_path: Path, write_script: Any) -> None:
    model = write_script({"agents": {"scout": {"replies": ["found it"]}, "planner": {"replies": []}}})

    async def main() -> list[Any]:
        async with connect("--cwd", tmp_path, "--model", model) as client:
            calls = [
                ("run_agents", {}),
                ("run_agents", {"agent": "nobody", "task": "x"}),
                ("run_agents", {"agent": "scout", "task": "x" * (MAX_TASK_CHARS + 1)}),
                ("run_agents", {"agent": "scout", "task": "x", "colour": "red"}),
                ("run_agents", {"agent": "scout", "task": "x", "background": True}),
                ("run_agents", {"agent": "scout", "task": "x", "cwd": "../elsewhere"}),
                ("run_agents", {"agent": "planner", "task": "plan"}),
                ("no_such_tool", {}),
                ("run_agents", {"agent": "scout", "task": "find it"}),
            ]
            return [await client.call_tool(name, arguments) for name, arguments in calls]

    *bad, good = run(main)
    background = bad.pop(4)
    assert background.is_error and text(background) == (
        "run_agents waits for its tasks and takes no 'background'; to start them and carry on, call start_agents "
        "with the same arguments"
    )
    assert [r.is_error for r in bad] == [True] * 7
    agents = "Available agents: " + ", ".join(BUILTINS)
    assert text(bad[0]) == f"Error: invalid run_agents call: no task given; {FORMS}. {agents}"
    assert text(bad[1]) == f"Error: invalid run_agents call: unknown agent 'nobody'; {FORMS}. {agents}"
    assert text(bad[2]) == (
        f"Error: run_agents call refused: task 'scout' is {MAX_TASK_CHARS + 1:,} characters, over the limit of "
        f"{MAX_TASK_CHARS:,}; shorten it, or put the details in a file the agent can read"
    )
    assert text(bad[3]) == f"Error: invalid run_agents call: unknown field 'colour'; {FORMS}. {agents}"
    assert text(bad[4]).startswith("Error: cwd: ")
    # A child that fails: the answer says why, the footer what to do; structured content says which.
    assert text(bad[5]).startswith("Error: agent 'planner' failed (error): scripted model: session 'planner'")
    assert "A task did not complete: its error says why. Read its transcript" in text(bad[5])
    assert bad[5].structured_content["tasks"][0]["status"] == "failed"
    assert text(bad[6]) == (
        "unknown tool 'no_such_tool'; this server has list_agents, run_agents, start_agents, agent_status, "
        "agent_output, send_to_agent and cancel_agent"
    )
    assert not good.is_error and answers(good) == [("scout", "completed", "found it")]


def test_cancelling_a_call_kills_its_bash_and_the_server_carries_on(tmp_path: Path, write_script: Any) -> None:
    pid_file = tmp_path / "sleep.pid"
    model = write_script(
        {
            "agents": {
                "worker": {"replies": [call("bash", command="sleep 300 & echo $! > sleep.pid; wait"), "never"]},
                "scout": {"replies": ["still here"]},
            }
        }
    )

    async def main() -> tuple[int, Any]:
        async with connect("--cwd", tmp_path, "--model", model) as client:
            async with anyio.create_task_group() as group:
                group.start_soon(client.call_tool, "run_agents", {"agent": "worker", "task": "sleep"})
                with anyio.fail_after(30):
                    while not pid_file.exists() or not pid_file.read_text().strip():
                        await anyio.sleep(0.05)
                pid = int(pid_file.read_text())
                assert alive(pid)
                group.cancel_scope.cancel()  # the SDK sends notifications/cancelled for the call
            deadline = time.monotonic() + 60  # a wait for the kill, well under the sleep's 300 s
            while alive(pid) and time.monotonic() < deadline:
                await anyio.sleep(0.05)
            return pid, await client.call_tool("run_agents", {"agent": "scout", "task": "are you there?"})

    pid, after = run(main)
    assert not alive(pid)
    assert answers(after) == [("scout", "completed", "still here")]
    runs = sorted((Path(os.environ["MLX_SUBAGENTS_HOME"]) / "runs").iterdir())
    records = [json.loads(line) for line in next(runs[0].glob("*.jsonl")).read_text().splitlines()]
    assert records[-1]["type"] == "result"
    assert (records[-1]["result"]["status"], records[-1]["result"]["stop_reason"]) == ("aborted", "cancelled")
    run_record = json.loads((runs[0] / "run.json").read_text())
    assert (run_record["status"], run_record["tasks"][0]["status"]) == ("interrupted", "aborted")


def test_project_agents_are_withheld_without_yes(tmp_path: Path, write_script: Any) -> None:
    folder = tmp_path / ".mlx-subagents" / "agents"
    folder.mkdir(parents=True)
    (folder / "helper.md").write_text("---\nname: helper\ndescription: helps\ntools: read\n---\nHelp.\n")
    model = write_script({"agents": {"helper": {"replies": ["helped"]}}})

    async def main(*flags: str) -> tuple[Any, Any]:
        async with connect("--cwd", tmp_path, "--model", model, *flags) as client:
            listing = await client.call_tool("list_agents", {})
            return listing, await client.call_tool("run_agents", {"agent": "helper", "task": "help"})

    listing, refused = run(main)
    data = listing.structured_content
    assert "helper" not in [a["name"] for a in data["agents"]]
    assert data["withheld"] == [{"name": "helper", "path": str(folder / "helper.md")}]
    assert data["note"] == (
        "1 project agent(s) withheld: helper. They come with the workspace and can run commands in it; to allow "
        "project agents, add --yes to the server's command in the MCP client configuration and restart it"
    )
    assert refused.is_error and text(refused) == (
        "Error: run_agents call refused: project agent(s) withheld: helper; they come with the workspace and can "
        "run commands in it; to allow project agents, add --yes to the server's command in the MCP client "
        "configuration and restart it"
    )
    listing, helped = run(lambda: main("--yes"))
    assert "helper" in [a["name"] for a in listing.structured_content["agents"]]
    assert answers(helped) == [("helper", "completed", "helped")]


def test_start_agents_checks_withheld_agents_before_it_starts_any(tmp_path: Path, write_script: Any) -> None:
    folder = tmp_path / ".mlx-subagents" / "agents"
    folder.mkdir(parents=True)
    (folder / "helper.md").write_text("---\nname: helper\ndescription: helps\ntools: read\n---\nHelp.\n")
    model = write_script({"agents": {"helper": {"replies": ["helped"]}, "scout": {"replies": ["seen"]}}})
    tasks = [{"agent": "scout", "task": "look"}, {"agent": "helper", "task": "help"}]

    async def main() -> tuple[Any, Any]:
        async with connect("--cwd", tmp_path, "--model", model) as client:
            refused = await client.call_tool("start_agents", {"tasks": tasks})
            return refused, await client.call_tool("agent_status", {})

    refused, status = run(main)
    assert refused.is_error and text(refused) == (
        "Error: start_agents call refused: project agent(s) withheld: helper; they come with the workspace and can "
        "run commands in it; to allow project agents, add --yes to the server's command in the MCP client "
        "configuration and restart it"
    )
    assert text(status) == "No tasks started yet: start_agents starts some."


def test_the_workspace_is_the_clients_first_root(tmp_path: Path, write_script: Any) -> None:
    root = tmp_path / "project"
    (root / "src").mkdir(parents=True)
    model = write_script({"agents": {"scout": {"replies": [call("ls", path="."), "one file"]}}})
    (root / "src" / "a.py").write_text("")

    async def main() -> tuple[Any, Any]:
        async with connect("--model", model, roots=[root]) as client:
            listing = await client.call_tool("list_agents", {})
            return listing, await client.call_tool("run_agents", {"agent": "scout", "task": "ls", "cwd": "src"})

    async def without_root() -> Any:
        async with connect("--model", model, cwd=Path("/")) as client:
            return await client.call_tool("list_agents", {})

    listing, result = run(main)
    refused = run(without_root)  # Cursor starts servers in / and lists no roots
    assert refused.is_error and text(refused) == (
        "no workspace: the server runs in / and the client gave no root; add --cwd PROJECT_FOLDER to the "
        "server's command in the MCP client configuration"
    )
    assert listing.structured_content["workspace"] == str(root.resolve())
    assert answers(result) == [("scout", "completed", "one file")]
    transcript = Path(result.structured_content["tasks"][0]["transcript"])
    assert '"cwd": "' + str((root / "src").resolve()) + '"' in transcript.read_text()


def test_the_tiny_real_model_stays_resident_between_calls(tmp_path: Path, tiny_qwen3_path: Path) -> None:
    from mlx_subagents.testing import tool_call_text

    (tmp_path / "app.py").write_text("print('hi')\n")
    scripts = {"scout": [tool_call_text("ls", {"path": "."}), "app.py is the only file", "still app.py"]}
    command = ["-c", TINY_SERVER, str(tiny_qwen3_path), str(tmp_path), json.dumps(scripts)]
    seen: list[str] = []

    async def progress(_value: float, _total: float | None, message: str | None) -> None:
        seen.append(message or "")

    async def main() -> tuple[Any, Any]:
        async with connect(command=command) as client:
            first = await client.call_tool("run_agents", {"agent": "scout", "task": "list"}, progress_callback=progress)
            second = await client.call_tool("run_agents", {"agent": "scout", "task": "again"})
            return first, second

    first, second = run(main)
    assert answers(first) == [("scout", "completed", "app.py is the only file")]
    assert answers(second) == [("scout", "completed", "still app.py")]
    usage = [m for m in seen if "tokens generated" in m]
    assert len(usage) == 2 and usage[0].endswith(" read (0 cached)")  # the first turn ever: nothing to reuse
    second_usage = second.structured_content["tasks"][0]["usage"]
    assert second_usage["turns"] == 1 and second_usage["cached_tokens"] > 0  # the prefix the first call left


# -- background tasks: start_agents and the tools on their ids ------------------------------------------

# 300 s: a process alive after the waits below (60 s at most, for a loaded machine) was never killed.
BASH_SLEEP = "echo $$ > bash.pid; sleep 300 & echo $! > sleep.pid; wait"


async def pids_of(folder: Path) -> list[int]:
    with anyio.fail_after(30):
        while not ((folder / "sleep.pid").is_file() and (folder / "sleep.pid").read_text().strip()):
            await anyio.sleep(0.05)
    return [int((folder / name).read_text()) for name in ("bash.pid", "sleep.pid")]


def test_started_tasks_are_watched_read_steered_and_cancelled(tmp_path: Path, write_script: Any) -> None:
    long = "a" * 30_000 + "b" * 30_000  # over the 50 KB an answer holds: read in two pieces
    model = write_script(
        {
            "agents": {
                "scout": {"replies": [{"content": "scout found it", "delay": 0.2}, "scout again"]},
                "worker": {"replies": [call("bash", command=BASH_SLEEP), "never"]},
                "reviewer": {"replies": [long]},
            }
        }
    )

    async def main() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        async with connect("--cwd", tmp_path, "--model", model) as client:
            tasks = [{"agent": "scout", "task": "look"}, {"agent": "worker", "task": "sleep"}]
            seen["started"] = await client.call_tool("start_agents", {"tasks": tasks})
            seen["scout"] = await client.call_tool("agent_output", {"id": "scout#1", "wait": 30})
            seen["pids"] = await pids_of(tmp_path)
            seen["status"] = await client.call_tool("agent_status", {})
            seen["send"] = await client.call_tool("send_to_agent", {"id": "scout#1", "message": "and more?"})
            seen["again"] = await client.call_tool("agent_output", {"id": "scout#1", "wait": 30})
            seen["cancel"] = await client.call_tool("cancel_agent", {"id": "worker#1"})
            seen["alive_after_cancel"] = [alive(p) for p in seen["pids"]]
            seen["review"] = await client.call_tool("start_agents", {"agent": "reviewer", "task": "review"})
            first = await client.call_tool("agent_output", {"id": "reviewer#1", "wait": 30})
            offset = first.structured_content["next_offset"]
            rest = await client.call_tool("agent_output", {"id": "reviewer#1", "offset": offset})
            seen["pieces"] = (first, rest)
            bad = [
                ("agent_output", {"id": "nobody"}),
                ("agent_output", {"id": "scout#1", "wait": 301}),
                ("agent_output", {"id": "scout#1", "offset": 99}),
                ("cancel_agent", {"id": "worker#1"}),
                ("send_to_agent", {"id": "worker#1", "message": "go on"}),
                ("agent_status", {"colour": "red"}),
                ("start_agents", {}),
                ("start_agents", {"tasks": [{"agent": "scout", "task": "x", "label": "scout#1"}]}),
            ]
            seen["bad"] = [await client.call_tool(name, arguments) for name, arguments in bad]
        return seen

    seen = run(main)
    started = seen["started"]
    assert not started.is_error and started.structured_content["ids"] == ["scout#1", "worker#1"]
    assert text(started).startswith("Started in the background: scout#1, worker#1. Carry on with other work; ")
    assert [t["agent"] for t in started.structured_content["tasks"]] == ["scout", "worker"]
    assert "output" not in started.structured_content["tasks"][0]  # answers are read with agent_output

    scout = seen["scout"]
    assert (scout.is_error, text(scout)) == (False, "scout#1 completed\n\nscout found it")
    data = scout.structured_content
    assert (data["task"]["status"], data["text"], data["offset"], data["next_offset"]) == (
        "completed",
        "scout found it",
        0,
        None,
    )

    by_id = {t["id"]: t for t in seen["status"].structured_content["tasks"]}
    assert (by_id["scout#1"]["status"], by_id["worker#1"]["status"]) == ("completed", "running")
    assert by_id["worker#1"]["last_tool"].startswith("$ echo $$ > bash.pid")
    lines = text(seen["status"]).splitlines()
    assert lines[0].startswith("scout#1 (scout) completed: turn 1, ") and lines[1].startswith(
        "worker#1 (worker) running"
    )

    assert not seen["send"].is_error and "scout#1" in text(seen["send"])
    assert text(seen["again"]) == "scout#1 completed\n\nscout again"
    cancel = seen["cancel"]
    assert not cancel.is_error and cancel.structured_content["tasks"][0]["status"] == "aborted"
    assert text(cancel) == "worker#1 aborted; agent_output shows what it had done"
    assert seen["alive_after_cancel"] == [False, False]  # answered once its processes were killed

    first, rest = seen["pieces"]
    assert first.structured_content["next_offset"] == 50 * 1024
    assert first.structured_content["text"] == long[: 50 * 1024]
    assert text(first).endswith(f'[more: agent_output {{"id": "reviewer#1", "offset": {50 * 1024}}}]')
    assert (rest.structured_content["text"], rest.structured_content["next_offset"]) == (long[50 * 1024 :], None)
    assert first.structured_content["total_chars"] == 60_000

    bad = seen["bad"]
    assert [r.is_error for r in bad] == [True] * len(bad)
    assert text(bad[0]) == "no task 'nobody' here; the tasks started here are: scout#1, worker#1, reviewer#1"
    assert text(bad[1]).startswith("wait is at most 300 seconds, got 301; ")
    assert text(bad[2]) == "offset 99 is past the end of scout#1's answer (11 characters); read from offset 0"
    assert text(bad[3]) == "task 'worker#1' is not running (it aborted); nothing to cancel"
    assert text(bad[4]).startswith("task 'worker#1' was cancelled (cancelled by the MCP client) and takes no more")
    assert text(bad[5]) == "invalid agent_status call: unknown field 'colour'; it takes: id"
    assert text(bad[6]).startswith("Error: invalid start_agents call: no task given; ")
    assert "start_agents call refused: a task named 'scout#1' was already started here" in text(bad[7])

    # The message is in the scout's transcript: the user message of its second generation.
    runs = [load_run(p.name) for p in (Path(os.environ["MLX_SUBAGENTS_HOME"]) / "runs").iterdir()]
    [scout_run] = [r for r in runs if r.tasks[0].label == "scout#1"]
    log = read_transcript(scout_run.transcript_path(scout_run.tasks[0]))
    assert [m["content"] for m in log.messages if m["role"] in ("user", "assistant")] == [
        task_text("look", tmp_path),  # a started task's first message is its task
        "scout found it",
        "and more?",
        "scout again",
    ]
    assert log.generations == 2 and scout_run.status == "finished"
    [worker_run] = [r for r in runs if r.tasks[0].label == "worker#1"]
    assert (worker_run.status, worker_run.tasks[0].status) == ("interrupted", "aborted")


def test_the_server_stopping_cancels_the_tasks_still_running(tmp_path: Path, write_script: Any) -> None:
    model = write_script({"agents": {"worker": {"replies": [call("bash", command=BASH_SLEEP), "never"]}}})

    async def main() -> list[int]:
        async with connect("--cwd", tmp_path, "--model", model) as client:
            started = await client.call_tool("start_agents", {"agent": "worker", "task": "sleep"})
            assert started.structured_content["ids"] == ["worker#1"]
            return await pids_of(tmp_path)

    pids = run(main)  # the client closes the server's stdin: it stops
    deadline = time.monotonic() + 60  # a wait for the kills, well under the sleep's 300 s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)
    [path] = (Path(os.environ["MLX_SUBAGENTS_HOME"]) / "runs").glob("*/run.json")
    record = json.loads(path.read_text())
    assert (record["status"], record["tasks"][0]["status"]) == ("interrupted", "aborted")


def test_results_carry_the_childrens_usage_and_new_agent_files_are_seen(tmp_path: Path, write_script: Any) -> None:
    model = write_script(
        {
            "agents": {
                "orchestrator": {"replies": [call("subagent", agent="scout", task="look"), "the scout looked"]},
                "scout": {"replies": [call("ls", path="."), "nothing here"]},
                "late": {"replies": ["late was here"]},
            }
        }
    )

    async def main() -> tuple[Any, Any, Any]:
        async with connect("--cwd", tmp_path, "--model", model, "--yes") as client:
            delegated = await client.call_tool("run_agents", {"agent": "orchestrator", "task": "go"})
            (tmp_path / ".mlx-subagents" / "agents").mkdir(parents=True)
            (tmp_path / ".mlx-subagents" / "agents" / "late.md").write_text(
                "---\nname: late\ndescription: came late\ntools: read\n---\nLook.\n"
            )
            listing = await client.call_tool("list_agents", {})
            return delegated, listing, await client.call_tool("run_agents", {"agent": "late", "task": "look"})

    delegated, listing, late = run(main)
    (task,) = delegated.structured_content["tasks"]
    children = task["children"]
    assert [(c["label"], c["status"], c["usage"]["turns"]) for c in children["tasks"]] == [
        ("orchestrator > scout#1", "completed", 2)
    ]
    assert children["usage"] == children["tasks"][0]["usage"]
    used = children["usage"]
    status = text(delegated).splitlines()[-1]
    assert f"; its 1 sub-agent(s): {used['input_tokens']:,} tokens read, {used['output_tokens']:,} generated;" in status
    assert "late" in [a["name"] for a in listing.structured_content["agents"]]
    assert answers(late) == [("late", "completed", "late was here")]


# -- stop signals: the same handling as `subagent run` ----------------------------------------------------

# Writes the server's pid as well as its own and its child's: the server is the parent of bash's parent,
# the tether each command starts under.
BASH_SLEEP_SERVER = "cut -d' ' -f4 /proc/$PPID/stat > server.pid; " + BASH_SLEEP
# Runs `subagent mcp ARGS` and writes its exit code to a file: the SDK client does not give it. The SDK
# sends SIGTERM 2 s after closing stdin (SIGKILL 2 s later): ignored here, a loaded machine's slower
# exit still gets its code written.
EXIT_CODE = """
import signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
default = lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server's own stays as it was
code = subprocess.call([sys.executable, "-m", "mlx_subagents.cli", "mcp", *sys.argv[2:]], preexec_fn=default)
open(sys.argv[1], "w").write(str(code))
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_stop_signal_answers_the_call_kills_saves_and_exits(
    tmp_path: Path, write_script: Any, signum: signal.Signals
) -> None:
    for folder in ("fg", "bg"):
        (tmp_path / folder).mkdir()
    model = write_script({"agents": {"scout": {"replies": [call("bash", command=BASH_SLEEP_SERVER), "never"]}}})
    code_file = tmp_path / "code"
    command = ["-c", EXIT_CODE, str(code_file), "--cwd", str(tmp_path), "--model", model]
    reason = "aborted by the user (Ctrl-C)" if signum == signal.SIGINT else f"stopped by {signum.name}"

    async def main() -> tuple[Any, list[int]]:
        with anyio.fail_after(60):  # a server killed at once (or one that never exits) would leave the call waiting
            return await stop_in_a_call()

    async def stop_in_a_call() -> tuple[Any, list[int]]:
        async with connect(command=command) as client:
            started = await client.call_tool("start_agents", {"agent": "scout", "task": "wait", "cwd": "bg"})
            assert started.structured_content["ids"] == ["scout#1"]
            outcome: dict[str, Any] = {}

            async def run_one() -> None:
                outcome["call"] = await client.call_tool("run_agents", {"agent": "scout", "task": "wait", "cwd": "fg"})

            async with anyio.create_task_group() as group:
                group.start_soon(run_one)
                pids = await pids_of(tmp_path / "fg") + await pids_of(tmp_path / "bg")
                os.kill(int((tmp_path / "fg" / "server.pid").read_text()), signum)
            # The server exits on its own; leaving the client first would have the SDK's clean-up signal it
            # again mid-exit (a loaded machine's slow save read as -15, not the server's own exit code).
            while not code_file.is_file():
                await anyio.sleep(0.05)
            return outcome["call"], pids

    answered, pids = run(main)
    assert answered.structured_content["tasks"][0]["status"] == "aborted"
    assert (answered.structured_content["tasks"][0]["error"], answered.structured_content["ok"]) == (reason, False)
    assert code_file.read_text() == str(128 + signum)
    assert not any(alive(p) for p in pids)
    records = [load_run(p.name) for p in (Path(os.environ["MLX_SUBAGENTS_HOME"]) / "runs").iterdir()]
    assert sorted(r.tasks[0].label for r in records) == ["scout", "scout#1"]
    for record in records:
        assert (record.status, record.tasks[0].status) == ("interrupted", "aborted")
        [result] = read_transcript(record.transcript_path(record.tasks[0])).results
        assert (result.status, result.stop_reason, result.error) == ("aborted", "cancelled", reason)
    log = (Path(os.environ["MLX_SUBAGENTS_HOME"]) / "logs" / "mcp.log").read_text()
    assert f"{signum.name} received: stopping every task" in log and log.endswith("stopped\n")


def test_a_stop_signal_on_an_idle_server_exits_at_once(tmp_path: Path, write_script: Any) -> None:
    model = write_script(["unused"])
    code_file = tmp_path / "code"
    command = ["-c", EXIT_CODE, str(code_file), "--cwd", str(tmp_path), "--model", model]

    async def main() -> None:
        async with connect(command=command) as client:
            await client.list_tools()
            [server] = [p for p in psutil.Process().children(recursive=True) if "mcp" in p.cmdline()]
            server.send_signal(signal.SIGINT)
            with anyio.fail_after(30):
                while not code_file.is_file():
                    await anyio.sleep(0.05)

    run(main)
    assert code_file.read_text() == "130"


# -- every request with an id gets an answer ---------------------------------------------------------------


def test_malformed_requests_with_an_id_are_answered_and_logged(tmp_path: Path, write_script: Any) -> None:
    model = write_script(["unused"])
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "plain", "version": "0"},
        },
    }
    lines = [
        json.dumps(initialize),
        '{"jsonrpc":"2.0","method":"notifications/initialized"}',
        '{"jsonrpc":"2.0","id":2,"method":5}',
        "not json",
        '{"id":3,"method":"tools/list"}',
        "[1, 2]",
        '{"jsonrpc":"2.0","id":"four","method":"tools/call","params":{"name":5}}',
        '{"jsonrpc":"2.0","id":5,"method":"tools/call","params":7}',
        '{"jsonrpc":"2.0","id":true,"method":"tools/list"}',
        '{"jsonrpc":"2.0","method":7}',
        '{"jsonrpc":"2.0","id":6,"method":"no/such"}',
        '{"jsonrpc":"2.0","id":7,"method":"tools/list","params":{"cursor":3}}',
        '{"jsonrpc":"2.0","id":{"a":1},"method":"ping"}',
        '[{"jsonrpc":"2.0","id":9,"method":"ping"}]',
        '{"jsonrpc":"2.0","id":8,"method":"ping"}',
    ]
    proc = subprocess.Popen(
        [*MCP_PYTHON, "-m", "mlx_subagents.cli", "mcp", "--cwd", str(tmp_path), "--model", model],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("\n".join(lines) + "\n")
    proc.stdin.flush()
    replies = [json.loads(proc.stdout.readline()) for _ in range(13)]  # stdin open until all are answered
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    answers = {str(m["id"]): m.get("error", m.get("result")) for m in replies}
    assert set(answers) == {"1", "2", "None", "3", "four", "5", "6", "7", "8"}
    assert answers["2"] == {"code": -32600, "message": "Invalid request: 'method' must be a string"}
    assert answers["3"] == {"code": -32600, "message": "Invalid request: 'jsonrpc' must be \"2.0\""}
    assert answers["four"] == {
        "code": -32602,
        "message": "Invalid params: tools/call: params.name: Input should be a valid string",
    }
    assert answers["5"] == {"code": -32600, "message": "Invalid request: 'params' must be an object"}
    assert answers["6"] == {"code": -32601, "message": "Method not found", "data": "no/such"}
    assert answers["7"] == {
        "code": -32602,
        "message": "Invalid params: tools/list: params.cursor: Input should be a valid string",
    }
    assert answers["8"] == {}
    nulls = [m["error"] for m in replies if m["id"] is None]
    assert nulls == [
        {"code": -32700, "message": "Parse error: the line is not valid JSON"},
        {
            "code": -32600,
            "message": "Invalid request: a message is one JSON object, got an array (batches are not supported)",
        },
        {"code": -32600, "message": "Invalid request: 'id' must be a string or an integer"},
        {"code": -32600, "message": "Invalid request: 'id' must be a string or an integer"},
        {
            "code": -32600,
            "message": "Invalid request: a message is one JSON object, got an array (batches are not supported)",
        },
    ]
    warnings = [line.split(" mlx_subagents.mcp: ")[1] for line in err.splitlines() if " WARNING " in line]
    assert warnings == [
        "malformed request 2 from the client: Invalid request: 'method' must be a string: " + lines[2],
        "malformed message (answered with id null) from the client: Parse error: the line is not valid JSON: not json",
        "malformed request 3 from the client: Invalid request: 'jsonrpc' must be \"2.0\": " + lines[4],
        "malformed message (answered with id null) from the client: Invalid request: a message is one JSON object, "
        "got an array (batches are not supported): [1, 2]",
        "malformed request 'four' from the client: Invalid params: tools/call: params.name: Input should be a valid "
        "string: " + lines[6],
        "malformed request 5 from the client: Invalid request: 'params' must be an object: " + lines[7],
        "malformed message (answered with id null) from the client: Invalid request: 'id' must be a string or an "
        "integer: " + lines[8],
        "malformed notification from the client, not answered: " + lines[9],
        "malformed request 7 from the client: Invalid params: tools/list: params.cursor: Input should be a valid "
        "string: " + lines[11],
        "malformed message (answered with id null) from the client: Invalid request: 'id' must be a string or an "
        "integer: " + lines[12],
        "malformed message (answered with id null) from the client: Invalid request: a message is one JSON object, "
        "got an array (batches are not supported): " + lines[13],
    ]
    assert "Traceback" not in err


def test_a_refused_workspace_is_one_clear_message_in_every_method(tmp_path: Path, write_script: Any) -> None:
    model = write_script(["unused"])
    refusal = (
        "no workspace: the server runs in / and the client gave no root; add --cwd PROJECT_FOLDER to the "
        "server's command in the MCP client configuration"
    )

    async def main() -> tuple[Any, list[Any]]:
        async with connect("--model", model, cwd=Path("/")) as client:
            with pytest.raises(MCPError) as listed:
                await client.list_tools()
            names = ["list_agents", "run_agents", "start_agents", "agent_status", "cancel_agent"]
            return listed.value, [await client.call_tool(name, {}) for name in names]

    listed, calls = run(main)
    assert (listed.error.code, listed.error.message) == (-32000, refusal)
    assert [(c.is_error, text(c)) for c in calls] == [(True, refusal)] * 5
    log = (Path(os.environ["MLX_SUBAGENTS_HOME"]) / "logs" / "mcp.log").read_text()
    assert f"WARNING mlx_subagents.mcp: tools/list refused: {refusal}\n" in log
    assert f"WARNING mlx_subagents.mcp: call run_agents refused: {refusal}\n" in log
    assert "Traceback" not in log


def test_run_agents_runs_a_named_workflow_and_lists_the_form_only_then(tmp_path: Path, write_script: Any) -> None:
    """Issue 26, item 9: the workflow form on `run_agents`, read and checked as the tool's."""
    model = write_script({"agents": {"scout": {"replies": ["src/dates.py:10"]}, "planner": {"replies": ["1. fix"]}}})
    flow = "[[steps]]\nid = 'find'\nagent = 'scout'\nprompt = 'Find: {input}'\n\n"
    flow += "[[steps]]\nid = 'plan'\nagent = 'planner'\nprompt = 'Plan using {find}.'\nneeds = ['find']\n"

    async def main() -> tuple[Any, Any, Any, Any]:
        async with connect("--cwd", tmp_path, "--model", model) as client:
            before = await client.list_tools()
            (tmp_path / ".mlx-subagents" / "workflows").mkdir(parents=True)
            (tmp_path / ".mlx-subagents" / "workflows" / "fix.toml").write_text(flow)
            after = await client.list_tools()
            ran = await client.call_tool("run_agents", {"workflow": "fix", "input": "dates lose their zone"})
            return before, after, ran, await client.call_tool("run_agents", {"workflow": "nope"})

    before, after, ran, unknown = run(main)
    fields = {t.name: set(t.input_schema["properties"]) for t in after.tools}
    assert "workflow" not in {f for t in before.tools for f in t.input_schema.get("properties", {})}
    assert {"workflow", "input"} <= fields["run_agents"] and {"workflow", "input"} <= fields["start_agents"]
    assert ran.structured_content["mode"] == "workflow" and ran.is_error is False
    assert answers(ran) == [("find", "completed", "src/dates.py:10"), ("plan", "completed", "1. fix")]
    assert text(ran).startswith("Workflow fix: 2/2 steps completed\n\n### [find: scout] completed\nsrc/dates.py:10")
    assert unknown.is_error
    assert text(unknown) == "Error: run_agents call refused: unknown workflow 'nope'; available: fix"


def test_start_agents_starts_a_named_workflow_in_the_background(tmp_path: Path, write_script: Any) -> None:
    model = write_script({"agents": {"scout": {"replies": ["src/dates.py:10"]}, "planner": {"replies": ["1. fix"]}}})
    folder = tmp_path / ".mlx-subagents" / "workflows"
    folder.mkdir(parents=True)
    flow = "[[steps]]\nid = 'find'\nagent = 'scout'\nprompt = 'Find: {input}'\n\n"
    (folder / "fix.toml").write_text(
        flow + "[[steps]]\nid = 'plan'\nagent = 'planner'\nprompt = 'Plan using {find}.'\nneeds = ['find']\n"
    )

    async def main() -> tuple[Any, Any]:
        async with connect("--cwd", tmp_path, "--model", model) as client:
            started = await client.call_tool("start_agents", {"workflow": "fix", "input": "dates"})
            return started, await client.call_tool("agent_output", {"id": "planner#1", "wait": 60})

    started, planned = run(main)
    assert started.structured_content["ids"] == ["scout#1", "planner#1"]
    assert text(planned) == "planner#1 completed\n\n1. fix"


def test_run_agents_and_start_agents_take_an_inline_workflow(tmp_path: Path, write_script: Any) -> None:
    """Issue 44, item 3: `{"steps": [...]}` on both tools, checked as a workflow file is, nothing run on a fault."""
    model = write_script(
        {"agents": {"scout": {"replies": ["src/dates.py:10"] * 2}, "planner": {"replies": ["1. fix"] * 2}}}
    )
    steps = [
        {"name": "find", "agent": "scout", "task": "Find: {input}"},
        {"name": "plan", "agent": "planner", "task": "Plan using {find}.", "needs": ["find"]},
    ]
    cycle = [
        {"name": "a", "agent": "scout", "task": "x", "needs": ["b"]},
        {"name": "b", "agent": "scout", "task": "y", "needs": ["a"]},
    ]

    async def main() -> tuple[Any, ...]:
        async with connect("--cwd", tmp_path, "--model", model) as client:
            ran = await client.call_tool("run_agents", {"steps": steps, "input": "dates lose their zone"})
            started = await client.call_tool("start_agents", {"steps": steps, "input": "dates"})
            planned = await client.call_tool("agent_output", {"id": "planner#1", "wait": 60})
            refused = await client.call_tool("run_agents", {"steps": cycle})
            return ran, started, planned, refused

    ran, started, planned, refused = run(main)
    assert ran.structured_content["mode"] == "workflow" and ran.is_error is False
    assert answers(ran) == [("find", "completed", "src/dates.py:10"), ("plan", "completed", "1. fix")]
    assert text(ran).startswith("Workflow: 2/2 steps completed\n\n### [find: scout] completed\nsrc/dates.py:10")
    assert started.structured_content["ids"] == ["scout#1", "planner#1"]
    assert text(planned) == "planner#1 completed\n\n1. fix"
    assert refused.is_error
    assert text(refused) == (
        "Error: run_agents call refused: steps: the needs form a cycle: a -> b -> a; remove one of these needs"
    )


def test_an_object_id_or_a_batch_is_answered_with_invalid_request_and_id_null() -> None:
    """The SDK drops both unseen (no answer ever comes); each gets -32600 with id null, as JSON-RPC says
    for a request whose id cannot be read."""
    from mlx_subagents.mcp_server.stdio import malformed

    lines = [
        '{"jsonrpc": "2.0", "id": {"a": 1}, "method": "ping"}',
        '{"jsonrpc": "2.0", "id": [1], "method": "tools/list"}',
        '[{"jsonrpc": "2.0", "id": 1, "method": "ping"}, {"jsonrpc": "2.0", "id": 2, "method": "ping"}]',
        "[]",
    ]
    answers = [malformed(line) for line in lines]
    assert [(i, e.code if e else None) for i, e in answers] == [(None, -32600)] * 4  # type: ignore[misc]
