"""Clients of one `subagent serve`: relayed `subagent mcp` sessions and attached commands, as real processes."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp.shared.exceptions import MCPError

from mlx_subagents.runs.transcripts import list_runs, load_run, read_transcript
from mlx_subagents.serve.client import make_hello, quick
from mlx_subagents.serve.state import serve_paths
from tests.helpers import all_dead, call, spawn_cli
from tests.mcp_server.test_mcp_server import answers, connect, text

# A bash command that waits (at most a minute) for the test to create `go` in its workspace.
UNTIL_GO = "for i in $(seq 600); do [ -e go ] && exit 0; sleep 0.1; done"

pytestmark = [pytest.mark.slow, pytest.mark.process, pytest.mark.usefixtures("preloaded_mcp")]


def status_of(info: Any) -> dict[str, Any]:
    return quick(info, make_hello("status"))["status"]


def folders(root: Path, *names: str) -> dict[str, Path]:
    made = {name: root / name for name in names}
    for folder in made.values():
        folder.mkdir()
    return made


def test_two_relayed_clients_and_an_attached_run_share_one_host_and_batch(
    serve_process: Any, tmp_path: Path, tiny_qwen3_path: Path, preloaded_python: list[str]
) -> None:
    from mlx_subagents.testing import tool_call_text

    gate = tmp_path / "gate"
    gate.mkdir()
    labels = ("a", "b", "scout")  # the relayed clients label their tasks; `subagent run` labels it by its agent
    # Each task's first turn waits in bash until all three have arrived: their second turns start together.
    barrier = "touch {gate}/{label}; while [ $(ls {gate} | wc -l) -lt 3 ]; do sleep 0.02; done; echo met"
    replies = {label: " ".join([f"{label}-word"] * 40) for label in labels}
    scripts = {
        label: [tool_call_text("bash", {"command": barrier.format(gate=gate, label=label)}), replies[label]]
        for label in labels
    }
    ws = folders(tmp_path, *labels)
    _, info = serve_process(tiny=(tiny_qwen3_path, tmp_path, scripts))
    results: dict[str, Any] = {}

    async def main() -> None:
        # A's workspace: its root; each call budget its client's own flag (the server answers its calls
        # within it), both long enough that a loaded machine's slow turns still answer whole.
        a_args, b_args = ("--call-budget", "600"), ("--cwd", ws["b"], "--call-budget", "599")
        async with connect(*a_args, roots=[ws["a"]]) as a, connect(*b_args) as b:
            for client, label in ((a, "a"), (b, "b")):
                listed = {tool.name: tool for tool in (await client.list_tools()).tools}
                results[f"budget {label}"] = listed["run_agents"].description
            attached = spawn_cli("run", "scout", "map it", "--json", "-C", str(ws["scout"]), python=preloaded_python)

            async def relayed(client: Any, label: str) -> None:
                results[label] = await client.call_tool(
                    "run_agents", {"agent": "scout", "task": "map it", "label": label}
                )

            async with anyio.create_task_group() as group:
                group.start_soon(relayed, a, "a")
                group.start_soon(relayed, b, "b")
                results["scout"] = await anyio.to_thread.run_sync(lambda: attached.communicate(timeout=120))
            results["code"] = attached.returncode
            results["status"] = status_of(info)

    anyio.run(main)
    assert "A call answers within 600 s" in results["budget a"]
    assert "A call answers within 599 s" in results["budget b"]
    assert answers(results["a"]) == [("a", "completed", replies["a"])]
    assert answers(results["b"]) == [("b", "completed", replies["b"])]
    out, _ = results["scout"]
    attached = json.loads(out)
    assert results["code"] == 0 and (attached["status"], attached["output"]) == ("completed", replies["scout"])
    assert Path(attached["transcript"]).is_file()
    [model] = results["status"]["models"]  # one host: one load, one KV pool, one batch
    assert model["model"] == str(tiny_qwen3_path) and model["most_decoding"] == 3
    assert serve_paths().log.read_text().count(f"loaded {tiny_qwen3_path} ") == 1
    workspaces = sorted(c["workspace"] for c in results["status"]["clients"])
    assert workspaces == sorted(str(ws[label].resolve()) for label in ("a", "b"))  # the attached run has ended


def test_each_client_sees_only_its_tasks_and_a_disconnect_cancels_only_its_foreground(
    serve_process: Any, tmp_path: Path, write_script: Any
) -> None:
    model = write_script(
        {
            "replies": ["unused"],
            "sessions": {
                # A's background task runs until the test has seen A's client linger for it (a 'sleep 6' ended
                # first on a loaded machine: its client was gone before the status was read).
                "a-bg": {"replies": [call("bash", command=UNTIL_GO), "a's background task is done"]},
                "a-fg": {"replies": [call("bash", command="sleep 20")]},
                "b-fg": {"replies": [{"content": "b's answer", "delay": 3.0}]},
                "b-cancel": {"replies": [call("bash", command="sleep 20")]},
            },
        }
    )
    ws = folders(tmp_path, "a", "b")
    _, info = serve_process("--no-http", "--model", model)
    seen: dict[str, Any] = {}

    async def client_a() -> None:
        async with connect("--cwd", ws["a"]) as a:
            seen["started"] = (
                await a.call_tool("start_agents", {"agent": "scout", "task": "bg", "label": "a-bg"})
            ).structured_content["ids"]
            seen["a-sees"] = text(await a.call_tool("agent_status", {}))

            async def kill_my_relay() -> None:
                await anyio.sleep(1.0)
                [relay] = [c for c in status_of(info)["clients"] if c["workspace"] == str(ws["a"].resolve())]
                os.kill(relay["pid"], signal.SIGKILL)  # the client's process ends: a disconnect, not a cancel

            try:
                async with anyio.create_task_group() as group:
                    group.start_soon(kill_my_relay)
                    await a.call_tool("run_agents", {"agent": "scout", "task": "fg", "label": "a-fg"})
            except BaseException as exc:  # the relay is gone: its call cannot be answered
                seen["a-fg"] = type(exc).__name__

    async def client_b() -> None:
        async with connect("--cwd", ws["b"]) as b:
            await anyio.sleep(0.5)
            seen["b-sees"] = text(await b.call_tool("agent_status", {}))
            seen["b-reads"] = await b.call_tool("agent_output", {"id": "a-bg"})
            seen["b-fg"] = await b.call_tool("run_agents", {"agent": "scout", "task": "fg", "label": "b-fg"})
            with anyio.move_on_after(1.0):  # the client cancels its call: the relay passes it on
                await b.call_tool("run_agents", {"agent": "scout", "task": "fg", "label": "b-cancel"})
            with anyio.fail_after(20):  # saved as cancelled before B leaves (which would cancel it too)
                while "b-cancel" not in await anyio.to_thread.run_sync(transcript_ends):
                    await anyio.sleep(0.1)
            seen["status"] = status_of(info)

    async def main() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(client_a)
            group.start_soon(client_b)

    anyio.run(main)
    assert seen["started"] == ["a-bg"] and seen["a-sees"].startswith("a-bg (scout) running: turn 1")
    assert seen["b-sees"] == "No tasks started yet: start_agents starts some."
    assert (
        seen["b-reads"].is_error
        and "a-bg" in text(seen["b-reads"])
        and "background is done" not in text(seen["b-reads"])
    )
    assert answers(seen["b-fg"]) == [("b-fg", "completed", "b's answer")]  # untouched by A's disconnect
    gone = [c for c in seen["status"]["clients"] if not c["connected"]]
    assert [c["workspace"] for c in gone] == [str(ws["a"].resolve())]  # A's client lingers for its background task
    (ws["a"] / "go").touch()
    deadline = time.monotonic() + 30
    while len(ends := transcript_ends()) < 4:
        assert time.monotonic() < deadline, f"the tasks did not all end: {ends}"
        time.sleep(0.1)
    assert ends == {
        "a-bg": ("completed", None, "a's background task is done"),
        "a-fg": ("aborted", "the client disconnected", ""),
        "b-fg": ("completed", None, "b's answer"),
        "b-cancel": ("aborted", "aborted by the user (Ctrl-C)", ""),  # as a client's cancel reads in-process
    }


def transcript_ends() -> dict[str, tuple[str, str | None, str]]:
    """Every saved task's end by label: status, error, answer."""
    ends = {}
    for record in list_runs(50):
        for task in record.tasks:
            lines = [json.loads(line) for line in (record.folder / task.file).read_text().splitlines()]
            result = next((line["result"] for line in reversed(lines) if "result" in line), None)
            if result is not None:
                ends[result["label"]] = (result["status"], result["error"], result["output"])
    return ends


