"""Running a plan of tasks: dependency order, the concurrency limit, timeouts, cancellation.

A plan is a list of `PlannedTask`s whose `needs` point at earlier or later tasks by index. Every task
waits for its needs, then for one of `concurrency` slots, then runs its agent session. A task whose
need did not complete is skipped. `Execution.cancel()` (Ctrl-C) aborts the running sessions at their
next await (a bash tool kills its process group as it unwinds) and every task not started yet; each
aborted task keeps what it had done, in its result and its transcript. Results come back in plan
order whatever the finishing order.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..agents.compaction import CompactionSettings
from ..agents.inbox import Inbox
from ..agents.schema_output import AnswerMismatch, parse_answer, retry_message, schema_instruction
from ..agents.session import AgentSession
from ..caps import cap_answer
from ..errors import SubagentError
from ..events import Event, EventKind, EventSink, ignore_event
from ..results import Mode, RunResult, Status, StopReason
from ..tools import Tool
from ..tools.subagent import ForkPoint
from .prepare import PreparedTask
from .slots import Slots
from .tasks import Render
from .transcripts import TaskTranscript, messages_digest

INTERRUPTED = "aborted by the user (Ctrl-C)"
INTERRUPTED_BEFORE_START = "aborted by the user (Ctrl-C) before it started"


def stop_reason(signum: int) -> str:
    """The error of a task stopped by a signal: Ctrl-C's, or "stopped by SIGTERM" (SIGHUP, ...)."""
    return INTERRUPTED if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"


WAITING_FOR_WRITER = "another agent that can change files is working in this workspace; writers take turns"


@dataclass
class PlannedTask:
    """One prepared task in a plan: where it stands, what it is told, and what it waits for.

    Args:
        prompt: the task text, or for a task with `render`, what the transcript shows until it runs.
        render: builds the task text from the finished results (chain `{previous}`, workflow needs).
        session: a conversation to continue (a multi-turn task); `prompt` is then its next message.
        extra_tools: tools the runner adds by name (`subagent`); offered only if the agent grants them.
        fresh: `session` holds only its system prompt: `prompt` is the task, given like a new task's.
        inbox: the session's inbox (its board's notices, messages sent to it).
        read_more: for an answer over the output cap, how to read the rest; `{offset}` is where the
            shown part ends (default: the transcript's path, for a person).
        session_name: the host session a new session runs on, its own (default: the label).
        fork_from: where a fork starts: its parent's host session (its KV cache) and messages.
    """

    index: int
    prepared: PreparedTask
    prompt: str
    needs: tuple[int, ...] = ()
    render: Render | None = None
    session: AgentSession | None = None
    extra_tools: dict[str, Tool] = field(default_factory=dict)
    fresh: bool = False
    read_more: str | None = None
    inbox: Inbox | None = None
    session_name: str = ""
    fork_from: ForkPoint | None = None

    @property
    def label(self) -> str:
        return self.prepared.label

    @property
    def step_id(self) -> str | None:
        return self.prepared.task.step_id


OpenTranscript = Callable[[int], "TaskTranscript | None"]


