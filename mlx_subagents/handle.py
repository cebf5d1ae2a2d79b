"""`TaskHandle`: a top-level task that takes one message after another (a chat, a resumed task).

A multi-turn task is still a task: each `send` is one generation of it, run through an `Execution`
like any other (limits, timeout, Ctrl-C, error handling, the transcript and the task's events), on
one `AgentSession` kept for the handle's life, so its host session and KV cache are reused turn
after turn. A new task's run is created at its first message; the run's record is updated after
every generation. `Runner.open_task` and `Runner.reopen` make handles; `subagent resume` sends one
message, `subagent chat` many.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .agents import AgentSpec
from .caps import CapItem, check_request
from .execution import Execution, Parent, PlannedTask
from .host.protocol import Message, ModelHost, TextCallback
from .results import RunResult
from .session import AgentSession, system_prompt
from .tools import Workspace
from .transcripts import RunRecord, RunRecorder, TaskEntry, TaskTranscript

if TYPE_CHECKING:
    from .runner import Runner

INTERRUPTED_TOOL_RESULT = "Error: this tool call was interrupted before it finished."


class TaskHandle:
    """One top-level task, driven message by message; create with `Runner.open_task` or `Runner.reopen`.

    Args:
        record, entry: the saved run and task being continued (None for a new task).
        messages: the conversation to continue (a reopened task).
        generations: how many generations the task already has.
    """

    def __init__(
        self,
        runner: Runner,
        spec: AgentSpec,
        model: str,
        host: ModelHost,
        workspace: Workspace,
        *,
        label: str,
        record: RunRecord | None = None,
        entry: TaskEntry | None = None,
        messages: list[Message] | None = None,
        generations: int = 0,
        on_text: TextCallback | None = None,
    ) -> None:
        self.runner = runner
        self.spec = spec
        self.model = model
        self.host = host
        self.workspace = workspace
        self.label = label
        self.record = record
        self.entry = entry
        self.generations = generations
        self.on_text = on_text
        self.session = self._session(messages) if messages is not None else None

    @property
    def run_id(self) -> str | None:
        return self.record.run_id if self.record else None

    async def send(
        self,
        message: str,
        *,
        schema: dict[str, Any] | None = None,
        timeout: float | None = None,
        raise_errors: bool = False,
    ) -> RunResult:
        """Run one generation: the agent answers `message`, delegating if it may. Saved when it ends.

        Args:
            timeout: wall-clock seconds for this generation.
            raise_errors: re-raise an unexpected error (after saving) instead of a failed result.
        """
        check_request([CapItem(self.label, message, self.spec)])
        session = self.session or self._start()
        self.generations += 1
        transcript = self._transcript()
        item = PlannedTask(
            index=0,
            label=self.label,
            spec=self.spec,
            host=self.host,
            workspace=self.workspace,
            prompt=message,
            limits=session.limits,
            step_id=self.entry.step_id if self.entry else None,
            timeout=timeout,
            schema=schema,
            session=session,
        )
        execution = Execution(
            "single",
            [item],
            concurrency=1,
            compaction=self.runner.compaction,
            on_event=self.runner.on_event,
            open_transcript=lambda _index: transcript,
            run_id=self.run_id,
            raise_errors=raise_errors,
            slots=self.runner.slots,
        )
        try:
            return (await self.runner.track(execution))[0]
        finally:
            session.messages = close_open_tool_calls(session.messages)
            if execution.results[0] is not None:
                self._record(execution.results[0])

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

    # -- internals --------------------------------------------------------------------------------------

    def _start(self) -> AgentSession:
        """A new task's first message: create its run, and a conversation holding the system prompt."""
        if self.runner.save_transcripts:
            self.entry = TaskEntry(index=0, label=self.label, agent=self.spec.name)
            recorder = RunRecorder("single", self.workspace.root, [self.entry], self.runner.home)
            recorder.transcript(0)  # names the task's file in the record
            self.record = recorder.record
        prompt = system_prompt(self.spec, self.workspace, self.runner.project_context(self.spec, self.workspace))
        self.session = self._session([{"role": "system", "content": prompt}])
        return self.session

    def _session(self, messages: list[Message]) -> AgentSession:
        children_home = self.record.folder if self.record else None
        return AgentSession(
            spec=self.spec,
            host=self.host,
            workspace=self.workspace,
            label=self.label,
            limits=self.runner.limits(self.spec),
            compaction=self.runner.compaction,
            on_text=self.on_text,
            extra_tools=self.runner.delegation_tools(
                Parent(self.spec, self.label, 0, self.model, children_home), self.workspace
            ),
            messages=list(messages),
        )

    def _transcript(self) -> TaskTranscript | None:
        if self.record is None or self.entry is None:
            return None
        return TaskTranscript(self._path(), generation=self.generations)

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
