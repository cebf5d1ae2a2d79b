"""The machine's resident models across processes: one KV budget for the machine without a server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_subagents.cli.doctor import resident_lines
from mlx_subagents.host.kv.budget import default_kv_budget, total_memory
from mlx_subagents.host.mlx.resident import Resident, free_memory, resident_dir, residents
from tests.helpers import REPO

# A process holding the tiny model with its default budget until its stdin closes.
HOLD = """
import asyncio, json, sys
from mlx_subagents.host import MlxModelHost

async def main():
    async with MlxModelHost(sys.argv[1]) as host:
        print(json.dumps({"budget": host.kv_budget, "weights": host.weights_bytes()}), flush=True)
        await asyncio.to_thread(sys.stdin.read)

asyncio.run(main())
"""


def hold(model: Path) -> tuple[subprocess.Popen[str], dict[str, int]]:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(model)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return process, json.loads(process.stdout.readline())  # type: ignore[union-attr]


@pytest.mark.process
def test_entries_of_ended_processes_and_reused_pids_are_swept() -> None:
    folder = resident_dir()
    folder.mkdir(parents=True)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    entries = {
        "ended.json": Resident(int(ended.stdout), "m", 10, 20, 1.0),
        "reused.json": Resident(os.getppid(), "m", 10, 20, 1.0),  # alive, but started at another time
        "torn.json": None,
    }
    for name, entry in entries.items():
        (folder / name).write_text(json.dumps(entry.__dict__) if entry else '{"pid": ')
    os.mkfifo(folder / "fifo.json")  # read through the guarded reader: swept, never waited on
    assert residents() == [] and sorted(p.name for p in folder.iterdir()) == []
    assert free_memory(1000) == 1000


@pytest.mark.slow
@pytest.mark.process
def test_standalone_processes_default_budgets_add_up_to_at_most_the_machine(tiny_qwen3_path: Path) -> None:
    ram = total_memory()
    first, one = hold(tiny_qwen3_path)
    second, two = hold(tiny_qwen3_path)
    try:
        assert one["budget"] == default_kv_budget(ram, one["weights"])
        assert two["budget"] == default_kv_budget(ram - one["weights"] - one["budget"], two["weights"])
        assert one["weights"] + one["budget"] + two["weights"] + two["budget"] <= ram
        found = {r.pid: (r.model, r.weights_bytes, r.kv_budget) for r in residents()}
        assert found == {
            first.pid: (str(tiny_qwen3_path), one["weights"], one["budget"]),
            second.pid: (str(tiny_qwen3_path), two["weights"], two["budget"]),
        }
        lines = resident_lines()
        assert f"resident  pid {first.pid}: {tiny_qwen3_path}, weights 0.0 GiB, KV budget" in "\n".join(lines)
        assert free_memory(ram) == ram - sum(
            w + b for w, b in ((one["weights"], one["budget"]), (two["weights"], two["budget"]))
        )
        second.send_signal(signal.SIGKILL)  # no time to unregister: swept as dead
        second.wait()
        first.stdin.close()  # type: ignore[union-attr]
        assert first.wait(30) == 0
        assert residents() == [] and list(resident_dir().glob("*.json")) == []
    finally:
        for process in (first, second):
            if process.poll() is None:
                process.kill()
                process.wait()