@dataclass(eq=False)
class Execution:
    """One run of a plan. Create, `await run()`, and `cancel()` from a signal handler if needed.

    Args:
        raise_errors: re-raise an unexpected exception of a task (after saving its transcript)
            instead of turning it into a failed result; single runs keep their old contract.
    """

    mode: Mode
    plan: list[PlannedTask]
    concurrency: int = 4
    compaction: CompactionSettings = field(default_factory=CompactionSettings)
    on_event: EventSink = ignore_event
    open_transcript: OpenTranscript = lambda _index: None
    run_id: str | None = None
    raise_errors: bool = False
    slots: Slots | None = None

    def __post_init__(self) -> None:
        self.results: list[RunResult | None] = [None] * len(self.plan)
        # The results with their whole answers (`results` hold them capped).
        self.uncapped: list[RunResult | None] = [None] * len(self.plan)
        # The sessions the tasks ran in (a foreground child's is kept for `subagent_send`).
        self.sessions: list[AgentSession | None] = [item.session for item in self.plan]
        self.cancelled = False
        self.reason = INTERRUPTED
        self._done = [asyncio.Event() for _ in self.plan]
        self._slots = asyncio.Semaphore(self.concurrency)
        self._tasks: list[asyncio.Task[None]] = []

    async def run(self) -> list[RunResult]:
        """Run every task; the results in plan order."""
        self._tasks = [asyncio.create_task(self._run_node(item), name=f"task-{item.label}") for item in self.plan]
        try:
            await asyncio.gather(*self._tasks)
        except BaseException:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            raise
        return [r for r in self.results if r is not None]

    def cancel(self, reason: str | None = None) -> None:
        """Abort every running and queued task; safe to call more than once, from the loop's thread.

        Args:
            reason: the error the aborted results carry (default: Ctrl-C's).
        """
        if self.cancelled:
            return
        self.cancelled = True
        self.reason = reason or INTERRUPTED
        for task in self._tasks:
            task.cancel()

    # -- one node of the graph ---------------------------------------------------------------------

    async def _run_node(self, item: PlannedTask) -> None:
        try:
            for need in item.needs:
                await self._done[need].wait()
            failed = [self.results[n] for n in item.needs if not self._ok(n)]
            if failed:
                result = self._not_run(
                    item, "failed", "skipped", f"not run: {self._describe(failed[0])} did not complete"
                )
            else:
                async with self._slots, self._turn(item):
                    if self.cancelled:
                        result = self._not_run(item, "aborted", "cancelled", self._before_start())
                    else:
                        result = await self._run_task(item)
        except asyncio.CancelledError:
            if not self.cancelled:
                raise
            _uncancel()
            result = self._not_run(item, "aborted", "cancelled", self._before_start())
        except Exception as exc:  # a task that could not even be set up fails alone
            if self.raise_errors:
                raise
            result = self._not_run(item, "failed", "error", f"{type(exc).__name__}: {exc}")
        self.results[item.index] = result
        self._done[item.index].set()

    def _turn(self, item: PlannedTask) -> AbstractAsyncContextManager[object]:
        """The process-wide slot (and the workspace's writer lease) the task runs in."""
        if self.slots is None:
            return nullcontext()
        writer = item.prepared.workspace.root if item.prepared.spec.is_writer(item.prepared.denied) else None

        def waiting() -> None:
            self._report(item, None, "waiting", reason=WAITING_FOR_WRITER)

        return self.slots.hold(writer, on_wait=waiting)

    def _before_start(self) -> str:
        return INTERRUPTED_BEFORE_START if self.reason == INTERRUPTED else f"{self.reason} before it started"

    def _ok(self, index: int) -> bool:
        result = self.results[index]
        return result is not None and result.ok

    @staticmethod
    def _describe(result: RunResult | None) -> str:
        if result is None:
            return "a step it needs"
        return f"step '{result.step_id}'" if result.step_id else f"task '{result.label}'"

    async def _run_task(self, item: PlannedTask) -> RunResult:
        prompt = item.render(self.results) if item.render else item.prompt  # type: ignore[arg-type]
        transcript = self.open_transcript(item.index)
        started = time.perf_counter()
        session = item.session or AgentSession(
            spec=item.prepared.spec,
            host=item.prepared.host,
            workspace=item.prepared.workspace,
            label=item.label,
            limits=item.prepared.limits,
            compaction=self.compaction,
            extra_tools=item.extra_tools,
            denied=item.prepared.denied,
            project_context=item.prepared.context,
            skills=item.prepared.skills,
            inbox=item.inbox if item.inbox is not None else Inbox(),
            session_name=item.session_name,
            sandbox=item.prepared.sandbox,
            fork_of=item.fork_from.session if item.fork_from is not None else "",
        )
        self.sessions[item.index] = session
        session.on_event = self._session_sink(transcript)  # this generation's transcript
        session.hooks = item.prepared.hooks
        session.hook_facts = {
            "run_id": self.run_id,
            "parent": item.prepared.parent,
            "depth": item.prepared.depth,
            "transcript_path": str(transcript.path) if transcript is not None else None,
        }
        if transcript is not None:
            if not transcript.started:
                transcript.start(
                    run_id=self.run_id,
                    label=item.label,
                    step_id=item.step_id,
                    agent=item.prepared.spec.name,
                    model=item.prepared.host.model_id,
                    cwd=str(item.prepared.workspace.root),
                    task=prompt,
                    schema=item.prepared.schema,
                    # What its parent withheld, so that a continued task keeps it withheld (`Runner.reopen`).
                    **({"denied": item.prepared.denied} if item.prepared.denied else {}),
                    # A fork: whose conversation it continues, and how many of its first messages are that.
                    **({"fork_of": _fork_meta(item, transcript.path)} if item.fork_from is not None else {}),
                )
            else:
                transcript.follow_up(prompt)
        start = {
            "task": prompt,
            "model": item.prepared.host.model_id,
            "tool_mode": item.prepared.host.tool_mode,
            "step_id": item.step_id,
        }
        self._report(item, transcript, "task_start", **start)
        failure: BaseException | None = None
        try:
            result = await _within(self._drive(session, item, prompt), item.prepared.timeout)
        except asyncio.TimeoutError:
            result = _stopped(
                session, prompt, "failed", "timeout", f"stopped by the timeout of {item.prepared.timeout:g}s"
            )
        except asyncio.CancelledError:
            result = _stopped(session, prompt, "aborted", "cancelled", self.reason)
            if not self.cancelled:  # cancelled from outside the runner: save, then propagate
                self.results[item.index] = self._finish(item, transcript, session, result, prompt, started)
                raise
            _uncancel()
        except Exception as exc:
            failure = exc
            message = str(exc) if isinstance(exc, SubagentError) else f"{type(exc).__name__}: {exc}"
            result = _stopped(session, prompt, "failed", "error", message)
        result = self._finish(item, transcript, session, result, prompt, started)
        if failure is not None and self.raise_errors:
            raise failure
        return result

    async def _drive(self, session: AgentSession, item: PlannedTask, prompt: str) -> RunResult:
        """A child's SubagentStart and SubagentStop hooks around `_answer`, within its time-out (neither
        blocks; a child cancelled or timed out gets no SubagentStop)."""
        child = item.prepared.parent is not None
        if child:
            await session.fire_hook("SubagentStart", item.prepared.spec.name, {"agent_type": item.prepared.spec.name})
        result = await self._answer(session, item, prompt)
        if child:
            facts = {"agent_type": item.prepared.spec.name, "status": result.status, "output": result.output}
            await session.fire_hook("SubagentStop", item.prepared.spec.name, facts)
        return result

    async def _answer(self, session: AgentSession, item: PlannedTask, prompt: str) -> RunResult:
        """The session to its answer; with a schema, one retry on an invalid answer."""
        text = prompt + schema_instruction(item.prepared.schema) if item.prepared.schema else prompt
        if item.fork_from is not None and (item.session is None or item.fresh):
            result = await session.fork(item.fork_from.messages, text)
        elif item.session is None or item.fresh:
            result = await session.run(text)
        else:
            result = await session.follow_up(prompt, text)
        if item.prepared.schema is None or not result.ok:
            return result
        try:
            return result.model_copy(update={"parsed": parse_answer(result.output, item.prepared.schema)})
        except AnswerMismatch as first:
            result = await session.follow_up(prompt, retry_message(str(first)))
        if not result.ok:
            return result
        try:
            return result.model_copy(update={"parsed": parse_answer(result.output, item.prepared.schema)})
        except AnswerMismatch as second:
            error = f"the final answer is not valid against the output schema after one retry: {second}"
            return result.model_copy(update={"status": "failed", "stop_reason": "schema", "error": error})

    def _finish(
        self,
        item: PlannedTask,
        transcript: TaskTranscript | None,
        session: AgentSession,
        result: RunResult,
        prompt: str,
        started: float,
    ) -> RunResult:
        """Save the full result, report the end, return the result with its answer capped."""
        path = str(transcript.path) if transcript is not None else None
        full = result.model_copy(
            update={
                "task": prompt,
                "label": item.label,
                "step_id": item.step_id,
                "run_id": self.run_id,
                "transcript": path,
                "duration_s": round(time.perf_counter() - started, 3),
            }
        )
        self._report(
            item,
            transcript,
            "task_end",
            status=full.status,
            stop_reason=full.stop_reason,
            error=full.error,
            usage=full.usage.model_dump(),
            duration_s=full.duration_s,
        )
        if transcript is not None:
            transcript.finish(session.messages, full)
        self.uncapped[item.index] = full
        return full.model_copy(update={"output": cap_answer(full.output, path, read_more=item.read_more)})

    def _not_run(self, item: PlannedTask, status: Status, stop_reason: StopReason, error: str) -> RunResult:
        result = RunResult(
            agent=item.prepared.spec.name,
            task=item.prompt,
            status=status,
            error=error,
            model=item.prepared.host.model_id,
            stop_reason=stop_reason,
            label=item.label,
            step_id=item.step_id,
            run_id=self.run_id,
        )
        self._report(item, None, "task_end", status=status, stop_reason=stop_reason, error=error)
        return result

    # -- events ---------------------------------------------------------------------------------------

    def _session_sink(self, transcript: TaskTranscript | None) -> EventSink:
        """Session events to the transcript and the caller; start and end are reported once, here."""

        def sink(event: Event) -> None:
            if event.kind in ("task_start", "task_end"):
                return
            if transcript is not None:
                transcript.event(event)
            self.on_event(event)

        return sink

    def _report(self, item: PlannedTask, transcript: TaskTranscript | None, kind: EventKind, **data: Any) -> None:
        event = Event(kind=kind, label=item.label, agent=item.prepared.spec.name, data=data)
        if transcript is not None:
            transcript.event(event)
        self.on_event(event)


async def _within(coro: Any, timeout: float | None) -> RunResult:
    if timeout is None:
        return await coro
    return await asyncio.wait_for(coro, timeout)


def _stopped(session: AgentSession, prompt: str, status: Status, stop_reason: StopReason, error: str) -> RunResult:
    """What the session had done when a limit or an interruption stopped it."""
    return session.partial_result(prompt, stop_reason, error).model_copy(update={"status": status})


def _uncancel() -> None:
    """Take back a cancellation we handled, so later awaits (and timeouts) in this task behave."""
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):
        task.uncancel()


def _fork_meta(item: PlannedTask, path: Path) -> dict[str, Any]:
    """What a fork's transcript says of its start: its parent's label and run (whose folder holds the
    fork's), and how many of its parent's messages it continues (through the reply that made the
    call) with their digest; its transcript then saves only the rest (`TaskTranscript.finish`)."""
    assert item.fork_from is not None
    messages = item.fork_from.messages
    n = max((i + 1 for i, m in enumerate(messages) if m.get("role") == "assistant"), default=len(messages))
    run_id = path.parent.parent.parent.name  # <parent run>/runs/<this run>/<file>
    return {"parent": item.prepared.parent, "run": run_id, "messages": n, "digest": messages_digest(messages[:n])}
