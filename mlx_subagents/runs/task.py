"""`TaskHandle`: one task, from the moment it is prepared: its state, and how to watch, steer, stop
and continue it.

Every task is a handle: foreground and background, top level and child, in every mode, a chat and a
resumed task. A handle keeps one `AgentSession` for its life, so its host session and KV cache are
reused generation after generation; each generation (`runs/generation.py`) runs when an `Execution`
gives it a slot. Two ways to drive a held task:

- `await handle.ask(message)`: one generation, awaited (a chat turn, `subagent resume`);
- `handle.send(message)`: returns at once. A running task gets the message at its next turn boundary
  (its inbox; never inside a tool call); an ended one takes it as a new generation in the background.

`status`, `snapshot()`, `wait()` and `cancel()` work either way. The task's own children are on
`handle.board`. The runner makes handles (`Runner.start`, `open_task`, `reopen`, and every mode).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, cast

from ..agents.inbox import Delivery, Inbox
from ..agents.session import AgentSession
from ..deadlines import within
from ..errors import TaskStateError
from ..events import Event, EventData, EventKind, EventSink, TaskCancelData, ToolCallData
from ..host.protocol import Message, TextCallback
from ..results import LiveStatus, RunResult, RunUsage, StopReason, TaskStatus
from ..tools.delegation import ForkPoint
from .board import TaskBoard
from .generation import Generation
from .prepared import PreparedTask
from .task_checks import (
    CANCELLED,
    NOT_HELD,
    check_continuable,
    check_inbox_room,
    check_message,
    check_not_cancelled,
    time_left,
)
from .task_session import SessionRuntime, close_open_tool_calls, make_session
from .task_state import TaskState
from .tasks import Render
from .transcripts import RunRecord, TaskEntry, TaskTranscript
from .worktrees import Worktree, finish_worktree, reopen_worktree, worktree_result

NO_PERSON_IN_BACKGROUND = "nobody can answer a background task's servers (it runs while its starter carries on)"


class TaskRuntime(SessionRuntime, Protocol):
    """What a handle needs of the runner that made it: where events go, how its session (`SessionRuntime`)
    and run are made, how its generations are run, and who answers its MCP servers' questions."""

    on_event: EventSink

    def new_run(self, handle: TaskHandle) -> tuple[RunRecord, TaskEntry] | None: ...

    async def execute(self, plan: list[Generation]) -> list[RunResult]: ...

    def launch(self, plan: list[Generation]) -> None: ...

    def release(self, handle: TaskHandle) -> None: ...


