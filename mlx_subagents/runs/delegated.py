"""A delegated request's run (a `subagent` call, MCP's `run_agents`): where it runs (`Delegating`: its
parent, the parent's board, the fork point), how a child that could not be set up is reported, and
what a cut answer of a child says to read the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import SubagentError
from ..events import Event, EventSink, TaskEndData
from ..results import MultiRunResult, RunResult
from ..tools.delegation import READ_MORE, ForkPoint
from .board import TaskBoard
from .prepared import Parent, SetUpFailure

if TYPE_CHECKING:
    from .task import TaskHandle


@dataclass(frozen=True)
class Delegating:
    """Where a delegated request runs: its parent (whose run folder holds the run), the parent's
    board (where the children are held under ids, `scout#1`), where the parent's forks start, and who
    is handed the children's handles as they start (`on_handles`)."""

    parent: Parent | None = None
    board: TaskBoard | None = None
    fork_point: ForkPoint | None = None
    ids: Sequence[str] | None = None  # the ids its tasks hold on `board` (`CallPlan.ids`)
    on_handles: Callable[[list[TaskHandle]], None] | None = None

    @property
    def folder(self) -> Path | None:
        """Where the run is saved: in its parent's run folder (None: the runner's home)."""
        return self.parent.run_folder if self.parent else None


def set_up_failed(failure: SetUpFailure, on_event: EventSink) -> RunResult:
    """A parallel child that could not be prepared: its failed result, reported like any end."""
    exc, task = failure.error, failure.task
    error = str(exc) if isinstance(exc, SubagentError) else f"{type(exc).__name__}: {exc}"
    data = TaskEndData(status="failed", stop_reason="error", error=error)
    on_event(Event(kind="task_end", label=task.label, agent=task.agent, data=data))
    return RunResult(agent=task.agent, task=task.task, model=failure.model, label=task.label, **data)  # type: ignore[arg-type]


def with_failures(outcome: MultiRunResult, failed: dict[int, RunResult], n_tasks: int) -> MultiRunResult:
    """A parallel call's outcome with its children that could not be set up (`failed`, by position)
    put back in their places among those that ran, counted in its totals."""
    ran = iter(outcome.results)
    ran_ids = iter(outcome.task_ids or [None] * (n_tasks - len(failed)))
    results = [failed[i] if i in failed else next(ran) for i in range(n_tasks)]
    ids = [None if i in failed else next(ran_ids) for i in range(n_tasks)]
    return outcome.model_copy(
        update={"results": results, "succeeded": sum(r.ok for r in results), "total": len(results), "task_ids": ids}
    )


def read_more_note(task_id: str) -> str:
    """How a parent agent reads the rest of a child's cut answer: with its tool, never from a path."""
    return READ_MORE.format(id=task_id)
