"""What a `run_agents` call answers: each task's outcome as text and as structured content, whole, or
the tasks that finished within the call budget and the ids of those still running."""

from __future__ import annotations

import mcp_types as types
from pydantic import BaseModel

from ..results import ChildrenUsage, MultiRunResult, RunResult, RunUsage, Status, StopReason
from ..runs.board import TaskBoard
from ..runs.task import TaskHandle
from ..tools.base import ToolResult
from ..tools.delegation import Delegation
from ..tools.subagent import fit_answers
from .budget import budget_text

FAILED_HINT = (
    "A task did not complete: its error says why. Read its transcript to see what it did, then retry with a "
    "narrower task (name the files and what to report), a higher limit, or do that part yourself."
)


class TaskOutcome(BaseModel):
    label: str
    agent: str
    status: Status
    stop_reason: StopReason
    error: str | None
    answer: str
    usage: RunUsage
    duration_s: float
    model: str
    transcript: str | None
    children: ChildrenUsage | None = None  # what its sub-agents used: the total and one entry per sub-agent


class RunOutcome(BaseModel):
    """`run_agents`'s structured content: every task in input order (those that finished, when the call
    budget ended first: `running` has the ids of the others, read with `agent_output`)."""

    mode: str
    ok: bool
    succeeded: int
    total: int
    run_id: str | None
    error: str | None
    tasks: list[TaskOutcome]
    running: list[str] = []


def run_result(call: Delegation, outcome: MultiRunResult, answer: ToolResult) -> types.CallToolResult:
    """The tool's formatted answer plus one status line per task, and the same as structured content."""
    tasks = _task_outcomes(outcome.results)
    structured = RunOutcome(
        mode=call.mode,
        ok=outcome.ok,
        succeeded=outcome.succeeded,
        total=outcome.total,
        run_id=outcome.run_id,
        error=outcome.error,
        tasks=tasks,
    )
    lines = [_status_line(t) for t in tasks]
    if not outcome.ok:
        lines.append(FAILED_HINT)
    text = f"{answer.output}\n\n---\n" + "\n".join(lines)
    return types.CallToolResult(
        content=[types.TextContent(text=text)],
        structured_content=structured.model_dump(mode="json"),
        is_error=answer.is_error,
    )


def budget_result(call: Delegation, handles: list[TaskHandle], board: TaskBoard, budget: float) -> types.CallToolResult:
    """A call whose budget ended first: the finished tasks whole; the others handed over to the server's
    board, under the ids the answer gives (agent_output reads them there)."""
    finished = [h for h in handles if h.result is not None and not h.alive]
    for handle in handles:
        if handle not in finished:
            handle.hand_over(board)
    running = [h.snapshot() for h in handles if h not in finished]
    done = [h.result for h in finished if h.result is not None]
    structured = RunOutcome(
        mode=call.mode,
        ok=False,
        succeeded=sum(r.ok for r in done),
        total=len(handles),
        run_id=next((h.run_id for h in handles if h.run_id), None),
        error=None,
        tasks=_task_outcomes(done),
        running=[s.id for s in running],
    )
    text = budget_text(done, running, budget, len(handles))
    lines = [_status_line(t) for t in structured.tasks]
    if lines:
        text += "\n\n---\n" + "\n".join(lines)
    failed = any(not r.ok for r in done)
    return types.CallToolResult(
        content=[types.TextContent(text=text)], structured_content=structured.model_dump(mode="json"), is_error=failed
    )


def _task_outcomes(results: list[RunResult]) -> list[TaskOutcome]:
    """Each task's outcome, the answers fitted together within the answer cap."""
    bodies = fit_answers([r.output for r in results], [r.transcript for r in results], "", [], 0)
    return [_task_outcome(r, body) for r, body in zip(results, bodies)]


def _task_outcome(result: RunResult, answer: str) -> TaskOutcome:
    """A task's outcome: its result's fields that `TaskOutcome` names, and the answer as it fits."""
    return TaskOutcome(**result.model_dump(include=set(TaskOutcome.model_fields) - {"answer"}), answer=answer)


def _status_line(task: TaskOutcome) -> str:
    u = task.usage
    status = task.status if task.status == "completed" else f"{task.status} ({task.stop_reason})"
    where = f"; transcript {task.transcript}" if task.transcript else ""
    children = ""
    if task.children is not None:
        c = task.children.usage
        children = f"; its {len(task.children.tasks)} sub-agent(s): {c.input_tokens:,} tokens read, {c.output_tokens:,} generated"
    return (
        f"[{task.label}] {task.agent}: {status} in {task.duration_s:.1f}s, {u.turns} turns, "
        f"{u.input_tokens:,} tokens read ({u.cached_tokens:,} cached), {u.output_tokens:,} generated{children}{where}"
    )
