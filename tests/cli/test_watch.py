"""`subagent watch`: the snapshots running processes publish in the state folder, read by another one."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.home import state_home
from mlx_subagents.runs.published import Publisher, read_snapshots
from mlx_subagents.runs.slots import Slots
from tests.helpers import call, spawn_cli

# An orchestrator starts two scouts at once; each scout's answer takes a while, so both are seen running.
TREE = {
    "agents": {
        "orchestrator": {
            "replies": [
                call("subagent", tasks=[{"agent": "scout", "task": "map a"}, {"agent": "scout", "task": "map b"}]),
                "Both mapped.",
            ]
        },
        "scout": {
            "replies": [
                {**call("ls", path="."), "delay": 0.3},
                {"content": "Findings: x\n\nSummary: y", "delay": 0.3, "stall": 4},
            ]
        },
    }
}


def watch_json(run_cli: Any) -> list[dict[str, Any]]:
    code, out, err = run_cli("watch", "--json")
    assert code == 0, err
    return json.loads(out)["processes"]


def wait_for(run_cli: Any, ready: Any, timeout: float = 20) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        processes = watch_json(run_cli)
        if ready(processes):
            return processes
        time.sleep(0.1)
    raise AssertionError(f"watch never showed what was waited for; last: {processes}")


def _children_decoding(processes: list[dict[str, Any]]) -> bool:
    tasks = processes[0]["tasks"] if processes else []
    return len(tasks) == 3 and all(t["activity"] == "decoding" for t in tasks[1:])


@pytest.mark.slow
@pytest.mark.process
def test_watch_lists_a_running_parent_and_its_two_children_and_nothing_once_they_end(
    tmp_path: Path, write_script: Any, run_cli: Any
) -> None:
    process = spawn_cli("run", "orchestrator", "map both", "--model", write_script(TREE), "-C", str(tmp_path))
    try:
        processes = wait_for(run_cli, _children_decoding)
        assert [p["pid"] for p in processes] == [process.pid]
        assert processes[0]["command"].startswith("run orchestrator map both --model scripted:")
        rows = [(t["label"], t["parent"], t["activity"], t["doing"], t["turn"]) for t in processes[0]["tasks"]]
        assert rows == [
            ("orchestrator", None, "tool", "running subagent parallel: scout, scout", 1),
            ("orchestrator > scout#1", "orchestrator", "decoding", "decoding", 2),
            ("orchestrator > scout#2", "orchestrator", "decoding", "decoding", 2),
        ]
        assert all(t["input_tokens"] > 0 and t["elapsed_s"] > 0 for t in processes[0]["tasks"])
        code, text, _ = run_cli("watch", "--once")
        lines = [" ".join(line.split()) for line in text.splitlines()]
        # The prompt names the workspace (tmp_path), so its token count depends on the path's length.
        prompt = processes[0]["tasks"][1]["input_tokens"]
        assert prompt == processes[0]["tasks"][2]["input_tokens"] and prompt > 700
        assert code == 0 and lines[-2].startswith(f"scout#1 scout decoding 2 {prompt} 49 ")
        assert lines[-1].startswith(f"scout#2 scout decoding 2 {prompt} 49 ")
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
    assert watch_json(run_cli) == []
    assert list((state_home() / "live").glob("*.json")) == []  # the process removed its file


@pytest.mark.slow
@pytest.mark.process
def test_a_killed_process_file_is_swept(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    process = spawn_cli("run", "orchestrator", "map both", "--model", write_script(TREE), "-C", str(tmp_path))
    try:
        wait_for(run_cli, _children_decoding)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    finally:
        process.kill()
    published = state_home() / "live" / f"{process.pid}.json"
    assert published.is_file()  # a killed process cannot remove its own
    assert watch_json(run_cli) == []
    assert not published.exists()
    code, text, _ = run_cli("watch", "--once")
    assert code == 0 and text.strip() == "nothing is running (no process of this state folder has a task)"


def test_a_fifo_named_like_a_live_processs_snapshot_never_blocks_watch(run_cli: Any) -> None:
    live = state_home() / "live"
    live.mkdir(parents=True)
    os.mkfifo(live / f"{os.getpid()}.json")  # this process is alive: its "file" is read, not swept
    assert watch_json(run_cli) == []
    assert (live / f"{os.getpid()}.json").exists()


def test_the_writer_lease_names_its_holder_and_who_waits() -> None:
    async def main() -> list[tuple[Any, list[str]]]:
        slots, seen = Slots(4), []
        folder = Path("/tmp")

        async def writer(who: str, hold: asyncio.Event) -> None:
            async with slots.hold(folder, who=who):
                await hold.wait()

        first, second = asyncio.Event(), asyncio.Event()
        tasks = [asyncio.create_task(writer("a", first)), asyncio.create_task(writer("b", second))]
        await asyncio.sleep(0.01)
        lease = slots.writers[slots.lease_key(folder)]
        seen.append((lease.holder, list(lease.waiting)))
        first.set()
        await asyncio.sleep(0.01)
        seen.append((lease.holder, list(lease.waiting)))
        second.set()
        await asyncio.gather(*tasks)
        seen.append((lease.holder, list(lease.waiting)))
        return seen

    assert asyncio.run(main()) == [("a", ["b"]), ("b", []), (None, [])]


def test_a_publisher_replaces_its_file_whole_and_removes_it_at_the_end(tmp_path: Path) -> None:
    publisher = Publisher("run scout x", home=tmp_path)
    publisher.write()
    assert [s.command for s in read_snapshots(tmp_path)] == ["run scout x"]
    assert sorted(p.name for p in (tmp_path / "live").iterdir()) == [f"{os.getpid()}.json"]  # no temporary left
    (tmp_path / "live" / "notes.json").write_text("{}")  # not a process's: skipped, left alone
    (tmp_path / "live" / "999999999.json").write_text("{}")  # a process that is gone: swept
    assert len(read_snapshots(tmp_path)) == 1
    assert sorted(p.name for p in (tmp_path / "live").iterdir()) == [f"{os.getpid()}.json", "notes.json"]
    publisher.close()
    assert read_snapshots(tmp_path) == []


def test_the_snapshot_names_the_writer_holding_the_lease_and_the_one_waiting(
    tmp_path: Path, scripted_runner: Any
) -> None:
    """Two workers in one workspace take turns: while the first works, the snapshot says so."""
    from mlx_subagents.runs.published import runner_leases
    from mlx_subagents.runs.tasks import TaskSpec

    runner = scripted_runner({"agents": {"worker": {"replies": [{"content": "done", "delay": 0.5}]}}})
    seen: list[Any] = []

    async def main() -> Any:
        async with runner:
            work = asyncio.create_task(runner.parallel([TaskSpec("worker", "a"), TaskSpec("worker", "b")]))
            while not work.done() and not seen:
                await asyncio.sleep(0.02)
                seen.extend(lease for lease in runner_leases(runner) if lease.waiting)
            return await work

    outcome = asyncio.run(main())
    assert outcome.succeeded == 2
    assert [(lease.workspace, lease.holder, lease.waiting) for lease in seen] == [
        (str(tmp_path.resolve()), "worker-1", ["worker-2"])
    ]
