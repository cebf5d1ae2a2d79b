"""`Generation`: one generation of a task, from its prompt to its saved result.

A task's first message is its first generation; each message that continues it (a chat turn, a
`task_send` after it ended, `subagent resume`, a message that arrived as it ended) is another.
A generation runs on its task's one `AgentSession`, so the host session and KV cache carry over:
within its time-out, between a child's SubagentStart and SubagentStop hooks, with one retry when the
answer misses its output schema. Its transcript gets the generation's records; its task
(`TaskHandle`) is told when it starts and ends, and closes its children, finishes its worktree and
keeps or lets go of its conversation.

`Execution` decides when a generation runs (the steps it needs, a slot, the writer lease) and stops it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

from ..agents.inbox import Inbox
from ..agents.schema_output import AnswerMismatch, parse_answer, retry_message, schema_instruction
from ..agents.session import AgentSession
from ..agents.spec import AgentSpec
from ..caps import cap_answer
from ..errors import SubagentError
from ..events import Event, EventData, EventKind, EventSink, TaskEndData, TaskSendData, TaskStartData, UsageCounts
from ..host.protocol import Message
from ..results import INTERRUPTED, RunResult, Status, StopReason
from ..tools.delegation import ForkPoint
from .prepared import PreparedTask
from .tasks import Render
from .transcripts import TaskTranscript, messages_digest


class GenerationOwner(Protocol):
    """What a generation needs of its task (a `TaskHandle`): who it is, and to be told how it goes."""

    id: str
    label: str
    spec: AgentSpec
    prepared: PreparedTask
    inbox: Inbox
    read_more: str | None
    fork_from: ForkPoint | None

    @property
    def run_id(self) -> str | None: ...

    def start_generation(self, generation: Generation) -> tuple[AgentSession, TaskTranscript | None]: ...
    def stop_children(self, reason: str, stop_reason: StopReason) -> None: ...
    def has_forks(self) -> bool: ...
    def end_generation(self, generation: Generation, full: RunResult) -> None: ...
    def end_unrun(self, generation: Generation) -> None: ...
    def end_now(self, generation: Generation) -> None: ...
    async def finish_run(self, generation: Generation) -> None: ...
    def queue(self, generation: Generation) -> None: ...
    def note(self, kind: EventKind, data: EventData, *, transcript: TaskTranscript | None = None) -> None: ...
    def observe(self, event: Event) -> None: ...


@dataclass(eq=False)
class Generation:
    """One generation of `handle`; `Execution` runs it (`run`) once it holds a slot.

    Args:
        prompt: the message (a new task's: its task), or for a step with `render`, what its
            transcript shows until it runs.
        needs, render: a chain or workflow step: the plan indexes of the steps it waits for, and how
            its prompt is made from the plan's results.
        sends: messages sent to the task that `prompt` delivers (recorded as `task_send`).
        schema: the JSON schema its answer must match (one retry on a mismatch).
        timeout: wall-clock seconds it may take (None: no limit).
        background: it runs while whoever started it goes on: its end is a notice on its board.
        raise_errors: re-raise an unexpected error (after saving) instead of a failed result.
    """

    handle: GenerationOwner
    prompt: str
    needs: tuple[int, ...] = ()
    render: Render | None = None
    sends: tuple[str, ...] = ()
    schema: dict[str, Any] | None = None
    timeout: float | None = None
    background: bool = False
    raise_errors: bool = False
    result: RunResult | None = field(default=None, init=False)
    # Why it was stopped (a cancel, Ctrl-C, a signal, its parent's timeout); None while nobody stopped it.
    abort_reason: str | None = field(default=None, init=False)
    # What the stop is, as its result says: `cancelled`, or `timeout` (its parent's timeout stopped it).
    abort_stop: StopReason = field(default="cancelled", init=False)
    # Its own timeout passed: it stops as timed out, its children first (`_time_out`).
    timed_out: bool = field(default=False, init=False)
    # Its node in the `Execution` that runs it, cancelled to stop it.
    task: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    # The task's first: its prompt is the task, given as a new task's (else a message continuing it).
    fresh: bool = field(default=False, init=False)
    # How long it waited for its slot and what for ("a slot", "the writer lease"); its `task_start` says so.
    waited: tuple[float, str] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.done = asyncio.Event()

    @property
    def label(self) -> str:
        return self.handle.label

    @property
    def step_id(self) -> str | None:
        return self.handle.prepared.task.step_id

    def abort(self, reason: str, stop_reason: StopReason = "cancelled") -> None:
        """Stop it: a running generation keeps what it did, a waiting one never starts; `reason` is its
        error, `stop_reason` its result's (`timeout`: it ends failed, as a timed-out task does)."""
        if self.abort_reason is None:
            self.abort_reason, self.abort_stop = reason, stop_reason
        if self.task is not None:
            self.task.cancel()

    @property
    def stopped_status(self) -> Status:
        """The status a stopped generation ends with: failed when a timeout stopped it, else aborted."""
        return "failed" if self.abort_stop == "timeout" else "aborted"

    # -- running ----------------------------------------------------------------------------------------

    async def run(self, results: Sequence[RunResult | None]) -> None:
        """Run it, then a generation for the messages sent as it ended (none is lost), in its slot;
        `result` is the last one's, once its task has ended the run."""
        if self.render is not None:
            self.prompt, self.render = self.render(results), None
        while True:
            await self._run_one()
            late = [d.text for d in self.handle.inbox.take("task_send")]
            if not late or self.result is None or self.result.status == "aborted":
                break
            self.prompt, self.sends = "\n\n".join(late), tuple(late)
        await self.handle.finish_run(self)

    async def _run_one(self) -> None:
        handle, prompt = self.handle, self.prompt
        session, transcript = handle.start_generation(self)
        started = time.perf_counter()
        for message in self.sends:
            handle.note("task_send", TaskSendData(message=message), transcript=transcript)
        self._start_transcript(transcript, session, prompt)
        host = handle.prepared.host
        start = TaskStartData(task=prompt, model=host.model_id, tool_mode=host.tool_mode, step_id=self.step_id)
        if self.waited is not None:
            start["waited_s"], start["waited_for"] = self.waited
            self.waited = None  # a later generation of the task waits anew
        self.report(transcript, "task_start", start)
        failure: BaseException | None = None
        try:
            result = await self._within_timeout(self._drive(session, prompt))
        except asyncio.CancelledError:
            if self.timed_out and self.abort_reason is None:
                result = _stopped(session, prompt, "failed", "timeout", f"stopped by the timeout of {self.timeout:g}s")
            else:
                reason = self.abort_reason or INTERRUPTED
                result = _stopped(session, prompt, self.stopped_status, self.abort_stop, reason)
            if (
                self.abort_reason is None and not self.timed_out
            ):  # cancelled from outside the runner: save, then propagate
                await self._stop_hook(session, result)
                handle.end_generation(self, self._save(transcript, session, result, prompt, started))
                handle.end_now(self)
                raise
            _uncancel()
        except Exception as exc:
            failure = exc
            message = str(exc) if isinstance(exc, SubagentError) else f"{type(exc).__name__}: {exc}"
            result = _stopped(session, prompt, "failed", "error", message)
        await self._stop_hook(session, result)
        handle.end_generation(self, self._save(transcript, session, result, prompt, started))
        if failure is not None and self.raise_errors:
            await handle.finish_run(self)
            raise failure

    def _start_transcript(self, transcript: TaskTranscript | None, session: AgentSession, prompt: str) -> None:
        """The generation's first records: the task's (its first), else the message that continues it;
        the session's events go to this transcript from now on, its hooks read its facts."""
        handle, prepared = self.handle, self.handle.prepared
        session.on_event = self._sink(transcript)
        session.on_compact = self._keeper(transcript)
        session.hooks = prepared.hooks
        session.hook_facts = {
            "run_id": handle.run_id,
            "parent": prepared.parent,
            "depth": prepared.depth,
            "transcript_path": str(transcript.path) if transcript is not None else None,
        }
        if transcript is None:
            return
        if transcript.started:
            transcript.follow_up(prompt)
            return
        fork = {"fork_of": _fork_meta(handle, transcript.path)} if self.fresh and handle.fork_from else {}
        transcript.start(
            run_id=handle.run_id,
            label=self.label,
            step_id=self.step_id,
            agent=prepared.spec.name,
            model=prepared.host.model_id,
            cwd=str(prepared.workspace.root),
            task=prompt,
            schema=self.schema,
            # What its parent withheld and the sandbox it runs in, so that a continued task keeps both
            # (`Runner.reopen`).
            **({"denied": prepared.denied} if prepared.denied else {}),
            **({"sandbox": prepared.sandbox.record()} if prepared.sandbox is not None else {}),
            # A fork: whose conversation it continues, and how many of its first messages are that.
            **fork,
        )

    async def _drive(self, session: AgentSession, prompt: str) -> RunResult:
        """A child's SubagentStart hook, then `_answer`, within its time-out (the hook blocks nothing)."""
        spec = self.handle.spec
        if self.handle.prepared.parent is not None:
            await session.fire_hook("SubagentStart", spec.name, {"agent_type": spec.name})
        return await self._answer(session, prompt)

    async def _stop_hook(self, session: AgentSession, result: RunResult) -> None:
        """A child's SubagentStop hook, however it ended: completed, failed, cancelled or timed out (its
        `status` and `stop_reason` say which); it blocks nothing."""
        spec = self.handle.spec
        if self.handle.prepared.parent is not None:
            facts = {"agent_type": spec.name, "status": result.status, "stop_reason": result.stop_reason}
            await session.fire_hook("SubagentStop", spec.name, {**facts, "output": result.output})

    async def _within_timeout(self, work: Any) -> RunResult:
        """`work` within the generation's timeout. When it passes, the task's children are stopped first,
        as timed out (their parent's time ran out, no one pressed Ctrl-C), then the generation itself."""
        if self.timeout is None:
            return await work
        current = asyncio.current_task()
        assert current is not None
        timer = asyncio.get_running_loop().call_later(self.timeout, self._time_out, current)
        try:
            return await work
        finally:
            timer.cancel()

    def _time_out(self, task: asyncio.Task[Any]) -> None:
        self.timed_out = True
        self.handle.stop_children(f"stopped by its parent's timeout of {self.timeout:g}s", "timeout")
        task.cancel()

    def _keeper(self, transcript: TaskTranscript | None) -> Callable[[list[Message]], None]:
        """What a compaction of a task that has forks saves first: the conversation it replaces, so that
        its forks, which refer to its messages instead of copying them, stay readable."""

        def keep(messages: list[Message]) -> None:
            if transcript is not None and self.handle.has_forks():
                transcript.write("messages", messages=messages, compacted=True)

        return keep

    async def _answer(self, session: AgentSession, prompt: str) -> RunResult:
        """The session to its answer; with a schema, one retry on an invalid answer."""
        schema = self.schema
        text = prompt + schema_instruction(schema) if schema else prompt
        fork = self.handle.fork_from
        if self.fresh and fork is not None:
            result = await session.fork(fork.messages, text)
        elif self.fresh:
            result = await session.run(text)
        else:
            result = await session.follow_up(prompt, text)
        if schema is None or not result.ok:
            return result
        try:
            return result.model_copy(update={"parsed": parse_answer(result.output, schema)})
        except AnswerMismatch as first:
            result = await session.follow_up(prompt, retry_message(str(first)))
        if not result.ok:
            return result
        try:
            return result.model_copy(update={"parsed": parse_answer(result.output, schema)})
        except AnswerMismatch as second:
            error = f"the final answer is not valid against the output schema after one retry: {second}"
            return result.model_copy(update={"status": "failed", "stop_reason": "schema", "error": error})

    def _save(
        self,
        transcript: TaskTranscript | None,
        session: AgentSession,
        result: RunResult,
        prompt: str,
        started: float,
    ) -> RunResult:
        """The whole result, saved and its end reported (the answer is capped later, by the task)."""
        full = result.model_copy(
            update={
                "task": prompt,
                "label": self.label,
                "step_id": self.step_id,
                "run_id": self.handle.run_id,
                "transcript": str(transcript.path) if transcript is not None else None,
                "duration_s": round(time.perf_counter() - started, 3),
            }
        )
        usage = cast(UsageCounts, full.usage.model_dump())
        end = TaskEndData(
            status=full.status, stop_reason=full.stop_reason, error=full.error, usage=usage, duration_s=full.duration_s
        )
        self.report(transcript, "task_end", end)
        if transcript is not None:
            transcript.finish(session.messages, full)
        return full

    def capped(self, full: RunResult) -> RunResult:
        """`full` with its answer cut to the output cap, as its parent reads it (the rest by `read_more`)."""
        return full.model_copy(
            update={"output": cap_answer(full.output, full.transcript, read_more=self.handle.read_more)}
        )

    def end_unrun(self, status: Status, stop_reason: StopReason, error: str) -> None:
        """End a generation that never ran (a step skipped, a task stopped before it started): its
        result reported, its task told."""
        prepared = self.handle.prepared
        self.handle.note("task_end", TaskEndData(status=status, stop_reason=stop_reason, error=error))
        self.result = RunResult(
            agent=prepared.spec.name,
            task=self.prompt,
            status=status,
            error=error,
            model=prepared.host.model_id,
            stop_reason=stop_reason,
            label=self.label,
            step_id=self.step_id,
            run_id=self.handle.run_id,
        )
        self.handle.end_unrun(self)

    # -- events ---------------------------------------------------------------------------------------

    def _sink(self, transcript: TaskTranscript | None) -> EventSink:
        """Session events to the transcript and the task; start and end are reported once, here."""

        def sink(event: Event) -> None:
            if event.kind in ("task_start", "task_end"):
                return
            if transcript is not None:
                transcript.event(event)
            self.handle.observe(event)

        return sink

    def report(self, transcript: TaskTranscript | None, kind: EventKind, data: EventData) -> None:
        event = Event(kind=kind, label=self.label, agent=self.handle.spec.name, data=data)
        if transcript is not None:
            transcript.event(event)
        self.handle.observe(event)


def _stopped(session: AgentSession, prompt: str, status: Status, stop_reason: StopReason, error: str) -> RunResult:
    """What the session had done when a limit or an interruption stopped it."""
    return session.partial_result(prompt, stop_reason, error).model_copy(update={"status": status})


def _uncancel() -> None:
    """Take back a cancellation we handled, so later awaits (and timeouts) in this task behave."""
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):
        task.uncancel()


def _fork_meta(handle: GenerationOwner, path: Path) -> dict[str, Any]:
    """What a fork's transcript says of its start: its parent's label and run (whose folder holds the
    fork's), and how many of its parent's messages it continues (through the reply that made the
    call) with their digest; its transcript then saves only the rest (`TaskTranscript.finish`)."""
    assert handle.fork_from is not None
    messages = handle.fork_from.messages
    n = max((i + 1 for i, m in enumerate(messages) if m.get("role") == "assistant"), default=len(messages))
    run_id = path.parent.parent.parent.name  # <parent run>/runs/<this run>/<file>
    return {"parent": handle.prepared.parent, "run": run_id, "messages": n, "digest": messages_digest(messages[:n])}
