"""A foreground run: prepared tasks run as one saved run while their caller waits (the four modes, a
delegated call that waits for its children).

The run is recorded (`RunRecord`, one entry per task), its writers isolated in worktrees of its own
(`isolation.isolate`), each task made a handle (`Runner.handle`: a child under its id on its parent's
board), their generations run in their steps' order on the runner's slots (`Running`), and the record
finished however the run ends, a cancel from outside the runner included.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from ..results import Mode, MultiRunResult
from .delegated import Delegating
from .isolation import isolate
from .prepared import PreparedTask
from .running import Running
from .task import TaskHandle
from .tasks import Steps
from .transcripts import RunRecord, TaskEntry, new_run_id


class RunMaker(Protocol):
    """What a foreground run needs of the runner: how a prepared task becomes a handle (`Runner.handle`:
    its board, id, fork point, worktree, record and entry), what runs now, and whether and where runs
    are saved."""

    running: Running
    save_transcripts: bool
    home: Path | None

    def handle(self, prepared: PreparedTask, **how: Any) -> TaskHandle: ...


def new_record(mode: Mode, cwd: Path, prepared: Sequence[PreparedTask], folder: Path | None) -> RunRecord:
    """A new run's record in `folder` (default: the state folder's runs), one entry per task."""
    entries = [
        TaskEntry(index=i, label=p.label, agent=p.spec.name, step_id=p.task.step_id) for i, p in enumerate(prepared)
    ]
    return RunRecord.new(mode, cwd, entries, folder)


async def run_foreground(
    runner: RunMaker,
    mode: Mode,
    prepared: list[PreparedTask],
    *,
    concurrency: int,
    steps: Steps = Steps(),
    raise_errors: bool = False,
    under: Delegating | None = None,
) -> MultiRunResult:
    """Run prepared tasks in the foreground as one run: record it, isolate its writers, make the
    handles, run them (`steps` in their order), finish the record.

    Args:
        under: a delegated request's parent, board and fork point (default: top level, in the home).
    """
    under = under or Delegating()
    folder = under.folder or runner.home
    record = new_record(mode, prepared[0].workspace.root, prepared, folder) if runner.save_transcripts else None
    handles = _handles(runner, prepared, record, under)
    if under.on_handles is not None:
        under.on_handles(handles)
    plan = [h.generation(h.prepared.task.task, *steps.of(i), raise_errors=raise_errors) for i, h in enumerate(handles)]  # fmt: skip
    execution, stopped = runner.running.make(plan, concurrency), False
    try:
        await runner.running.finish(execution)
    except asyncio.CancelledError:
        stopped = True  # from outside the runner: an MCP client's cancel, the parent's turn stopped
        raise
    finally:
        results = [r for r in execution.results if r is not None]
        if record is not None:
            record.finish(results, interrupted=execution.cancelled or stopped)
    ids = [h.id if under.board is not None else None for h in handles]
    return MultiRunResult.of(mode, results, record.run_id if record else None, execution.cancelled, ids)


def _handles(
    runner: RunMaker, prepared: list[PreparedTask], record: RunRecord | None, under: Delegating
) -> list[TaskHandle]:
    """A foreground run's handles: each isolated task moved into a worktree of its own, each child
    under an id on its parent's board."""
    prepared, trees = isolate(prepared, record.run_id if record else new_run_id())
    ids = list(under.ids) if under.ids is not None else [None] * len(prepared)
    entries = record.tasks if record else [None] * len(prepared)
    return [
        runner.handle(p, board=under.board, task_id=i, fork_point=under.fork_point, worktree=w, record=record, entry=e)
        for p, i, w, e in zip(prepared, ids, trees, entries)
    ]