class TaskHandle:
    """One task, held for its life; the runner makes it (`Runner.start`, `open_task`, `reopen`, the modes).

    Args:
        runtime: the runner that prepared the task.
        prepared: the task, checked and its model loaded; its label is the session's
            (`orchestrator > scout#1` for a child), and `id` its name on its board.
        owner: the board it is on (its parent's, `runner.board`, the MCP server's; None: nobody's).
        background: it was started in the background (its ends are notices on `owner`).
        interactive: a chat or `resume`: its children outlive a generation, and a final answer never
            waits for them. Otherwise a final answer waits while its children run, then takes their
            notices as a new turn, and its remaining children are cancelled when it ends.
        record, entry: the saved run and the task's entry in it (None: made at its first generation).
        run_folder: where a run made for it is saved (its parent's run folder for a child; default: home).
        messages: the conversation to continue (a reopened task); `generations`: how many it had.
        read_more: how a cut answer says to read the rest (see `caps.cap_answer`).
        worktree: an isolated task's worktree, finished as each run of it ends.
        fork_from: a fork's start: its parent's host session and messages (`ForkPoint`).
        session_name: the host session name it asks for (default: its label).
    """

    def __init__(
        self,
        runtime: TaskRuntime,
        prepared: PreparedTask,
        *,
        id: str | None = None,
        owner: TaskBoard | None = None,
        background: bool = False,
        interactive: bool = False,
        record: RunRecord | None = None,
        entry: TaskEntry | None = None,
        run_folder: Path | None = None,
        messages: list[Message] | None = None,
        generations: int = 0,
        on_text: TextCallback | None = None,
        read_more: str | None = None,
        worktree: Worktree | None = None,
        fork_from: ForkPoint | None = None,
        session_name: str | None = None,
    ) -> None:
        self.runtime = runtime
        self.prepared = prepared
        self.spec = prepared.spec
        self.host = prepared.host
        self.workspace = prepared.workspace
        self.label = prepared.label
        self.id = id or self.label
        self.owner = owner
        self.background = background
        self.interactive = interactive
        self.record, self.entry = record, entry
        self.run_folder = run_folder
        self.generations = generations
        self.on_text = on_text
        self.read_more = read_more
        self.worktree = worktree
        self.fork_from = fork_from
        self.inbox = Inbox()
        self.board = TaskBoard(self.workspace, on_event=runtime.on_event, inbox=self.inbox)
        if not interactive:
            self.inbox.settle, self.inbox.drain = self.board.settle, self.board.drain
        self.state = TaskState.NEW
        self.result: RunResult | None = None
        self.uncapped: RunResult | None = None  # the last result with its whole answer
        self.cancel_reason: str | None = None
        self.session: AgentSession | None = None
        self._session_name = session_name or self.label
        self.released: str | None = None  # why its conversation is not held (ENDED, LET_GO)
        self._generation: Generation | None = None  # the one queued or running
        self._turn = 0
        self._last_tool: str | None = None
        self._started: float | None = None
        self._ended: float | None = None
        self.spent_s = 0.0  # the time its generations took, against its timeout
        self._n_children = 0  # children on its board before the current run (its result counts the rest)
        if messages is not None:
            self._open(messages)
        elif fork_from is not None:  # a fork starts where its parent is now, before the parent moves on
            self._open()

    @property
    def run_id(self) -> str | None:
        return self.record.run_id if self.record else None

    # -- state ------------------------------------------------------------------------------------------

    @property
    def status(self) -> LiveStatus:
        if self.state is TaskState.RUNNING:
            return "running"
        if self.state is TaskState.QUEUED or self.result is None:
            return "queued"
        return self.result.status

    @property
    def alive(self) -> bool:
        """Queued or running: it counts against its board's cap."""
        return self.state.alive

    @property
    def held(self) -> bool:
        """A foreground child whose conversation is kept: it may be let go (`TaskBoard.let_go_oldest`)."""
        return self.state is TaskState.KEPT and not self.background and self.session is not None

    def hand_over(self, board: TaskBoard) -> str:
        """Hold this task on `board` from now on, under a new id there (a top-level task of an MCP call
        that answered within its budget before the task ended): read, steered and stopped by that id,
        and kept there when it ends. Returns the id."""
        [self.id] = board.reserve_ids([self.spec.name])
        self.owner = board
        board.add(self)
        return self.id

    async def let_go(self, reason: str) -> None:
        """Stop holding its conversation (its host session and KV cache are freed; a reopened task's hold
        on its saved run too, so another process may continue it); a message to it is then refused with
        `reason`."""
        session = self._release(TaskState.LET_GO, reason)
        if session is not None:
            await session.close()
        self.runtime.release(self)

    def snapshot(self) -> TaskStatus:
        """Where the task is now: status, turn, tokens, last tool call, time, the answer or the partial output."""
        usage = self.session.usage if self.session is not None else RunUsage()
        if self.session is None and self.uncapped is not None:
            usage = self.uncapped.usage
        ended = self.result is not None and not self.alive
        output = self.result.output if ended and self.result else (self.session.last_text() if self.session else "")
        end = self._ended if self._ended is not None else time.monotonic()
        return TaskStatus(
            id=self.id,
            agent=self.spec.name,
            status=self.status,
            turn=self._turn,
            tokens=usage.output_tokens,
            last_tool=self._last_tool,
            elapsed_s=round(end - self._started, 1) if self._started is not None else 0.0,
            output=output,
            error=self.result.error if ended and self.result else None,
            run_id=self.run_id,
            worktree=self.result.worktree if ended and self.result else None,
        )

    def full_output(self) -> str:
        """The whole answer (never cut), or the partial output of a task that has not ended."""
        if not self.alive and self.uncapped is not None:
            return self.uncapped.output
        return self.session.last_text() if self.session is not None else ""

    async def wait(self, timeout: float | None = None) -> RunResult | None:
        """The result once the current generation ends; None if it still runs after `timeout` seconds."""
        generation = self._generation
        if not self.alive or generation is None:
            return self.result
        try:
            await within(generation.done.wait(), timeout)
        except asyncio.TimeoutError:
            return None
        return self.result

    async def join(self) -> None:
        """Wait until the current generation (if any) has ended and saved; never raises."""
        generation = self._generation
        if generation is not None and generation.task is not None:
            await asyncio.gather(generation.task, return_exceptions=True)

    # -- steering ---------------------------------------------------------------------------------------

    def cancel(self, reason: str | None = None, stop_reason: StopReason = "cancelled") -> bool:
        """Abort the running or queued generation (a `bash` call's processes are killed; what was done is
        kept) and its own children; False when nothing was running (or it was already cancelled).

        Args:
            reason: the error its result carries (default `cancelled`).
            stop_reason: `timeout` when its parent's timeout stops it: it ends failed, as timed out.
        """
        if not self.alive or self.cancel_reason is not None or self._generation is None:
            return False
        self.cancel_reason = reason or CANCELLED
        self.note("task_cancel", TaskCancelData(reason=self.cancel_reason))
        if not self.interactive:  # its children first, saying why (a chat's turn stops only what it waits for)
            self.stop_children(f"its parent task '{self.id}' was stopped: {self.cancel_reason}", stop_reason)
        self._generation.abort(self.cancel_reason, stop_reason)
        return True

    def stop_children(self, reason: str, stop_reason: StopReason = "cancelled") -> None:
        """Stop every child still queued or running (foreground and background), each saved with `reason`."""
        self.board.cancel_all(reason, stop_reason)

    def has_forks(self) -> bool:
        """Whether it started a fork: its saved conversation must keep the messages forks refer to."""
        return any(getattr(t, "prepared", None) is not None and t.prepared.task.fork for t in self.board.tasks())

    def send(self, message: str) -> None:
        """Give the task a message without waiting: at its next turn boundary if it runs, else as a new
        generation of its conversation (in the background; its host session and KV cache reused).

        Raises `TaskStateError` for a cancelled task, `RequestError` for an empty or oversized message.
        """
        check_message(self, message)
        check_not_cancelled(self)
        if self.alive:
            check_inbox_room(self)
            self.inbox.put(Delivery("task_send", message))
            return
        check_continuable(self)
        if self.owner is not None:
            self.owner.check_room()
        generation = self.generation(message, sends=(message,))
        self.runtime.launch([generation])

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
        check_message(self, message)
        if self.alive:
            raise TaskStateError(f"task '{self.id}' is still running; send() steers it, wait() waits for it")
        generation = self.generation(message, schema=schema, timeout=timeout, raise_errors=raise_errors)
        await self.runtime.execute([generation])
        assert generation.result is not None
        return generation.result

    def generation(
        self,
        prompt: str,
        needs: tuple[int, ...] = (),
        render: Render | None = None,
        *,
        sends: tuple[str, ...] = (),
        schema: dict[str, Any] | None = None,
        timeout: float | None = None,
        raise_errors: bool = False,
    ) -> Generation:
        """A generation of this task for an `Execution` to run: a held task's schema is its own and its
        time what its timeout leaves; a chat turn's are what it is asked with."""
        if not self.interactive:
            schema, timeout = self.prepared.schema, time_left(self)
        return Generation(self, prompt, needs, render, sends, schema, timeout, raise_errors=raise_errors)

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

    # -- a generation's life (what `Generation` and `Execution` tell it) -------------------------------

    def queue(self, generation: Generation) -> None:
        """A generation of it waits to run: it is queued (its earlier result no longer stands)."""
        if self.worktree is not None and self.generations:  # a message after it ended: its worktree again
            self.worktree = reopen_worktree(self.worktree)
        self._generation = generation
        self.state = TaskState.QUEUED
        self.result, self.cancel_reason = None, None
        self._started, self._ended = time.monotonic(), None
        self._n_children = len(self.board.tasks())

    def start_generation(self, generation: Generation) -> tuple[AgentSession, TaskTranscript | None]:
        """A generation starts: it runs, on its session (made at its first), into its transcript."""
        generation.fresh = self.generations == 0 and not self.interactive
        session = self._open()
        self.state = TaskState.RUNNING
        if not self.interactive:  # a held task's turns count across its generations
            session.limits = replace(session.limits, turns_before=session.usage.turns)
        self.generations += 1
        return session, self._transcript(create=True)

    def end_generation(self, generation: Generation, full: RunResult) -> None:
        """A generation ended with `full` (saved): its result, its time, its run's record."""
        if self.session is not None:
            self.session.messages = close_open_tool_calls(self.session.messages)
        self.uncapped = full
        self.spent_s += full.duration_s
        generation.result = self.result = generation.capped(full)
        if self.record is not None and self.entry is not None:
            self.record.task_ended(self.entry, full.status)

    def end_unrun(self, generation: Generation) -> None:
        """A generation ended without running (skipped, stopped before it started)."""
        if self.record is not None and self.entry is not None and generation.result is not None:
            self.record.task_ended(self.entry, generation.result.status)
        self.end_now(generation)

    def end_now(self, generation: Generation) -> None:
        """End the run without waiting (it never ran, or it was cancelled from outside): its children
        are told to stop, its worktree finished; a run already ended stays as it is."""
        if not (self.alive and self._generation is generation):
            return
        if not self.interactive:
            self.board.cancel_all(self._parent_ended())
        self._settle(generation)

    async def finish_run(self, generation: Generation) -> None:
        """A run ended (its generations done): its children end with it (a held task's), what they used
        joins its result, its worktree is finished, and it is kept or let go."""
        if not self.interactive:
            await self.board.close(self._parent_ended())
        children = self.board.children_usage(self.board.tasks()[self._n_children :])
        if children is not None and generation.result is not None:
            generation.result = generation.result.model_copy(update={"children": children})
            self.uncapped = self.uncapped.model_copy(update={"children": children}) if self.uncapped else None
        self._settle(generation)
        if self.owner is not None:
            await self.owner.let_go_oldest()

    def _settle(self, generation: Generation) -> None:
        """The run's last steps: its worktree, its state, who waits for it and its board's notice."""
        generation.result = self.result = self._finish_worktree(generation.result)
        self._ended = time.monotonic()
        if self.interactive or self.background:
            keep = True  # a person or a message may continue it
        else:  # a foreground child is kept for its parent's messages, unless it was stopped
            ran = self.session is not None and self.result is not None and self.result.status != "aborted"
            keep = self.owner is not None and ran
        if keep:
            self.state = TaskState.KEPT
        else:
            self._release(TaskState.ENDED, NOT_HELD)
        generation.done.set()
        if generation.background and self.owner is not None:
            self.owner.ended(self)

    def _parent_ended(self) -> str:
        return f"its parent task '{self.id}' ended"

    def _release(self, state: TaskState, why: str) -> AgentSession | None:
        """No longer hold its conversation: its host session name is given back; the session, to close."""
        session, self.session = self.session, None
        self.state, self.released = state, why
        if session is not None:
            self.runtime.session_names.release(session.session_name)
        return session

    def _finish_worktree(self, result: RunResult | None) -> RunResult | None:
        """An isolated task's changes committed on its branch (its worktree removed if it changed
        nothing), named in its result; whatever ended the run, so that `subagent worktrees` lists
        everything kept."""
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

    # -- events, records and the session ---------------------------------------------------------------

    def observe(self, event: Event) -> None:
        """The task's progress from its own events, passed on to the runner's sink."""
        if event.label == self.label:
            if event.kind == "turn_start":
                self._turn = event.turn
            elif event.kind == "tool_call":
                call = cast(ToolCallData, event.data)
                self._last_tool = call["description"] or call["name"]
        self.runtime.on_event(event)

    def note(self, kind: EventKind, data: EventData, *, transcript: TaskTranscript | None = None) -> None:
        """An event of this task from outside its loop (a send, a cancel): its transcript, then the runner's sink."""
        event = Event(kind=kind, label=self.label, agent=self.spec.name, turn=self._turn, data=data)
        record = transcript or self._transcript()
        if record is not None:
            record.event(event)
            if transcript is None:
                record.close()
        self.runtime.on_event(event)

    def _open(self, messages: Sequence[Message] | None = None) -> AgentSession:
        """Its conversation, made once: its run saved first (children are saved in its run's folder),
        then a session holding `messages` (a new task's: its system prompt)."""
        if self.session is not None:
            return self.session
        if self.record is None:
            made = self.runtime.new_run(self)
            if made is not None:
                self.record, self.entry = made
        parent = self.board.parent = self.prepared.as_parent(self.record.folder if self.record else None)
        self.session = make_session(
            self.runtime,
            self.prepared,
            parent,
            self.board,
            self.inbox,
            messages,
            session_name=self._session_name,
            fork_from=self.fork_from,
            on_text=self.on_text,
            to_parent=self._to_parent,
            person=None if self.background else self.runtime.person,
            no_person=NO_PERSON_IN_BACKGROUND if self.background else self.runtime.no_person,
        )
        return self.session

    def _to_parent(self, text: str) -> str:
        """Its message to its parent (`parent_send`), on the board that holds it."""
        if self.owner is None:
            raise TaskStateError("nobody reads your messages here; put what you found in your final answer")
        return self.owner.message(self.id, text)

    def _transcript(self, *, create: bool = False) -> TaskTranscript | None:
        """Its transcript for the current generation; `create`: name its file if it has none yet."""
        if self.record is None or self.entry is None:
            return None
        if self.entry.file is None and not create:
            return None
        return self.record.transcript(self.entry, generation=max(self.generations, 1))
