"""One agent's tool loop: generate, run the tool calls, feed the results back.

Messages are the only memory. Tool failures, unknown tools, bad arguments and
malformed calls become error results the model sees; the loop ends with a
reply that calls no tool, or a limit (`limits.py`); a reply's calls run in `tool_calls.py`. The system
prompt (`prompt.py`) and tool list (`session_tools.py`) never
change during a run, so the host's cached prefix survives every turn and
every compaction. At each turn boundary (after the tool results, before the next model call) the
session takes what its inbox holds (messages sent to it, its background children's notices) as a user
message; a final answer given while background children run may wait for them (`Inbox.settle`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ..errors import McpRequestError, SubagentError
from ..events import (
    CompactionData,
    DecodeData,
    Event,
    EventData,
    EventKind,
    EventSink,
    HookWarningData,
    MessageData,
    SamplingData,
    TaskEndData,
    TaskSendData,
    TaskStartData,
    TurnStartData,
    UsageCounts,
    UsageData,
    ignore_event,
)
from ..host.protocol import (
    GenerateArgs,
    HostSession,
    Message,
    ModelHost,
    Reply,
    TextCallback,
    Usage,
)
from ..results import RunResult, RunUsage, StopReason
from ..tools import Sandbox, Tool, Workspace
from ..tools.editor import CallRef, Editor
from ..tools.mcp import McpTool
from ..tools.mcp_requests import McpCaller, Person
from ..tools.subagent import SubagentTool
from .compaction import CompactionSettings, compact, fit_keep_recent, head_length, scale_compaction, should_compact
from .hooks import HookEvent, HookOutcome, Hooks, fire
from .inbox import Inbox
from .limits import LimitReached, Limits, cut_answer, out_of_tokens, over_token_budget
from .prompt import FORK_TASK, system_prompt, task_message
from .sampling import choose_host, sample
from .session_tools import session_tools
from .skills import SkillChoice
from .spec import AgentSpec
from .streamed import Decoding, Streamed
from .tool_calls import ToolCalls

if TYPE_CHECKING:
    import mcp_types

ANSWER_NOW = "Your reply held only reasoning and no answer. Answer the task now."


@dataclass
class AgentSession:
    """A single agent run on a host session. Create one per task."""

    spec: AgentSpec
    host: ModelHost
    workspace: Workspace
    label: str = ""
    limits: Limits = field(default_factory=Limits)
    compaction: CompactionSettings = field(default_factory=CompactionSettings)
    on_event: EventSink = ignore_event
    extra_tools: dict[str, Tool] = field(default_factory=dict)
    messages: list[Message] = field(default_factory=list)
    usage: RunUsage = field(default_factory=RunUsage)
    # Receives the visible reply text as it is generated (the host hides tool-call markup), for a live display.
    on_text: TextCallback | None = None
    # Tools its file grants but its parent may not pass on: name -> the error result a call gets.
    denied: dict[str, str] = field(default_factory=dict)
    # The project's instructions for the system prompt (see `system_prompt`).
    project_context: str = ""
    # Messages for the agent (steering, background children's notices), taken at each turn boundary.
    inbox: Inbox = field(default_factory=Inbox)
    # The host session's name (default: the label). A host holds one KV cache per name, so two
    # sessions that share a label (two scouts of one parent) need names of their own.
    session_name: str = ""
    # Where its `bash` may write and whether it has network (`tools/sandbox.py`); None: unsandboxed.
    sandbox: Sandbox | None = None
    # The hooks that fire around its tool calls and at its final answer (`agents/hooks.py`), and what
    # every event they read says besides (run id, parent, depth).
    hooks: Hooks = field(default_factory=Hooks)
    hook_facts: dict[str, Any] = field(default_factory=dict)
    # The skills it is offered: listed at the end of its system prompt, loaded by its `skill` tool.
    skills: SkillChoice = field(default_factory=SkillChoice)
    # A fork's parent's host session: the fork's host session starts from its KV cache ("": none).
    fork_of: str = ""
    # Told the messages a compaction replaces, before it replaces them (its runner keeps what forks refer to).
    on_compact: Callable[[list[Message]], None] | None = None
    # Who answers the questions of the MCP servers it calls (elicitation); None where nobody can,
    # `no_person` saying why (a background task, a run without a terminal, the MCP server).
    person: Person | None = None
    no_person: str = "nobody can answer here"
    # The run's resident hosts: a server's sampling request may name one of them (see `agents/sampling.py`).
    resident_hosts: Callable[[], Sequence[ModelHost]] = tuple
    # The person's editor, where the front end has one (`subagent acp`): its files, its terminal and its
    # approval of each change (`tools/editor.py`); None: the tools work on the disk, unasked.
    editor: Editor | None = None

    def __post_init__(self) -> None:
        self.label = self.label or self.spec.name
        self.session_name = self.session_name or self.label
        self.tools = session_tools(self.spec, self.workspace, self.sandbox, self.extra_tools, self.skills)
        caller = self._mcp_caller()  # what its MCP servers' requests are answered with, during its calls
        self.tools = {n: t.for_caller(caller) if isinstance(t, McpTool) else t for n, t in self.tools.items()}
        self.tools = {n: t.with_editor(self.editor) for n, t in self.tools.items()}
        self.schemas = [tool.schema() for tool in self.tools.values()]
        for tool in self.tools.values():
            if isinstance(tool, SubagentTool):  # what a fork of this session starts from
                tool.conversation, tool.host_session = (lambda: self.messages), self.session_name
        self.compaction = scale_compaction(self.host.context_window, self.compaction)
        where = {"fork_of": self.fork_of} if self.fork_of else {}  # hosts that know no forks never see one
        self._host_session: HostSession = self.host.session(self.session_name, agent=self.spec.name, **where)
        self.inbox.report = self._emit
        self._calls = ToolCalls(self.tools, self.denied, self._emit, self.fire_hook, self._call_ref)
        self._started = 0.0
        self._reasoning = ""  # of the last reply
        self._stop_hook_active = False
        self._n_samples = 0

    # -- public ---------------------------------------------------------------

    async def run(self, task: str) -> RunResult:
        """Run the task to a final answer or a limit. Cancellation propagates (see `partial_result`)."""
        self.messages = [
            {"role": "system", "content": self.system_prompt()},
            {"role": "user", "content": task_message(task, self.workspace)},
        ]
        return await self._loop(task)

    async def fork(self, messages: Sequence[Message], task: str) -> RunResult:
        """Run a fork's task: continue `messages` (its parent's, to the fork point) with the task as a
        user message, so that its prompt extends its parent's and the host reuses that prefix."""
        self.messages = [dict(m) for m in messages]
        self.messages.append({"role": "user", "content": FORK_TASK.format(task=task)})
        return await self._loop(task)

    def system_prompt(self) -> str:
        """This session's system prompt (see `system_prompt`)."""
        return system_prompt(self.spec, self.project_context, self.skills, self.host.context_window)

    async def follow_up(self, task: str, message: str) -> RunResult:
        """Continue a finished conversation (its messages restored) with a new user message."""
        self.messages.append({"role": "user", "content": message})
        return await self._loop(task)

    async def close(self) -> None:
        """Let the host session go: its KV cache is freed now rather than evicted later."""
        await self._host_session.close()

    def partial_result(self, task: str, stop_reason: StopReason, error: str) -> RunResult:
        """What was done so far, for a run that was cancelled or timed out: a reply it cut keeps what
        it had said (see `_keep_cut`), and the error says so."""
        last = self.messages[-1] if self.messages else {}
        if last.get("cut") and last.get("content"):
            error = f"{error}; the output holds the reply it cut short"
        return self._result(task, "aborted", self.last_text(), stop_reason, error)

    # -- the loop -----------------------------------------------------------------

    async def _loop(self, task: str) -> RunResult:
        self._started = time.perf_counter()
        self._emit("task_start", TaskStartData(task=task, model=self.host.model_id, tool_mode=self.host.tool_mode))
        nudged = False
        answered: str | None = None  # a final answer given while children ran, before their notice's turn
        turns = self.limits.max_turns - self.limits.turns_before
        try:
            for turn in range(turns):
                self._deliver()
                await self._maybe_compact()
                reply = await self._step()
                if self._only_reasoning(reply):
                    if nudged:
                        raise LimitReached(
                            "empty_answer", "the model's reply held only reasoning, twice; no answer was given"
                        )
                    nudged = True
                    self.messages.append({"role": "user", "content": ANSWER_NOW})
                    continue
                if not reply.tool_calls and not reply.malformed_tool_calls:
                    if reply.finish_reason == "length":  # a truncated answer is not an answer
                        raise cut_answer(reply, self.host.context_window, self.limits)
                    last = turn == turns - 1
                    if not last and (self.inbox.pending() or await self.inbox.settle()):
                        answered = reply.text
                        continue  # a message came in: it is the next turn's, the answer can wait
                    if last:  # no turn left to read a notice in: the children end before the answer does
                        await self.inbox.drain()
                    if await self._stop_blocked(reply.text):
                        continue
                    return self._finish(task, self._result(task, "completed", reply.text, "completed"))
                await self._calls.act(reply, self.messages)
            before = self.limits.turns_before
            earlier = f" ({before} of them in earlier generations)" if before else ""
            raise LimitReached(
                "max_turns", f"reached the limit of {self.limits.max_turns} turns{earlier} without a final answer"
            )
        except LimitReached as limit:
            if answered is not None:  # it had answered: a child that ended after that never fails it
                return self._finish(task, self._result(task, "completed", answered, "completed"))
            return self._finish(task, self._result(task, "failed", self.last_text(), limit.stop_reason, str(limit)))
        except SubagentError as exc:  # the host refused a turn (prompt too long, script ran out)
            return self._finish(task, self._result(task, "failed", self.last_text(), "error", str(exc)))

    async def _step(self) -> Reply:
        max_tokens = self.limits.max_reply_tokens
        if self.limits.max_output_tokens is not None:
            left = self.limits.max_output_tokens - self.usage.output_tokens
            if left <= 0:
                raise out_of_tokens(self.limits)
            max_tokens = min(max_tokens, left)
        self.usage.turns += 1  # only a turn that reaches the model counts
        self._emit("turn_start", TurnStartData())
        decoding = Decoding(lambda n, tps: self._emit("decode", DecodeData(tokens=n, tps=tps)))
        streamed = Streamed(self._emit, self.on_text, decoding)
        try:
            with self._counting_cut():
                args = GenerateArgs(
                    max_tokens=max_tokens,
                    temperature=self.spec.temperature or 0.0,
                    on_event=streamed,
                    thinking=self.limits.thinking,
                    grammar=self.limits.grammar,
                    answer_schema=self.limits.answer_schema,
                )
                reply = await self._host_session.generate(self.messages, args, tools=self.schemas)
        except asyncio.CancelledError:
            self._keep_cut(streamed)
            raise
        self._calls.held = reply.constrained == "calls"
        if reply.constrained == "calls":
            self.usage.constrained_calls += len(reply.tool_calls)
        elif reply.constrained == "answer":
            self.usage.constrained_answers += 1
        self._count(reply.usage)
        self._reasoning = reply.reasoning
        self.messages.append(reply.to_message())
        if reply.text:
            payload = MessageData(text=reply.text)
            if reply.constrained == "answer":
                payload["constrained"] = True
            self._emit("message", payload)
        if reply.finish_reason == "length" and over_token_budget(self.limits, self.usage.output_tokens):
            raise out_of_tokens(self.limits)  # a reply cut by the budget is not a final answer
        return reply

    def _keep_cut(self, streamed: Streamed) -> None:
        """A reply cut by a timeout, Ctrl-C or a signal: what streamed of it becomes its message,
        marked `cut` (`show` says so), so that the transcript and the result keep what it said."""
        text, reasoning = "".join(streamed.text).strip(), "".join(streamed.reasoning).strip()
        if not text and not reasoning:
            return
        message: Message = {"role": "assistant", "content": text, "cut": True}
        if reasoning:
            message["reasoning_content"] = reasoning
        self._reasoning = reasoning
        self.messages.append(message)

    def _deliver(self) -> None:
        """The inbox's pending messages as one user message (after the last turn's tool results)."""
        deliveries = self.inbox.take()
        if not deliveries:
            return
        for delivery in deliveries:
            if delivery.kind == "task_send":  # a notice was reported when its task ended
                self._emit("task_send", TaskSendData(message=delivery.text))
        text = "\n\n".join(d.text for d in deliveries)
        last = self.messages[-1] if self.messages else None
        if last is not None and last.get("role") == "user":  # a follow-up just added: one user message
            last["content"] = f"{last['content']}\n\n{text}"
        else:
            self.messages.append({"role": "user", "content": text})

    @staticmethod
    def _only_reasoning(reply: Reply) -> bool:
        """A finished reply that thought but answered nothing and called nothing."""
        empty = not reply.text.strip() and not reply.tool_calls and not reply.malformed_tool_calls
        return empty and bool(reply.reasoning.strip()) and reply.finish_reason == "stop"

    def _call_ref(self, call_id: str) -> CallRef:
        """The call a tool runs for now: this session's, at its current turn."""
        return CallRef(self.label, self.usage.turns, call_id)

    async def _stop_blocked(self, answer: str) -> bool:
        """Whether a Stop hook refused the final answer: its reason then goes to the model as a user
        message and the loop goes on (within `max_turns`); `stop_hook_active` says it happened before."""
        facts = {"last_assistant_message": answer, "stop_hook_active": self._stop_hook_active}
        outcome = await self.fire_hook("Stop", "", facts)
        if not outcome.blocked:
            return False
        self._stop_hook_active = True
        self.messages.append({"role": "user", "content": f"A Stop hook did not accept the answer: {outcome.reason}"})
        return True

    async def fire_hook(self, event: HookEvent, name: str, facts: dict[str, Any]) -> HookOutcome:
        """Fire the event's hooks for this session (the runner fires SubagentStart and SubagentStop here
        too); each warning is a `hook_warning` event of the session."""
        payload = {
            "session_id": self.session_name,
            "agent": self.spec.name,
            "label": self.label,
            "cwd": str(self.workspace.root),
            **self.hook_facts,
            **facts,
        }
        outcome = await fire(self.hooks, event, name, payload, self.workspace.root)
        for warning in outcome.warnings:
            self._emit("hook_warning", HookWarningData(message=warning))
        return outcome

    async def _maybe_compact(self) -> None:
        tokens = await self.host.count_tokens(self.messages, self.schemas, thinking=self.limits.thinking)
        self.usage.context_tokens = tokens
        if should_compact(tokens, self.host.context_window, self.compaction):
            await self.compact()

    async def compact(self, keep_recent_tokens: int | None = None) -> int:
        """Summarise the older turns now (the loop does this near the window); returns how many
        messages were summarised, 0 when there was nothing old enough.

        Args:
            keep_recent_tokens: keep at most this much recent history verbatim (e.g. 0 for
                `/compact`: only the last reply stays); default: the scaled setting.
        """
        window = self.host.context_window
        count = lambda ms: self.host.count_tokens(ms, self.schemas, thinking=self.limits.thinking)  # noqa: E731
        head_tokens = await count(self.messages[: head_length(self.messages)])
        settings = fit_keep_recent(self.compaction, window, head_tokens)
        if keep_recent_tokens is not None:
            settings = replace(settings, keep_recent_tokens=min(settings.keep_recent_tokens, keep_recent_tokens))
        with self._counting_cut():
            result = await compact(self.messages, self._host_session, count, settings, tools=self.schemas)
        if result.n_summarized:
            if self.on_compact is not None:
                self.on_compact(self.messages)
            self.messages = result.messages
            self.usage.compactions += 1
            self._add(result.usage)
            self.usage.context_tokens = result.tokens_after
            counts = CompactionData(
                tokens_before=result.tokens_before, tokens_after=result.tokens_after, n_summarized=result.n_summarized
            )
            self._emit("compaction", counts)
        return result.n_summarized

    # -- what its MCP servers ask ------------------------------------------------------

    def _mcp_caller(self) -> McpCaller:
        spec = self.spec
        return McpCaller(
            label=self.label,
            agent=spec.name,
            path=spec.path,
            workspace=self.workspace.root,
            project=spec.source == "project",
            sampling=spec.sampling,
            sample=self.answer_sampling,
            person=self.person,
            no_person=self.no_person,
            report=self._emit,
        )

    async def answer_sampling(
        self, server: str, params: mcp_types.CreateMessageRequestParams
    ) -> mcp_types.CreateMessageResult:
        """A server's sampling request on this agent's model (`agents/sampling.py`), within the request's
        `maxTokens`, the per-reply limit and what is left of its token limit; counted in its usage."""
        budget = min(params.max_tokens, self.limits.max_reply_tokens)
        if self.limits.max_output_tokens is not None:
            budget = min(budget, self.limits.max_output_tokens - self.usage.output_tokens)
        if budget <= 0:
            raise McpRequestError(
                f"sampling refused: agent '{self.spec.name}' has used its limit of "
                f"{self.limits.max_output_tokens} generated tokens"
            )
        host = choose_host(params, self.host, self.resident_hosts())
        self._n_samples += 1
        result, usage = await sample(
            host, f"{self.session_name} > sampling#{self._n_samples}", self.spec.name, params, budget
        )
        self._add(usage)
        done = SamplingData(
            server=server,
            model=host.model_id,
            input_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            output_tokens=usage.generated_tokens,
            stop_reason=str(result.stop_reason or ""),
            error=None,
        )
        self._emit("sampling", done)
        self._emit("usage", UsageData(**cast(UsageCounts, self.usage.model_dump()), tps=round(usage.generation_tps, 1)))
        return result

    # -- bookkeeping --------------------------------------------------------------

    @contextlib.contextmanager
    def _counting_cut(self) -> Iterator[None]:
        """Count what a reply spent when a timeout or Ctrl-C cuts it short (a turn's or the summary's).

        Only a cut made inside the block counts: one left by an earlier cancelled reply (still set
        when a cancellation comes before the host is asked) was counted then.
        """
        before = self._host_session.cut
        try:
            yield
        except asyncio.CancelledError:
            cut = self._host_session.cut
            if cut is not None and cut is not before:
                self._count(cut)
            raise

    def _add(self, u: Usage) -> None:
        self.usage.input_tokens += u.prompt_tokens
        self.usage.output_tokens += u.generated_tokens
        self.usage.cached_tokens += u.cached_tokens
        self.usage.prefill_wait_s = round(self.usage.prefill_wait_s + u.prefill_wait_seconds, 3)
        self.usage.drafted_tokens += u.drafted_tokens
        self.usage.accepted_tokens += u.accepted_tokens

    def _count(self, u: Usage) -> None:
        self._add(u)
        self.usage.context_tokens = u.prompt_tokens + u.generated_tokens
        self.usage.kv_bytes = self._host_session.kv_bytes
        self.usage.kv_bits = getattr(self._host_session, "kv_bits", None)  # a host with a local KV cache has it
        counts = cast(UsageCounts, self.usage.model_dump())
        self._emit("usage", UsageData(**counts, tps=round(u.generation_tps, 1)))

    def last_text(self) -> str:
        for message in reversed(self.messages):
            if message.get("role") == "assistant" and message.get("content"):
                return str(message["content"])
        return ""

    def _result(
        self, task: str, status: Any, output: str, stop_reason: StopReason, error: str | None = None
    ) -> RunResult:
        return RunResult(
            agent=self.spec.name,
            task=task,
            status=status,
            output=output,
            reasoning=self._reasoning,
            error=error,
            usage=self.usage.model_copy(),
            model=self.host.model_id,
            tool_mode=self.host.tool_mode,
            stop_reason=stop_reason,
            duration_s=round(time.perf_counter() - self._started, 3),
            label=self.label,
        )

    def _finish(self, task: str, result: RunResult) -> RunResult:
        self._emit("task_end", TaskEndData(status=result.status, stop_reason=result.stop_reason, error=result.error))
        return result

    def _emit(self, kind: EventKind, data: EventData) -> None:
        """Report an event of this session, at its current turn (the inbox reports its notices here too)."""
        self.on_event(Event(kind=kind, label=self.label, agent=self.spec.name, turn=self.usage.turns, data=data))


def workspace_for(cwd: Path | str) -> Workspace:
    return Workspace(Path(cwd).resolve())
