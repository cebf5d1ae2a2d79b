"""Every process a `bash` call started, found and killed, also the ones that left its process group.

Killing the call's process group is not enough: `setsid -f cmd`, `set -m; cmd &` or a program
calling `setsid()` moves a process to a group of its own, and once its parent exits it is no
longer a descendant either. What every such process keeps is its environment: each call runs
with `MLX_SUBAGENTS_CALL=<our pid>-<n>`, and a sweep (psutil, on Linux and macOS) kills every
process that carries the mark. A process that wipes its own environment (`env -i`) escapes the sweep;
on Linux the call's tether, a child subreaper, kills it (every descendant) when the call ends and when
asked before the group kill (`ask_tethers`); elsewhere (macOS) only a sandboxed call catches it: there
every process lives in the sandbox's PID namespace, whose first process is in the call's group, and the
kernel kills them all when it dies (`sandbox.py`).
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from . import tether

MARK_ENV = "MLX_SUBAGENTS_CALL"
MAX_SWEEPS = 20  # rounds of find-and-kill, for processes forking while they are being killed
TETHER_WAIT_S = 2.0  # the longest a kill waits for the calls' tethers to kill their descendants

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
    """Kill the call's process group and every process that carries its mark (if it has one). It blocks
    (the tether's answer, up to `TETHER_WAIT_S`, and the sweep): a call is killed in a thread of its own
    (`command.Spawned.kill`), never on the event loop, which every other session's tools share."""
    ask_tethers([pgid])
    _kill_group(pgid)
    _live_groups.discard(pgid)
    if mark is not None:
        sweep(mark)


def kill_all_processes() -> None:
    """Kill every process any call of this program started; safe to call from any thread. It blocks as
    `kill_call` does: it is called as the program stops (Ctrl-C, SIGTERM, SIGHUP), before it exits."""
    ask_tethers(list(_live_groups))
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


def ask_tethers(pids: Sequence[int]) -> None:
    """On Linux, ask each call's tether (its group's leader, our child) to kill every process that
    descends from it, and wait until they have (at most `TETHER_WAIT_S`): the group kill alone would
    kill the tether first, and an orphan that left the group and wiped its mark would live on."""
    if sys.platform != "linux":
        return
    asked = [pid for pid in pids if _running_child(pid) and _signal(pid, tether.SWEEP_SIGNAL)]
    deadline = time.monotonic() + TETHER_WAIT_S
    while asked and time.monotonic() < deadline:
        asked = [pid for pid in asked if _running_child(pid)]
        time.sleep(0.005)


def _running_child(pid: int) -> bool:
    """Whether `pid` is a child of ours that has not ended (an ended one, reaped or not, cannot be asked,
    and a reaped one's pid may be another process's)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


def _signal(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
    except OSError:
        return False
    return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone
