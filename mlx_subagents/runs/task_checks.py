"""What a message to a task must pass before the task takes it (`TaskHandle.send`, `ask`): it says
something and fits the caps, the task was not cancelled, a running task's inbox has room, and an
ended one may be continued: it ran, its conversation is held, and a held task (a child) is within the
bounds it has across all its generations (their number, its turns, its time; a continuation gets no
fresh limits).
"""

from __future__ import annotations

from typing import Protocol

from ..agents.inbox import Inbox
from ..agents.session import AgentSession
from ..agents.spec import AgentSpec
from ..caps import MAX_GENERATIONS, MAX_QUEUED_MESSAGES, CapItem, check_request
from ..errors import RequestError, TaskStateError
from ..results import RunResult
from .prepared import PreparedTask
from .task_state import TaskState

CANCELLED = "cancelled"
NOT_HELD = "its conversation is not held here"


class CheckedTask(Protocol):
    """What the checks read of a task (a `TaskHandle`)."""

    id: str
    label: str
    spec: AgentSpec
    prepared: PreparedTask
    state: TaskState
    interactive: bool
    inbox: Inbox
    session: AgentSession | None
    result: RunResult | None
    cancel_reason: str | None
    released: str | None  # why its conversation is not held
    generations: int
    spent_s: float  # the time its generations took, against its timeout

    @property
    def alive(self) -> bool: ...

    @property
    def run_id(self) -> str | None: ...


def check_message(task: CheckedTask, message: str) -> None:
    """Refuse an empty message, or one over the request caps."""
    if not message.strip():
        raise RequestError(f"the message to task '{task.id}' is empty; say what it should do")
    check_request([CapItem(task.label, message, task.spec)])


def check_not_cancelled(task: CheckedTask) -> None:
    """Refuse a message to a cancelled task (or one whose run was aborted): it takes no more."""
    aborted = not task.alive and task.result is not None and task.result.status == "aborted"
    if task.cancel_reason is not None or aborted:
        why = task.cancel_reason or (task.result.error if task.result else None) or CANCELLED
        raise TaskStateError(
            f"task '{task.id}' was cancelled ({why}) and takes no more messages; "
            "its output so far can still be read, or start a new task"
        )


def check_inbox_room(task: CheckedTask) -> None:
    """Refuse a message to a running task that has not read its earlier ones yet, past the limit."""
    if task.inbox.count("task_send") >= MAX_QUEUED_MESSAGES:
        raise RequestError(
            f"task '{task.id}' already has {MAX_QUEUED_MESSAGES} messages waiting, the limit; wait until "
            "it has read them (task_output with wait) before sending more"
        )


def check_continuable(task: CheckedTask) -> None:
    """Refuse a new generation of an ended task that never ran, whose conversation is not held, or
    (a held task) that has used its bounds."""
    if task.result is not None and task.result.stop_reason == "skipped":
        raise TaskStateError(f"task '{task.id}' never ran ({task.result.error}); start a new task")
    if task.state in (TaskState.ENDED, TaskState.LET_GO):
        raise TaskStateError(
            f"task '{task.id}' ran in the foreground and {task.released or NOT_HELD}; its answer can be read, "
            f"`subagent resume {task.run_id}` continues it, or start a new task"
        )
    check_budget(task)


def check_budget(task: CheckedTask) -> None:
    """Refuse to continue a held task (a child) past its bounds: its generations, and the turns and
    time its limits give it across all of them."""
    if task.interactive:
        return  # a chat or `resume`: a person drives it, turn by turn
    why = None
    if task.generations >= MAX_GENERATIONS:
        why = f"has had {task.generations} generations, the limit of {MAX_GENERATIONS}"
    elif task.session is not None and task.session.usage.turns >= task.prepared.limits.max_turns:
        why = f"has used its {task.prepared.limits.max_turns} turns (max_turns) across its generations"
    elif (left := time_left(task)) is not None and left <= 0:
        why = f"has used its timeout of {task.prepared.timeout:g}s across its generations"
    if why is not None:
        raise TaskStateError(f"task '{task.id}' {why} and takes no more messages; start a new task")


def time_left(task: CheckedTask) -> float | None:
    """Seconds left of a held task's timeout across its generations (None: no timeout)."""
    timeout = task.prepared.timeout
    if timeout is None or task.interactive:
        return timeout
    return timeout - task.spent_s
