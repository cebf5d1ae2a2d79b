"""What a running process publishes for `subagent watch`: one small JSON file per process in
`$MLX_SUBAGENTS_HOME/live/`, its `Snapshot`.

A `Publisher` is an event sink of the process's runner: it keeps the tasks' state (`LiveTasks`) and
rewrites `live/<pid>.json` atomically (a temporary file renamed over it) at most every
`PUBLISH_EVERY_S` while events come, with the KV pools of the runner's hosts and the writer leases
read at that moment; it removes the file when the process ends. `read_snapshots` reads every file
and removes those of processes that are gone (killed: they could not remove their own). The same
`Snapshot` is what a server can publish for the processes it serves.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ValidationError

from ..errors import SubagentError
from ..events import Event
from ..home import state_home
from ..userfiles import read_text
from .live import LiveTasks, TaskNow

if TYPE_CHECKING:
    from ..host.protocol import ModelHost
    from .hosts import HostPool
    from .runner import Runner
    from .tasks import ModelRef

PUBLISH_EVERY_S = 0.25
LIVE_DIR = "live"


class TaskRow(BaseModel):
    """One task of a running process: who, where in the tree, what it does now, its counts so far."""

    label: str
    agent: str
    parent: str | None
    activity: str  # queued, waiting, model, prefilling, decoding, tool, working, done, failed, ...
    doing: str  # the activity in words: "prefilling 901 tokens", "running bash pytest -q"
    turn: int
    input_tokens: int
    output_tokens: int  # the reply decoding now included
    cached_tokens: int
    tps: float
    kv_bytes: int
    elapsed_s: float


class PoolRow(BaseModel):
    """One resident model's KV pool: what its sessions hold against its budget (None: unbounded)."""

    model: str
    kv_bytes: int
    budget: int | None


class LeaseRow(BaseModel):
    """One workspace's writer lease: the task holding it, and those waiting for it."""

    workspace: str
    holder: str | None
    waiting: list[str]


class Snapshot(BaseModel):
    """What one process is doing, as `subagent watch --json` prints it."""

    pid: int
    command: str
    cwd: str
    started: float
    updated: float
    tasks: list[TaskRow]
    pools: list[PoolRow]
    leases: list[LeaseRow]


def live_dir(home: Path | None = None) -> Path:
    return (home or state_home()) / LIVE_DIR


def task_row(task: TaskNow, now: float) -> TaskRow:
    return TaskRow(
        label=task.label,
        agent=task.agent,
        parent=task.parent,
        activity=task.activity,
        doing=task.describe(),
        turn=task.turn,
        input_tokens=task.input_tokens,
        output_tokens=task.tokens,
        cached_tokens=task.cached_tokens,
        tps=task.tps,
        kv_bytes=task.kv_bytes,
        elapsed_s=round(task.elapsed(now), 1),
    )


def hosts_pools(hosts: Mapping[ModelRef, ModelHost]) -> list[PoolRow]:
    """The KV pool of each resident model loaded (an engine's or a script's holds nothing here). A process
    that never imported the mlx host (an attached command, a scripted or engine model) has none of its
    hosts, and is not made to import mlx-lm (seconds of a CPU) to find that out."""
    mlx_host = sys.modules.get("mlx_subagents.host.mlx.mlx_host")
    if mlx_host is None:
        return []
    return [
        PoolRow(model=ref.model, kv_bytes=host.kv_bytes_total, budget=host.kv_budget)
        for ref, host in hosts.items()
        if isinstance(host, mlx_host.MlxModelHost)
    ]


def runner_leases(runner: Runner) -> list[LeaseRow]:
    """The writer leases someone holds or waits for."""
    slots = runner.current_slots
    if slots is None:
        return []
    return [
        LeaseRow(workspace=str(key), holder=lease.holder, waiting=list(lease.waiting))
        for key, lease in slots.writers.items()
        if lease.holder is not None or lease.waiting
    ]


class Publisher:
    """Publishes one process's snapshot while its tasks run; pass `handle` as an event sink.

    Args:
        runner: whose hosts and writer leases the snapshot reads (set before the first event).
        command: what the process runs (`run scout ...`), for the view.
        cwd: the workspace shown without a runner (a command attached to `subagent serve`, whose
            tasks run there and come back as events).
        pool: the hosts whose KV pools the snapshot shows without a runner (`subagent serve`'s, for
            the tasks of its MCP clients, which run in many runners over it).
    """

    def __init__(
        self,
        command: str,
        *,
        home: Path | None = None,
        tasks: LiveTasks | None = None,
        cwd: Path | None = None,
        pool: HostPool | None = None,
    ) -> None:
        self.command = command
        self.cwd = cwd
        self.pool = pool
        self.tasks = tasks or LiveTasks()
        self.runner: Runner | None = None
        self.path = live_dir(home) / f"{os.getpid()}.json"
        self.started = time.time()
        self._written = 0.0
        self._pending: asyncio.TimerHandle | None = None
        self._closed = False
        atexit.register(self.close)

    def handle(self, event: Event) -> None:
        self.tasks.handle(event)
        if self._closed:
            return
        wait = PUBLISH_EVERY_S - (time.monotonic() - self._written)
        if wait <= 0:
            self.write()
        elif self._pending is None:
            with contextlib.suppress(RuntimeError):  # no running loop: the next event writes
                self._pending = asyncio.get_running_loop().call_later(wait, self.write)

    def snapshot(self) -> Snapshot:
        now = time.time()
        runner = self.runner
        hosts = runner.preparer.hosts if runner is not None else self.pool.hosts if self.pool else {}
        return Snapshot(
            pid=os.getpid(),
            command=self.command,
            cwd=str(runner.cwd) if runner is not None else str(self.cwd or os.getcwd()),
            started=self.started,
            updated=now,
            tasks=[task_row(task, now) for task in self.tasks.running_trees()],
            pools=hosts_pools(hosts) if hosts else [],
            leases=runner_leases(runner) if runner is not None else [],
        )

    def write(self) -> None:
        """Rewrite the file now: a temporary file renamed over it, so a reader never sees half of one."""
        self._pending, self._written = None, time.monotonic()
        if self._closed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_name(f".{self.path.name}.tmp")
            # ASCII JSON: a label or a line of text with a lone surrogate is written as its escape
            temporary.write_text(json.dumps(self.snapshot().model_dump(mode="json")), encoding="ascii")
            os.replace(temporary, self.path)
        except OSError:  # a home that cannot be written: the run goes on unwatched
            self._closed = True

    def close(self) -> None:
        """Remove the file (at the process's end; a killed process's is swept by `read_snapshots`)."""
        self._closed = True
        if self._pending is not None:
            self._pending.cancel()
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)


def read_snapshots(home: Path | None = None) -> list[Snapshot]:
    """Every running process's snapshot, oldest process first; the files of processes that are gone
    (killed, crashed) are removed, and a file that is not a snapshot is skipped."""
    found = []
    folder = live_dir(home)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if not path.stem.isdigit():
            continue  # not a process's
        if not _alive(int(path.stem)):
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        try:  # through the guarded reader: a FIFO or a huge file named like a snapshot never blocks watch
            found.append(Snapshot.model_validate(json.loads(read_text(path, "live snapshot", SubagentError))))
        except (SubagentError, ValueError, ValidationError):
            continue  # being replaced, or not ours
    return sorted(found, key=lambda s: s.started)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not: it was killed and waits to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    stat = Path(f"/proc/{pid}/stat")
    if sys.platform.startswith("linux") and stat.exists():
        with contextlib.suppress(OSError, IndexError):
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True
