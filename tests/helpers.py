"""Small helpers the test modules share (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def call(name: str, **arguments: Any) -> dict[str, Any]:
    """A scripted-model reply that makes one tool call."""
    return {"tool_calls": [{"name": name, "arguments": arguments}]}


def alive(pid: int) -> bool:
    """Whether `pid` still runs; a zombie (killed, not yet reaped by init) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return not Path("/proc/self").exists()  # no procfs: trust kill(pid, 0)
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def all_dead(pids: list[int], within: float = 3.0) -> bool:
    """Whether every pid is gone, waiting up to `within` seconds for the kills to land."""
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def spawn_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`subagent ARGS` as a real process (this checkout on its path), stdout and stderr piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "mlx_subagents.cli", *args],
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **(env or {})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
