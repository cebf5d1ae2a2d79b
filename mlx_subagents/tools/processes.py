"""Every process a `bash` call started, found and killed, also the ones that left its process group.

Killing the call's process group is not enough: `setsid -f cmd`, `set -m; cmd &` or a program
calling `setsid()` moves a process to a group of its own, and once its parent exits it is no
longer a descendant either. What every such process keeps is its environment: each call runs
with `MLX_SUBAGENTS_CALL=<our pid>-<n>`, and a sweep (psutil, on Linux and macOS) kills every
process that carries the mark. A process that wipes its own environment (`env -i`) escapes the sweep,
unless the call is sandboxed: there every process lives in the sandbox's PID namespace, whose first
process is in the call's group, and the kernel kills them all when it dies (`sandbox.py`).
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import psutil

from . import tether

MARK_ENV = "MLX_SUBAGENTS_CALL"
MAX_SWEEPS = 20  # rounds of find-and-kill, for processes forking while they are being killed

_counter = itertools.count(1)
_live_groups: set[int] = set()


def tethered(args: Sequence[str]) -> tuple[list[str], int]:
    """`args` started under the tether (`tether.py`), and the descriptor the child must be given: the
    command dies with this process, however it dies."""
    fd = lifeline()
    return [sys.executable, "-I", "-S", "-c", _tether_code(), str(fd), tether.SEPARATOR, *args], fd


@functools.cache
def lifeline() -> int:
    """The read end of this process's lifeline: a pipe whose write end only this process holds, never
    closed, so that it reads end-of-file once this process is gone (either end closes on exec)."""
    read, _write = os.pipe()
    return read


@functools.cache
def _tether_code() -> str:
    return Path(tether.__file__).read_text(encoding="utf-8")


def new_mark() -> str:
    """A mark for one call, unique in this process: `<pid>-<n>`."""
    return f"{os.getpid()}-{next(_counter)}"


def track_group(pgid: int) -> None:
    _live_groups.add(pgid)


def kill_call(pgid: int, mark: str | None) -> None:
    """Kill the call's process group and every process that carries its mark (if it has one)."""
    _kill_group(pgid)
    _live_groups.discard(pgid)
    if mark is not None:
        sweep(mark)


def kill_all_processes() -> None:
    """Kill every process any call of this program started; safe to call from any thread."""
    for pgid in list(_live_groups):
        _kill_group(pgid)
    sweep(f"{os.getpid()}-", prefix=True)


def sweep(mark: str, *, prefix: bool = False) -> int:
    """SIGKILL every live process marked `mark` (or any mark starting with it); how many."""
    n_killed = 0
    for _ in range(MAX_SWEEPS):
        found = marked_processes(mark, prefix=prefix)
        if not found:
            break
        for proc in found:
            try:
                proc.send_signal(signal.SIGKILL)
                n_killed += 1
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
    return n_killed


def marked_processes(mark: str, *, prefix: bool = False) -> list[psutil.Process]:
    """Live processes (zombies are dead) whose environment carries the mark."""
    found = []
    for proc in psutil.process_iter(["environ", "status"]):
        env = proc.info["environ"] or {}  # None: another user's process, not readable
        value = env.get(MARK_ENV)
        if value is None or proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if value == mark or (prefix and value.startswith(mark)):
            found.append(proc)
    return found


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone
