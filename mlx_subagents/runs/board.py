"""`TaskBoard`: the tasks one parent started, by short ids, and the notices of their ends: the one
task registry, for its sub-agents and its background commands alike.

One board per parent: an agent session (its `subagent` tool's children and its `bash` calls with
`"background": true`), a chat (`handle.board` of the chat's task), an MCP server, or the runner
itself (`runner.board`, for `runner.start`). Ids are short and predictable so that a person, a test
script and a model can all name a task: `scout#1`, `scout#2`, `bash#1`, ... in start order (numbered
per agent; a command's are `bash#N`), or the label given at the start. At most `MAX_ALIVE` tasks,
sub-agents and commands together, are queued or running per board; the process-wide slots still
bound how many agents run.

When a background call has ended, the board tells its parent: one notice with the call's answers
(as the call would have returned them had it waited, capped alike) goes into the parent session's
inbox (read before its next turn), an event `task_notice` goes to the runner's sink (through the parent
session, so it is in the parent's transcript too). A call of several tasks is one notice when its last
task ends (`watch`), unless it asked for one per end (`notify: each`); a continued task's generation is
a notice of its own, and so is a background command's end. The `on_notice` callback gets each task's
status as it ends.

The board also answers the model-facing tools (`tools/background.py`): it is their `TaskControl`.
It holds tasks as `BoardTask`s (what a `TaskHandle` is to it), and knows no runner: who starts
tasks on it (the runner, binding its tools) adds them here.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..agents.inbox import Delivery, Inbox
from ..caps import MAX_CHILD_MESSAGES, MAX_TASKS
from ..errors import RequestError, TaskNotFoundError, TaskStateError
from ..events import ChildMessageData, Event, EventData, EventKind, EventSink, TaskNoticeData
from ..home import file_name
from ..results import ChildrenUsage, ChildUsage, LiveStatus, RunResult, RunUsage, StopReason, TaskStatus
from ..tools import Workspace
from ..tools.background_bash import COMMAND_AGENT, CommandLog, CommandTask
from ..tools.delegation import Delegation
from ..tools.subagent import format_notice
from .prepared import Parent
from .slots import lend
from .tasks import TaskSpec, check_label

MAX_ALIVE = MAX_TASKS
# Finished foreground children whose conversations a board holds for `task_send`; beyond it the
# oldest are let go, so that held KV caches stay within what the pool is sized for.
MAX_HELD = MAX_TASKS
LET_GO = (
    f"its conversation was let go to make room (a parent holds the conversations of its last {MAX_HELD} "
    "foreground children)"
)
NoticeCallback = Callable[[TaskStatus], None]
# A task's notice when no call is watched for it (one task, `notify: each`, a continued task).
SINGLE = Delegation("single", (), Workspace(Path(".")))
# What a notice says of an answer the parent already read with task_output.
READ = "(already read with task_output)"


@dataclass(frozen=True)
class Watched:
    """A background call whose notice waits until its last task has ended."""

    call: Delegation
    ids: tuple[str, ...]


class BoardTask(Protocol):
    """A task as its board holds it: a `TaskHandle` (a sub-agent) or a `CommandTask` (a command)."""

    id: str
    label: str
    result: RunResult | None  # None for a command: it has no agent run
    cancel_reason: str | None
    background: bool  # started in the background (a foreground child is held here too)

    @property
    def status(self) -> LiveStatus: ...
    @property
    def alive(self) -> bool: ...
    @property
    def run_id(self) -> str | None: ...

    def snapshot(self) -> TaskStatus: ...
    def full_output(self) -> str: ...
    def cancel(self, reason: str | None = None, stop_reason: StopReason = "cancelled") -> bool: ...
    def send(self, message: str) -> None: ...
    async def wait(self, timeout: float | None = None) -> RunResult | None: ...
    async def join(self) -> None: ...
    @property
    def held(self) -> bool: ...
    async def let_go(self, reason: str) -> None: ...


class TaskBoard:
    """The tasks one parent started. Create inside the event loop that runs them.

    Args:
        on_event: where a notice's event goes when no parent session reports it.
        parent: the agent session whose children these are (None: top-level tasks); set when known.
        inbox: the parent session's inbox, for notices (None: no session reads them).
        on_notice: called with a task's status when it ends in the background or sends its parent a message.
    """

    def __init__(
        self,
        workspace: Workspace,
        *,
        on_event: EventSink,
        parent: Parent | None = None,
        inbox: Inbox | None = None,
        on_notice: NoticeCallback | None = None,
    ) -> None:
        self.workspace = workspace
        self.on_event = on_event
        self.parent = parent
        self.inbox = inbox
        self.on_notice = on_notice
        self._handles: dict[str, BoardTask] = {}
        self._n_started: Counter[str] = Counter()
        self._pending: set[str] = set()  # ids reserved by starts not finished yet
        self._changed = asyncio.Event()
        self._scratch: tempfile.TemporaryDirectory[str] | None = None  # commands' logs when nothing is saved
        self._calls: list[Watched] = []  # background calls whose notice waits for their last task
        self._read: dict[str, RunResult] = {}  # the results the parent read with task_output, by task id

    # -- the API ----------------------------------------------------------------------------------------

    def get(self, task_id: str) -> BoardTask:
        """The task with this id; an unknown id raises `TaskNotFoundError` listing the known ones."""
        handle = self._handles.get(task_id.strip())
        if handle is None:
            known = ", ".join(self._handles) or "none yet"
            raise TaskNotFoundError(f"no task '{task_id}' here; the tasks started here are: {known}")
        return handle

    def tasks(self) -> list[BoardTask]:
        """Every task started on this board, in start order."""
        return list(self._handles.values())

    def alive(self) -> list[BoardTask]:
        """The background tasks queued or running, commands too: what the cap counts (a foreground
        child runs while its parent waits for it anyway)."""
        return [h for h in self._handles.values() if h.alive and h.background]

    def alive_agents(self) -> list[BoardTask]:
        """The background sub-agents queued or running: what a final answer waits for. A command is
        not waited for: it is the agent's own, killed when the agent ends (a dev server never would)."""
        return [h for h in self.alive() if not isinstance(h, CommandTask)]

    def children_usage(self, tasks: Sequence[BoardTask] | None = None) -> ChildrenUsage | None:
        """What `tasks` (default: every task on this board) used, theirs included: the parent's
        `children`; None when none ran."""
        entries: list[ChildUsage] = []
        for result in (h.result for h in (self.tasks() if tasks is None else tasks) if h.result is not None):
            entries.append(ChildUsage(label=result.label, agent=result.agent, status=result.status, usage=result.usage))
            entries += result.children.tasks if result.children else []
        if not entries:
            return None
        total = RunUsage()
        for entry in entries:
            total = total.add(entry.usage)
        return ChildrenUsage(usage=total, tasks=entries)

    def cancel_all(self, reason: str | None = None, stop_reason: StopReason = "cancelled") -> list[BoardTask]:
        """Cancel every queued or running task; the ones cancelled (`timeout`: their parent's time ran out)."""
        return [h for h in self.tasks() if h.alive and h.cancel(reason, stop_reason)]

    def stop(self, task_id: str, reason: str) -> BoardTask:
        """Cancel one task for a person or a client (`/cancel`, MCP `cancel_agent`); it, being cancelled.

        Raises `TaskNotFoundError` (listing the ids) or `TaskStateError` (it is not running)."""
        handle = self.get(task_id)
        if not handle.cancel(reason):
            raise TaskStateError(f"task '{handle.id}' is not running (it {handle.status}); nothing to cancel")
        return handle

    async def close(self, reason: str | None = None) -> None:
        """Cancel what still runs, wait until every task has saved its transcript, and let the held
        conversations go (their parent ended)."""
        self.cancel_all(reason)
        for handle in self.tasks():
            await handle.join()
        for handle in self.tasks():
            if handle.held:
                await handle.let_go(f"its conversation was let go when {reason or 'its parent ended'}")

    async def let_go_oldest(self) -> None:
        """Let go of the oldest held conversations beyond `MAX_HELD`."""
        held = [h for h in self.tasks() if h.held]
        for handle in held[: max(0, len(held) - MAX_HELD)]:
            await handle.let_go(LET_GO)

    # -- ids and the cap (for the runner's starts) -----------------------------------------------------------
    # Ids are reserved as they are planned: starts that overlap (two `subagent` calls in one reply) never
    # share an id or pass the cap together; a start that fails gives its reservations back (`release`).

    def plan_ids(self, tasks: list[TaskSpec]) -> list[str]:
        """Reserve ids for these new background tasks, in order; refuses a request over the cap or a taken label."""
        self.check_room(len(tasks))
        for t in tasks:
            check_label(t.label)
        return self.reserve_ids(["fork" if t.fork else t.agent for t in tasks], [t.label for t in tasks])

    def reserve_ids(self, agents: list[str], labels: list[str] | None = None) -> list[str]:
        """Reserve an id per task: its label, else `agent#N`. Foreground children reserve theirs too (no cap:
        they are not alive here) and are kept here once they end."""
        ids: list[str] = []
        for agent, label in zip(agents, labels or [""] * len(agents)):
            task_id = label.strip()
            if not task_id:
                while True:
                    self._n_started[agent] += 1
                    task_id = f"{agent}#{self._n_started[agent]}"
                    if not self._taken(task_id):
                        break
            elif self._taken(task_id) or task_id in ids:
                self.release(ids)
                raise RequestError(f"a task named '{task_id}' was already started here; give the new one another label")
            self._pending.add(task_id)
            ids.append(task_id)
        return ids

    def release(self, ids: Sequence[str]) -> None:
        """Give back reserved ids that were not used (a start that failed its checks); an id in use stays."""
        for task_id in reversed(ids):
            if task_id not in self._pending:
                continue
            self._pending.discard(task_id)
            agent, _, n = task_id.rpartition("#")
            if n.isdigit() and self._n_started[agent] == int(n):
                self._n_started[agent] -= 1

    def _taken(self, task_id: str) -> bool:
        return task_id in self._handles or task_id in self._pending

    def check_room(self, n_new: int = 1) -> None:
        alive = [h.id for h in self.alive()] + sorted(self._pending)
        if len(alive) + n_new > MAX_ALIVE:
            raise RequestError(
                f"{len(alive)} background tasks are alive here ({', '.join(alive)}) and the limit is "
                f"{MAX_ALIVE}; wait for one to end (task_output with wait) or cancel one (task_cancel)"
            )

    def add(self, handle: BoardTask) -> None:
        """Hold a task under its reserved id."""
        self._pending.discard(handle.id)
        self._handles[handle.id] = handle

    # -- background commands ----------------------------------------------------------------------------

    async def start_command(self, args: Sequence[str], *, command: str, cwd: Path, timeout: float) -> str:
        """Start a background command (`bash#N`) on this board and hold it; its id. Refused, in one line,
        when the board already has `MAX_ALIVE` live tasks."""
        self.check_room()
        [task_id] = self.reserve_ids([COMMAND_AGENT])
        try:
            log = CommandLog(self._commands_folder() / f"{file_name(task_id)}.log")
            task = CommandTask(task_id, command, cwd=cwd, timeout=timeout, log=log, on_end=self.ended)
            await task.start(args)
        except BaseException:
            self.release([task_id])
            raise
        self.add(task)
        return task_id

    def _commands_folder(self) -> Path:
        """Where commands' output is kept: the parent's run folder (`commands/`), else a temporary folder
        that goes with the board (nothing is saved)."""
        if self.parent is not None and self.parent.run_folder is not None:
            return self.parent.run_folder / "commands"
        if self._scratch is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="mlx-subagents-commands-")
        return Path(self._scratch.name)

    # -- notices ----------------------------------------------------------------------------------------

    def watch(self, call: Delegation, ids: Sequence[str]) -> None:
        """Hold back the notices of a background call's tasks until the last has ended, then give one
        for them all (a call of one task, or one that asked for `notify: each`, gives one per end)."""
        if len(ids) > 1 and call.notify != "each":
            self._calls.append(Watched(call, tuple(ids)))

    def ended(self, handle: BoardTask) -> None:
        """A background generation of `handle` (or a background command) ended: the notice it completes
        (its own, or its call's once the call's last task has ended), event, callback."""
        snapshot = handle.snapshot()
        if snapshot.kind == "command":
            self._command_notice(handle, snapshot)
        else:
            watched = next((w for w in self._calls if handle.id in w.ids), None)
            if watched is None:
                self._notice(SINGLE, [handle], handle.cancel_reason is None)
            elif not any(self._handles[i].alive for i in watched.ids):
                self._calls.remove(watched)
                tasks = [self._handles[i] for i in watched.ids]
                self._notice(watched.call, tasks, any(t.cancel_reason is None for t in tasks))
        if self.on_notice is not None:
            self.on_notice(snapshot)
        self._changed.set()

    def _notice(self, call: Delegation, tasks: Sequence[BoardTask], deliver: bool) -> None:
        """The notice of `tasks` (a call's, or one task's): their answers as the call would have returned
        them; an answer the parent already read with task_output is not repeated, and nothing is said
        when it read them all (nor to whoever cancelled them: `deliver` false)."""
        results = [t.result for t in tasks if t.result is not None]
        read = [self._read.get(t.id) is t.result for t in tasks]
        if len(results) < len(tasks) or all(read):
            return
        results = [r.model_copy(update={"output": READ}) if was else r for r, was in zip(results, read)]
        text, line = format_notice(call, [t.id for t in tasks], results)
        statuses = {r.status for r in results}
        status = statuses.pop() if len(statuses) == 1 else "failed"
        run_id = tasks[0].run_id if len(tasks) == 1 else None
        data = TaskNoticeData(
            id=", ".join(t.id for t in tasks), status=status, first_line=line, text=text, run_id=run_id
        )
        self._tell(data, deliver, tasks[0])

    def _command_notice(self, handle: BoardTask, snapshot: TaskStatus) -> None:
        """A background command's notice: its last line says how it went ("5 passed in 0.3s")."""
        line = snapshot.output or "(no output)"
        line = f"{line} ({snapshot.error})" if snapshot.error else line
        text = f"{handle.id} {snapshot.status}: {line}; read it with task_output"
        data = TaskNoticeData(id=handle.id, status=snapshot.status, first_line=line, text=text, run_id=None)
        self._tell(data, handle.cancel_reason is None, handle)

    def _tell(self, data: TaskNoticeData, deliver: bool, task: BoardTask) -> None:
        """A notice into the parent's inbox (keyed by its task ids: reading one task's output drops its
        own), and its event."""
        if self.inbox is not None and deliver:  # a cancel needs no notice to who cancelled
            self.inbox.put(Delivery("task_notice", f"[notice] {data['text']}", key=data["id"]))
        self._report("task_notice", data, task)

    def _report(self, kind: EventKind, data: EventData, task: BoardTask) -> None:
        """An event as the parent's (into its transcript), or a top-level task's own (`task`'s) when no
        parent session reads this board."""
        if self.inbox is not None and self.inbox.report is not None:
            self.inbox.report(kind, data)
        else:
            label = self.parent.label if self.parent else task.label
            agent = self.parent.spec.name if self.parent else task.snapshot().agent
            self.on_event(Event(kind=kind, label=label, agent=agent, data=data))

    # -- a child's messages -------------------------------------------------------------------------------

    def message(self, task_id: str, text: str) -> str:
        """A child's message to its parent (`parent_send`): in the parent's inbox for its next turn (a parent
        waiting on its final answer takes a turn for it), its event as the parent's. At most
        `MAX_CHILD_MESSAGES` of one child's wait unread; beyond that, `RequestError`."""
        task = self.get(task_id)
        if self.inbox is None:
            raise TaskStateError("nobody reads your messages here; put what you found in your final answer")
        if self.inbox.count("child_message", task_id) >= MAX_CHILD_MESSAGES:
            raise RequestError(
                f"{MAX_CHILD_MESSAGES} of your messages wait unread by your parent, the limit; carry on with "
                "your task and put the rest in your final answer"
            )
        self.inbox.put(Delivery("child_message", f"[message from {task_id}] {text}", key=task_id))
        self._report("child_message", ChildMessageData(id=task_id, message=text), task)
        if self.on_notice is not None:  # a chat's parent waiting for the person wakes to it
            self.on_notice(task.snapshot())
        self._changed.set()
        return "Sent: your parent reads it at its next turn; an answer from it reaches you before your next step."

    async def drain(self) -> None:
        """For a parent's final answer with no turn left to read a notice in: wait (lending the parent's
        slot) until its background children have all ended, so that none is cut short by its end."""
        if not self.alive_agents():
            return
        async with lend():
            while self.alive_agents():
                self._changed.clear()
                await self._changed.wait()

    async def settle(self) -> bool:
        """For a parent's final answer: while children run and no message is pending, wait (lending the
        parent's slot) for one to end; whether a message is now pending."""
        pending = lambda: self.inbox is not None and self.inbox.pending()  # noqa: E731
        if not self.alive_agents() or pending():
            return pending()  # nothing to wait for: the slot is kept (lending it means queueing again)
        async with lend():
            while self.alive_agents() and not pending():
                self._changed.clear()
                await self._changed.wait()
        return pending()

    # -- the model-facing tools (`TaskControl`) -----------------------

    def statuses(self, task_id: str | None = None) -> list[TaskStatus]:
        return [self.get(task_id).snapshot()] if task_id else [h.snapshot() for h in self.tasks()]

    async def output(self, task_id: str, wait: float) -> tuple[TaskStatus, str]:
        """A task's status and whole answer (or partial output), after waiting up to `wait` seconds for
        it to end; the parent's slot is lent while it waits."""
        handle = self.get(task_id)
        if wait > 0 and handle.alive:
            async with lend():
                await handle.wait(wait)
        if not handle.alive and handle.result is not None:
            self._read[handle.id] = handle.result  # read now: a notice would say nothing new
            if self.inbox is not None:
                self.inbox.discard(handle.id)
        return handle.snapshot(), handle.full_output()

    def send(self, task_id: str, message: str) -> str:
        """Steer a running task or continue a finished one; what happens, in words."""
        handle = self.get(task_id)
        running = handle.alive
        handle.send(message)
        if running:
            return f"{handle.id} gets the message at its next turn"
        return f"{handle.id} had ended: it continues its conversation with the message, in the background"

    def cancel(self, task_id: str) -> TaskStatus:
        handle = self.get(task_id)
        if handle.cancel_reason is not None:
            raise TaskStateError(
                f"task '{handle.id}' is already cancelled ({handle.cancel_reason}); task_output shows what it had done"
            )
        if not handle.cancel("cancelled by its parent"):
            raise TaskStateError(f"task '{handle.id}' has already ended ({handle.status}); nothing to cancel")
        return handle.snapshot()
