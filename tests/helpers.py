"""Small helpers the test modules share (fixtures live in conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


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
