"""`TaskHandle`: one task you hold: start it, watch it, steer it, stop it, continue it.

A handle keeps one `AgentSession` for its life, so its host session and KV cache are reused
generation after generation. Each generation (the task's first message, a message sent to it after
it ended, a chat turn) runs through an `Execution` like any other task (limits, timeout, the
process-wide slots, Ctrl-C, the transcript and the task's events). Two ways to drive a handle:

- `await handle.ask(message)`: one generation, awaited (a chat turn, `subagent resume`);
- `handle.send(message)`: returns at once. A task that is running gets the message at its next turn
  boundary (its inbox; never inside a tool call); a finished one takes it as a new generation in
  the background. `Runner.start` launches a task's first generation this way.

`status`, `snapshot()`, `wait()` and `cancel()` work either way. The task's own background
children are on `handle.board`. `Runner.start`, `Runner.open_task` and `Runner.reopen` make handles.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from ..agents.compaction import CompactionSettings
from ..agents.inbox import Delivery, Inbox
from ..agents.session import AgentSession, system_prompt
from ..caps import MAX_GENERATIONS, MAX_QUEUED_MESSAGES, CapItem, check_request
from ..errors import RequestError, TaskStateError
from ..events import Event, EventKind, EventSink
from ..host.protocol import Message, TextCallback
from ..results import RunResult, RunUsage, TaskState, TaskStatus
from ..tools import Tool, Workspace
from ..tools.subagent import ForkPoint
from .board import TaskBoard
from .execution import Execution, PlannedTask
from .prepare import Parent, PreparedTask
from .slots import Slots
from .transcripts import RunRecord, RunRecorder, TaskEntry, TaskTranscript
from .worktrees import Worktree, finish_worktree, reopen_worktree, worktree_result

INTERRUPTED_TOOL_RESULT = "Error: this tool call was interrupted before it finished."
CANCELLED = "cancelled"


class TaskRuntime(Protocol):
    """What a handle needs of the runner that made it: where events go, how sessions run and are
    saved, the process-wide slots, and the delegation tools of a parent."""

    on_event: EventSink
    compaction: CompactionSettings
    save_transcripts: bool
    home: Path | None

    @property
    def slots(self) -> Slots: ...

    async def track(self, execution: Execution, *, background: bool = False) -> list[RunResult]: ...

    def claim_session_name(self, base: str) -> str: ...

    def release_session_name(self, name: str) -> None: ...

    def delegation_tools(
        self, parent: Parent, workspace: Workspace, board: TaskBoard | None = None, *, forked: bool = False
    ) -> dict[str, Tool]: ...


class TaskHandle:
    """One task, held for its life; create with `Runner.start`, `Runner.open_task` or `Runner.reopen`.

    Args:
        runtime: the runner that prepared the task.
        prepared: the task, checked and its model loaded; its label is the session's
            (`orchestrator > scout#1` for a child), and `id` its name on its board.
        run_folder: where its run is saved (its parent's run folder for a child; default: the runner's home).
        owner: the board it was started on; told when a background generation ends (its notice).
        interactive: a chat or `resume`: its children outlive a generation, and a final answer never
            waits for them. Otherwise (a started task) a final answer waits while its children run,
            then takes their notices as a new turn, and its remaining children are cancelled when it ends.
        record, entry: the saved run and task being continued (None for a new task).
        messages: the conversation to continue (a reopened task).
        generations: how many generations the task already has.
        read_more: how a cut answer says to read the rest (see `caps.cap_answer`).
        fork_from: a fork's start: its parent's host session and messages (`ForkPoint`).
    """

    def __init__(
        self,
        runtime: TaskRuntime,
        prepared: PreparedTask,
        *,
        id: str | None = None,
        run_folder: Path | None = None,
        owner: TaskBoard | None = None,
        interactive: bool = True,
        record: RunRecord | None = None,
        entry: TaskEntry | None = None,
        messages: list[Message] | None = None,
        generations: int = 0,
        on_text: TextCallback | None = None,
        read_more: str | None = None,
        worktree: Worktree | None = None,
        fork_from: ForkPoint | None = None,
    ) -> None:
        self.runtime = runtime
        self.fork_from = fork_from
        self.prepared = prepared
        self.spec = prepared.spec
        self.host = prepared.host
        self.workspace = prepared.workspace
        self.label = prepared.label
        self.id = id or self.label
        self.run_folder = run_folder
        self.owner = owner
        self.interactive = interactive
        self.record = record
        self.entry = entry
        self.generations = generations
        self.on_text = on_text
        self.read_more = read_more
        self.worktree = worktree  # an isolated background task's: finished as each generation ends
        self.inbox = Inbox()
        self.board = TaskBoard(self.workspace, on_event=runtime.on_event, inbox=self.inbox)
        if not interactive:
            self.inbox.settle = self.board.settle
        self.result: RunResult | None = None
        self.uncapped: RunResult | None = None  # the last result with its whole answer
        self.cancel_reason: str | None = None
        self._active = False  # a generation is queued or running
        self._running = False  # ... and holds a slot
        self._done = asyncio.Event()
        self._execution: Execution | None = None
        self._task: asyncio.Task[None] | None = None
        self._turn = 0
        self._last_tool: str | None = None
        self._started: float | None = None
        self._ended: float | None = None
        self._run_id: str | None = None
        self._held = True  # False: a foreground child kept for its answer, without its conversation
        self._let_go: str | None = None  # why its conversation is no longer held
        self._adopted = False  # it ran elsewhere (a foreground child): see `adopt`
        self._spent_s = 0.0  # the time its generations took, against its timeout
        self.session = self._session(messages) if messages is not None else None

    @property
    def run_id(self) -> str | None:
        return self.record.run_id if self.record else self._run_id

    def adopt(self, result: RunResult, capped: str) -> None:
        """Hold a task that ran elsewhere (a foreground child) for its answer: whole, and as its parent read it."""
        self.uncapped, self.result = result, result.model_copy(update={"output": capped})
        self._run_id = result.run_id
        self._turn = result.usage.turns
        self._held, self._adopted = False, True
        self._spent_s = result.duration_s or 0.0

    def hold(self, session: AgentSession, board: TaskBoard, record: RunRecord | None, entry: TaskEntry | None) -> None:
        """Hold an adopted task's conversation too, so that a message continues it as a new generation
        on its own session and KV cache, in the run it was saved in.

        Args:
            board: the board its own background children were on (its session's tools use it).
        """
        self.session, self.inbox, self.board = session, session.inbox, board
        self.record, self.entry = record, entry
        self.generations = max(self.generations, 1)
        self._held = True

    @property
    def held(self) -> bool:
        """An adopted task whose conversation is held: it may be let go (`TaskBoard.let_go_oldest`)."""
        return self._adopted and self._held and self.session is not None and not self._active

    async def let_go(self, reason: str) -> None:
        """Stop holding an adopted task's conversation (its host session and KV cache are freed); a
        message to it is then refused with `reason`."""
        session, self.session = self.session, None
        self._held, self._let_go = False, reason
        if session is not None:
            self.runtime.release_session_name(session.session_name)
            await session.close()

    @property
    def status(self) -> TaskState:
        if self._active:
            return "running" if self._running else "queued"
        return self.result.status if self.result is not None else "queued"

    @property
    def alive(self) -> bool:
        """Queued or running: it counts against its board's cap."""
        return self._active

    def snapshot(self) -> TaskStatus:
        """Where the task is now: status, turn, tokens, last tool call, time, the answer or the partial output."""
        usage = self.session.usage if self.session is not None else RunUsage()
        if not self._held and self.uncapped is not None:
            usage = self.uncapped.usage
        ended = self.result is not None and not self._active
        output = self.result.output if ended and self.result else (self.session.last_text() if self.session else "")
        end = self._ended if self._ended is not None else time.monotonic()
        return TaskStatus(
            id=self.id,
            agent=self.spec.name,
            status=self.status,
            turn=self._turn,
            tokens=usage.output_tokens,
            last_tool=self._last_tool,
            elapsed_s=round(end - self._started, 1) if self._started is not None else self._ran_for(),
            output=output,
            error=self.result.error if ended and self.result else None,
            run_id=self.run_id,
            worktree=self.result.worktree if ended and self.result else None,
        )

    def _ran_for(self) -> float:
        """How long a task that ran elsewhere (a foreground child) took."""
        return round(self.uncapped.duration_s, 1) if self.uncapped is not None else 0.0

    def full_output(self) -> str:
        """The whole answer (never cut), or the partial output of a task that has not ended."""
        if not self._active and self.uncapped is not None:
            return self.uncapped.output
        return self.session.last_text() if self.session is not None else ""

    async def wait(self, timeout: float | None = None) -> RunResult | None:
        """The result once the current generation ends; None if it still runs after `timeout` seconds."""
        if not self._active:
            return self.result
        try:
            await asyncio.wait_for(self._done.wait(), timeout)
        except asyncio.TimeoutError:
            return None
        return self.result

    def cancel(self, reason: str | None = None) -> bool:
        """Abort the running or queued generation (a `bash` call's processes are killed; what was done is
        kept) and, for a started task, its own children; False when nothing was running (or already cancelled).

        Args:
            reason: the error its result carries (default `cancelled`).
        """
        if not self._active or self.cancel_reason is not None:
            return False
        self.cancel_reason = reason or CANCELLED
        self._note("task_cancel", reason=self.cancel_reason)
        if self._execution is not None:
            self._execution.cancel(self.cancel_reason)
        elif self._task is not None:  # not started yet (a chain step waiting for the one before)
            self._task.cancel()
        return True

    def send(self, message: str) -> None:
        """Give the task a message without waiting: at its next turn boundary if it runs, else as a new
        generation of its conversation (in the background; its host session and KV cache reused).

        Raises `TaskStateError` for a cancelled task, `RequestError` for an empty or oversized message.
        """
        self._check_message(message)
        aborted = not self._active and self.result is not None and self.result.status == "aborted"
        if self.cancel_reason is not None or aborted:
            why = self.cancel_reason or (self.result.error if self.result else None) or CANCELLED
            raise TaskStateError(
                f"task '{self.id}' was cancelled ({why}) and takes no more messages; "
                "its output so far can still be read, or start a new task"
            )
        if self._active:
            if self.inbox.count("task_send") >= MAX_QUEUED_MESSAGES:
                raise RequestError(
                    f"task '{self.id}' already has {MAX_QUEUED_MESSAGES} messages waiting, the limit; wait until "
                    "it has read them (subagent_output with wait) before sending more"
                )
            self.inbox.put(Delivery("task_send", message))
            return
        if not self._held:
            why = self._let_go or "its conversation is not held here"
            raise TaskStateError(
                f"task '{self.id}' ran in the foreground and {why}; its answer can be read, "
                f"`subagent resume {self.run_id}` continues it, or start a new task"
            )
        self._check_budget()
        if self.owner is not None:
            self.owner.check_room()
        self.launch(message, sends=[message])

    def _check_budget(self) -> None:
        """Refuse to continue a started task (a child) past its bounds: its generations, and the turns and
        time its limits give it across all of them (a continuation gets no fresh limits)."""
        if self.interactive:
            return  # a chat or `resume`: a person drives it, turn by turn
        why = None
        if self.generations >= MAX_GENERATIONS:
            why = f"has had {self.generations} generations, the limit of {MAX_GENERATIONS}"
        elif self.session is not None and self.session.usage.turns >= self.prepared.limits.max_turns:
            why = f"has used its {self.prepared.limits.max_turns} turns (max_turns) across its generations"
        elif (left := self._time_left()) is not None and left <= 0:
            why = f"has used its timeout of {self.prepared.timeout:g}s across its generations"
        if why is not None:
            raise TaskStateError(f"task '{self.id}' {why} and takes no more messages; start a new task")

    def _time_left(self) -> float | None:
        """Seconds left of a started task's timeout across its generations (None: no timeout)."""
        timeout = self.prepared.timeout
        if timeout is None or self.interactive:
            return timeout
        return timeout - self._spent_s

    async def ask(
        self,
        message: str,
        *,
        schema: dict[str, Any] | None = None,
        timeout: float | None = None,
        raise_errors: bool = False,
    ) -> RunResult:
        """Run one generation and wait for it: the agent answers `message`, delegating if it may.

        Args:
            timeout: wall-clock seconds for this generation.
            raise_errors: re-raise an unexpected error (after saving) instead of a failed result.
        """
        self._check_message(message)
        if self._active:
            raise TaskStateError(f"task '{self.id}' is still running; send() steers it, wait() waits for it")
        self._begin()
        result: RunResult | None = None
        try:
            result = await self._generations(message, schema=schema, timeout=timeout, raise_errors=raise_errors)
        finally:
            self._end(result)
        return result

    def launch(
        self,
        prompt: str,
        *,
        sends: list[str] | None = None,
        after: Sequence[TaskHandle] = (),
        render: Callable[[list[RunResult]], str] | None = None,
    ) -> None:
        """Start a generation in the background (`Runner.start`, `send`).

        Args:
            sends: messages sent to the task that `prompt` delivers (recorded as `task_send`).
            after, render: a chain or workflow step: wait for every task in `after`, then run
                `render(their results, in order)`; skipped if one of them did not complete.
        """
        self._begin()
        # A fresh context: the task must not inherit the slot lease of whoever started it.
        self._task = contextvars.Context().run(
            asyncio.create_task, self._background(prompt, sends or [], after, render), name=f"task-{self.id}"
        )
        self._task.add_done_callback(self._never_ran)

    def _never_ran(self, task: asyncio.Task[None]) -> None:
        """A task cancelled before its first step never ran `_background`: end it here."""
        if self._active and task is self._task:
            self._end(self._not_run("aborted", "cancelled", f"{self.cancel_reason or CANCELLED} before it started"))
            if self.owner is not None:
                self.owner.ended(self)

    async def compact(self) -> tuple[int, int] | None:
        """Summarise everything but the last reply now: `(tokens_before, tokens_after)`, or None
        when there is nothing to summarise yet."""
        session = self.session
        if session is None:
            return None
        before = await session.host.count_tokens(session.messages, session.schemas)
        if not await session.compact(keep_recent_tokens=0):
            return None
        transcript = self._transcript()
        if transcript is not None:
            transcript.write("messages", messages=session.messages)
            transcript.close()
        return before, session.usage.context_tokens

    async def join(self) -> None:
        """Wait until the background work (if any) has ended and saved; never raises."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    # -- generations ------------------------------------------------------------------------------------

    async def _background(
        self,
        prompt: str,
        sends: list[str],
        after: Sequence[TaskHandle],
        render: Callable[[list[RunResult]], str] | None,
    ) -> None:
        result: RunResult | None = None
        try:
            if self.worktree is not None and self.generations:  # a message after it ended: its worktree again
                self.worktree = reopen_worktree(self.worktree)
            needed: list[RunResult] = []
            for step in after:
                previous = await step.join_result()
                if previous is None or not previous.ok:
                    result = self._not_run("failed", "skipped", f"not run: step '{step.id}' did not complete")
                    return
                needed.append(previous)
            if render is not None:
                prompt = render(needed)
            result = await self._generations(
                prompt, sends=sends, timeout=self._time_left(), schema=self.prepared.schema
            )
        except asyncio.CancelledError:
            result = self._not_run("aborted", "cancelled", f"{self.cancel_reason or CANCELLED} before it started")
        except Exception as exc:  # a generation turns failures into results; this is a bug's last stop
            result = self._not_run("failed", "error", f"{type(exc).__name__}: {exc}")
        finally:
            result = self._finish_worktree(result)
            self._end(result)
            if self.owner is not None:
                self.owner.ended(self)

    def _finish_worktree(self, result: RunResult | None) -> RunResult | None:
        """An isolated task's changes committed on its branch (its worktree removed if it changed
        nothing), named in its result; whatever ended the generation, so that `subagent worktrees`
        lists everything kept."""
        if self.worktree is None:
            return result
        status = result.status if result is not None else "aborted"
        tree = replace(self.worktree, run_id=self.run_id or self.worktree.run_id)  # `subagent show` finds it
        kept = finish_worktree(tree, status)
        self.worktree = kept or tree
        info = worktree_result(kept)
        if self.uncapped is not None:
            self.uncapped = self.uncapped.model_copy(update={"worktree": info})
        return result.model_copy(update={"worktree": info}) if result is not None else None

    async def join_result(self) -> RunResult | None:
        """The result once the background generation has ended (a chain's next step waits on this)."""
        await self.join()
        return self.result

    async def _generations(
        self,
        prompt: str,
        *,
        sends: list[str] | None = None,
        schema: dict[str, Any] | None = None,
        timeout: float | None = None,
        raise_errors: bool = False,
    ) -> RunResult:
        """A generation; then another for each message sent as it ended (none is lost)."""
        while True:
            result = await self._generation(prompt, sends or [], schema, timeout, raise_errors)
            late = self.inbox.take("task_send")
            if not late or result.status == "aborted":
                return result
            sends = [d.text for d in late]
            prompt = "\n\n".join(sends)

    async def _generation(
        self, prompt: str, sends: list[str], schema: dict[str, Any] | None, timeout: float | None, raise_errors: bool
    ) -> RunResult:
        fresh = self.session is None and not self.interactive  # a started task's first message is its task
        session = self.session or self._start()
        if not self.interactive:  # a started task's turns count across its generations
            session.limits = replace(session.limits, turns_before=session.usage.turns)
        self.generations += 1
        transcript = self._transcript()
        for message in sends:
            self._note("task_send", transcript=transcript, message=message)
        item = PlannedTask(
            index=0,
            prepared=replace(self.prepared, timeout=timeout, schema=schema),
            prompt=prompt,
            session=session,
            fresh=fresh,
            read_more=self.read_more,
            fork_from=self.fork_from if fresh else None,
        )
        execution = Execution(
            "single",
            [item],
            concurrency=1,
            compaction=self.runtime.compaction,
            on_event=self._observe,
            open_transcript=lambda _index: transcript,
            run_id=self.run_id,
            raise_errors=raise_errors,
            slots=self.runtime.slots,
        )
        self._execution = execution
        try:
            return (await self.runtime.track(execution, background=not self.interactive))[0]
        finally:
            self._execution = None
            self._running = False
            session.messages = close_open_tool_calls(session.messages)
            if execution.uncapped[0] is not None:
                self.uncapped = execution.uncapped[0]
                self._spent_s += self.uncapped.duration_s
            if execution.results[0] is not None:
                self._record(execution.results[0])

    def _begin(self) -> None:
        self._active, self._running = True, False
        self.result, self.cancel_reason = None, None
        self._done.clear()
        self._started, self._ended = time.monotonic(), None

    def _end(self, result: RunResult | None) -> None:
        if result is not None:
            self.result = result
        self._active = self._running = False
        self._ended = time.monotonic()
        if not self.interactive:  # its children end with it (a final answer waited for them)
            self.board.cancel_all(f"its parent task '{self.id}' ended")
        self._done.set()

    def _not_run(self, status: Any, stop_reason: Any, error: str) -> RunResult:
        self._note("task_end", status=status, stop_reason=stop_reason, error=error)
        return RunResult(
            agent=self.spec.name,
            task="",
            status=status,
            error=error,
            model=self.host.model_id,
            stop_reason=stop_reason,
            label=self.label,
        )

    def _check_message(self, message: str) -> None:
        if not message.strip():
            raise RequestError(f"the message to task '{self.id}' is empty; say what it should do")
        check_request([CapItem(self.label, message, self.spec)])

    # -- events and records -----------------------------------------------------------------------------

    def _observe(self, event: Event) -> None:
        """The task's progress from its own events, passed on to the runner's sink."""
        if event.label == self.label:
            if event.kind == "task_start":
                self._running = True
            elif event.kind == "turn_start":
                self._turn = event.turn
            elif event.kind == "tool_call":
                self._last_tool = event.data.get("description") or event.data.get("name")
        self.runtime.on_event(event)

    def _note(self, kind: EventKind, *, transcript: TaskTranscript | None = None, **data: Any) -> None:
        """An event of this task from outside its loop (a send, a cancel): its transcript, then the runner's sink."""
        event = Event(kind=kind, label=self.label, agent=self.spec.name, turn=self._turn, data=data)
        record = transcript or self._transcript()
        if record is not None:
            record.event(event)
            if transcript is None:
                record.close()
        self.runtime.on_event(event)

    def _start(self) -> AgentSession:
        """A new task's first message: create its run, and a conversation holding the system prompt."""
        if self.runtime.save_transcripts:
            self.entry = TaskEntry(index=0, label=self.label, agent=self.spec.name)
            recorder = RunRecorder("single", self.workspace.root, [self.entry], self.run_folder or self.runtime.home)
            recorder.transcript(0)  # names the task's file in the record
            self.record = recorder.record
        prepared = self.prepared
        prompt = system_prompt(self.spec, self.workspace, prepared.context, prepared.skills, self.host.context_window)
        self.session = self._session([{"role": "system", "content": prompt}])
        return self.session

    def _session(self, messages: list[Message]) -> AgentSession:
        self.board.parent = self.prepared.as_parent(self.record.folder if self.record else None)
        return AgentSession(
            spec=self.spec,
            host=self.host,
            workspace=self.workspace,
            label=self.label,
            limits=self.prepared.limits,
            compaction=self.runtime.compaction,
            on_text=self.on_text,
            extra_tools={
                **self.prepared.mcp_tools,
                **self.runtime.delegation_tools(
                    self.board.parent, self.workspace, self.board, forked=self.fork_from is not None
                ),
            },
            denied=self.prepared.denied,
            project_context=self.prepared.context,
            skills=self.prepared.skills,
            messages=list(messages),
            inbox=self.inbox,
            session_name=self.runtime.claim_session_name(self.label),
            sandbox=self.prepared.sandbox,
            fork_of=self.fork_from.session if self.fork_from is not None else "",
        )

    def _transcript(self) -> TaskTranscript | None:
        if self.record is None or self.entry is None:
            return None
        return TaskTranscript(self._path(), generation=max(self.generations, 1))

    def _path(self) -> Path:
        assert self.record is not None and self.entry is not None
        return self.record.transcript_path(self.entry)

    def _record(self, result: RunResult) -> None:
        """The run's record after a generation: this task's status and the run's outcome."""
        if self.record is None or self.entry is None:
            return
        self.entry.status = result.status
        self.record.status = "interrupted" if result.status == "aborted" else "finished"
        self.record.succeeded = sum(t.status == "completed" for t in self.record.tasks)
        self.record.write()


def close_open_tool_calls(messages: list[Message]) -> list[Message]:
    """Add an error result for each tool call at the end that never got one (an aborted task).

    Chat templates expect every tool call to be answered before the next user message.
    """
    messages = list(messages)
    last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "assistant"), None)
    if last is None or not messages[last].get("tool_calls"):
        return messages
    answered = {m.get("tool_call_id") for m in messages[last + 1 :] if m.get("role") == "tool"}
    for call in messages[last]["tool_calls"]:
        if call.get("id") not in answered:
            name = call.get("function", {}).get("name", "")
            messages.append(
                {"role": "tool", "tool_call_id": call.get("id"), "name": name, "content": INTERRUPTED_TOOL_RESULT}
            )
    return messages