def test_the_server_killed_mid_call_gives_one_line_at_each_client_and_readable_transcripts(
    serve_process: Any, tmp_path: Path, write_script: Any, run_cli: Any, preloaded_python: list[str]
) -> None:
    model = write_script(
        {
            "replies": ["unused"],
            "sessions": {
                "r": {"replies": [call("bash", command="sleep 8 & echo $! > r.pid; wait")]},
                "scout": {"replies": [call("bash", command="sleep 8 & echo $! > scout.pid; wait")]},
                "after": {"replies": ["served in the relay's own process"]},
            },
        }
    )
    server, info = serve_process("--no-http", "--model", model, "-C", str(tmp_path), own=True)
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with connect("--cwd", tmp_path, "--model", model) as client:
            attached = spawn_cli("run", "scout", "wait", "-C", str(tmp_path), python=preloaded_python)

            async def kill_server() -> None:
                with anyio.fail_after(60):  # both calls running; else the test says why instead of hanging
                    while len(status_of(info)["tasks"]) < 2:
                        assert attached.poll() is None, attached.communicate()
                        await anyio.sleep(0.1)
                await anyio.sleep(0.5)
                server.send_signal(signal.SIGKILL)

            async with anyio.create_task_group() as group:
                group.start_soon(kill_server)
                try:
                    await client.call_tool("run_agents", {"agent": "scout", "task": "wait", "label": "r"})
                except MCPError as exc:
                    seen["error"] = str(exc)
            seen["cli"] = await anyio.to_thread.run_sync(lambda: attached.communicate(timeout=60))
            seen["code"] = attached.returncode
            seen["after"] = await client.call_tool("run_agents", {"agent": "scout", "task": "go on", "label": "after"})

    anyio.run(main)
    assert seen["error"] == (
        f"the mlx-subagents server (pid {info.pid}) stopped during this call; what its tasks had done is saved "
        "(subagent runs lists it). This server now runs the agents itself: call again"
    )
    out, err = seen["cli"]
    assert seen["code"] == 1 and err.splitlines()[-1] == (
        f"error: the server (pid {info.pid}) went away during the run; what its tasks had done is in their "
        "transcripts (subagent runs, subagent show)"
    )
    assert answers(seen["after"]) == [("after", "completed", "served in the relay's own process")]
    # The killed server's bash children die with it (the tether), no sweep needed.
    assert all_dead([int((tmp_path / name).read_text()) for name in ("r.pid", "scout.pid")], within=10)
    killed = {t.label: (r, t) for r in list_runs(10) for t in r.tasks if t.label in ("r", "scout")}
    assert sorted(killed) == ["r", "scout"]
    for record, entry in killed.values():  # cut short, still readable: the task and its bash call
        log = read_transcript(load_run(record.run_id).transcript_path(entry))
        assert (log.meta["agent"], log.skipped, log.results) == ("scout", [], [])
        calls = [r["data"]["name"] for r in log.records if r.get("kind") == "tool_call"]
        assert calls == ["bash"]
        code, shown, _ = run_cli("show", record.run_id)
        assert (
            code == 0
            and "no saved conversation (the process ended before the task did); tool calls:\n  $ sleep 8 & " in shown
        )
