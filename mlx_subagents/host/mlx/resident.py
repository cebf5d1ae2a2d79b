"""The models resident on this machine, across processes: one file per loaded model under the state folder.

Without a server every `subagent` process that loads a model sizes its KV budget from the RAM it
sees, as if it were alone: two of them promise the KV caches more memory than the machine has. So
each resident mlx host registers itself (`$MLX_SUBAGENTS_HOME/resident/PID-N.json`: pid, model,
weights bytes, KV budget), and a new host's default budget is taken from what RAM minus the others'
weights and budgets leaves (`free_memory`). The reading and the registering happen under one lock
(`reserve`), so two processes starting at once never both take the same memory. An entry whose
process has ended (or whose pid now belongs to another process) is swept when the folder is read.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from ...errors import SubagentError
from ...home import state_home, write_whole
from ...userfiles import read_text

RESIDENT_DIR = "resident"
_serial = itertools.count(1)


@dataclass(frozen=True)
class Resident:
    """One model held by one process."""

    pid: int
    model: str
    weights_bytes: int
    kv_budget: int  # bytes its KV pool may use (0: unbounded, nothing reserved)
    started: float  # its process's start time: a reused pid is another process

    @property
    def held(self) -> int:
        return self.weights_bytes + self.kv_budget


def resident_dir(home: Path | None = None) -> Path:
    return (home or state_home()) / RESIDENT_DIR


def _started(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def residents(home: Path | None = None) -> list[Resident]:
    """Every model registered on this machine by a process still alive; dead entries are removed."""
    folder = resident_dir(home)
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            entry = Resident(**json.loads(read_text(path, "resident model entry", SubagentError)))
        except (SubagentError, ValueError, TypeError):  # a FIFO, a huge or damaged file: swept like a dead one
            entry = None
        started = _started(entry.pid) if entry is not None else None
        if entry is None or started is None or abs(started - entry.started) > 1.0:
            path.unlink(missing_ok=True)
            continue
        found.append(entry)
    return found


def others(home: Path | None = None) -> list[Resident]:
    """The models other processes hold."""
    return [r for r in residents(home) if r.pid != os.getpid()]


def free_memory(ram: int, home: Path | None = None) -> int:
    """What `ram` bytes leave once the other processes' weights and KV budgets are taken out."""
    return max(0, ram - sum(r.held for r in others(home)))


@contextmanager
def locked(home: Path | None = None) -> Iterator[Path]:
    """The registry's folder, held exclusively while the block reads and writes it."""
    folder = resident_dir(home)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield folder
    finally:
        os.close(fd)


class Registration:
    """One host's entry: made by `reserve`, changed by `update`, removed by `remove`."""

    def __init__(self, path: Path, entry: Resident) -> None:
        self.path = path
        self.entry = entry

    def update(self, kv_budget: int | None) -> None:
        self.entry = Resident(**{**asdict(self.entry), "kv_budget": kv_budget or 0})
        _write(self.path, self.entry)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def reserve(
    model: str, weights_bytes: int, ram: int, budget: Callable[[int], int | None]
) -> tuple[int | None, Registration | None]:
    """Decide a host's KV budget from the memory the others leave of `ram` (`budget(free_ram)`) and
    register it, under the lock; the budget and the registration (None when the state folder cannot
    hold it: the budget is still decided, from all of the RAM)."""
    try:
        with locked() as folder:
            chosen = budget(free_memory(ram))
            entry = Resident(os.getpid(), model, weights_bytes, chosen or 0, _started(os.getpid()) or time.time())
            path = folder / f"{os.getpid()}-{next(_serial)}.json"
            _write(path, entry)
            return chosen, Registration(path, entry)
    except OSError:
        return budget(ram), None


def _write(path: Path, entry: Resident) -> None:
    write_whole(path, json.dumps(asdict(entry)))
