"""`subagent chat`: a person talks with a parent agent that delegates through the `subagent` tool.

`Chat` is the conversation without a terminal: the runner's multi-turn task (`TaskHandle`: one
session kept across turns, its KV cache reused turn after turn, each turn a generation saved like
any task's, so `subagent show`, `subagent resume` and `subagent chat --resume` work on it), plus what
a person asks of a chat: a tally of the sub-agents' work, `/usage` and `/agents` reports.
`interrupt()` (Ctrl-C) aborts the current turn and the sub-agents it waits for, but keeps the chat.

Sub-agents the parent starts in the background (`background: true`) are on `chat.board`: they run
on while the parent answers, after its turn ends and while the user types; when one ends while the
parent has nothing left to do but wait, its notice (or a child's message, `parent_send`) starts the
parent's next turn (`child_ended`,
`wake_message`, `wake_turn`; off with `chat.wake = False`); `tasks()`,
`cancel_task(id)` and `send_to(id, text)` are what `/tasks`, `/cancel` and `/send` do, `workflow(name,
input)` is `/workflow`, and `close()`
(the chat ends) cancels the ones still running. The terminal front end is `terminal.run_chat`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import cast

from ..agents.inbox import Delivery, DeliveryKind
from ..errors import RequestError, ToolError
from ..events import Event, ReasoningData, TaskEndData
from ..host.protocol import TextCallback
from ..results import INTERRUPTED, MultiRunResult, RunResult, RunUsage, TaskStatus
from ..tools.delegation import Delegation, parse_delegation
from ..tools.subagent import format_outcome
from .board import BoardTask, TaskBoard
from .runner import Runner
from .task import TaskHandle

DEFAULT_CHAT_AGENT = "orchestrator"
CANCELLED_BY_USER = "cancelled by the user"
CHAT_ENDED = "the chat ended"
# What starts the parent's turn on its own: a background call's notice, a child's message.
WAKES: tuple[DeliveryKind, ...] = ("task_notice", "child_message")


class Chat:
    """One parent conversation across turns, and its children's usage.

    Create with `await Chat.start(runner, agent)`; then `await chat.turn(message)` per message. Add
    `chat.observe` to the runner's event sink to count the sub-agents' work.
    """

    def __init__(self, runner: Runner, handle: TaskHandle) -> None:
        self.runner = runner
        self.handle = handle
        self.spec = handle.spec
        self.label = handle.label
        # Each sub-agent's usage at its last end, by label: a child continued (a message sent to it) ends
        # again with its whole usage so far, and an event seen twice changes nothing.
        self.ended_children: dict[str, RunUsage] = {}
        self.last_reasoning = ""  # the parent's last reply's reasoning (`/think` shows it)
        self._thinking = False
        # A background child's end starts the parent's next turn when it has nothing else to do
        # (`wake_turn`); the person turns it off with `/wake off` or `--no-wake`.
        self.wake = True
        self._ended = asyncio.Event()
        handle.board.on_notice = lambda _status: self._ended.set()

    @classmethod
    async def start(
        cls,
        runner: Runner,
        agent: str = DEFAULT_CHAT_AGENT,
        *,
        resume: str | None = None,
        on_text: TextCallback | None = None,
    ) -> Chat:
        """A new chat with `agent` (its model loaded now), or a saved one continued (`resume`: a run id)."""
        if resume is None:
            return cls(runner, await runner.open_task(agent, on_text=on_text))
        return cls(runner, await runner.reopen(resume, on_text=on_text))

    @property
    def run_id(self) -> str | None:
        return self.handle.run_id

    @property
    def workspace(self) -> Path:
        """The folder the chat works in."""
        return self.runner.workspace.root

    async def turn(self, message: str) -> RunResult:
        """Send one message; the parent answers, delegating as it sees fit. Saved when it ends.

        An `interrupt()` ends the turn with an aborted result (what was done is kept); the chat goes on.
        """
        if not message.strip():
            raise RequestError("the message is empty; type what the agent should do")
        self.runner.refresh_agents()  # an agent file added since the last turn can be started now
        self._ended.clear()  # the notices waiting now are this turn's to read
        return await self.handle.ask(message)

    async def workflow(self, name: str, input: str = "") -> MultiRunResult:
        """`/workflow NAME INPUT`, or `/workflow {"steps": [...], "input": ...}` (an inline workflow: `name`
        and `input` are then the JSON object, split at its first space): the steps run as the parent's
        sub-agents, checked as `subagent workflow` checks them and as the parent's own calls are (its
        grants, the caps); the parent reads the steps' answers at its next turn, as a notice, so the chat
        can go on from them."""
        if name.lstrip().startswith("{"):
            call = self._inline(f"{name} {input}".strip())
        elif not name.strip():
            raise RequestError(
                'say which workflow: /workflow NAME INPUT (subagent workflows lists them), or /workflow {"steps": [...]}'
            )
        else:
            call = Delegation("workflow", (), self.handle.workspace, workflow=name.strip(), input=input)
        # Saved in the chat's run folder; before the chat's first message there is none: a run of its own.
        parent = self.board.parent or self.handle.prepared.as_parent(None)
        outcome = await self.runner.delegate(call, parent, self.board)
        answer = format_outcome(call, outcome).output
        ran = f"the workflow {call.workflow}" if call.workflow else f"a workflow of {len(call.steps)} steps"
        self.handle.inbox.put(Delivery("task_notice", f"[the user ran {ran}]\n{answer}"))
        return outcome

    def _inline(self, text: str) -> Delegation:
        """An inline workflow typed as JSON, read by the `subagent` tool's parser; one line when it is not one."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RequestError(
                f"/workflow: the steps are not valid JSON ({exc.msg} at character {exc.pos}); "
                'give {"steps": [{"name": ..., "agent": ..., "task": ..., "needs": [...]}], "input": ...}'
            ) from None
        if not isinstance(data, dict) or not data.get("steps"):
            raise RequestError('/workflow takes NAME INPUT or {"steps": [...], "input": ...}; no steps given')
        try:
            call = parse_delegation(
                data, self.handle.workspace, self.runner.catalog.agents, tool="/workflow", workflows=False
            )
        except ToolError as exc:
            raise RequestError(str(exc)) from None
        if call.mode != "workflow":
            raise RequestError('/workflow takes NAME INPUT or {"steps": [...], "input": ...}; no steps given')
        return call

    # -- waking up -------------------------------------------------------------------------------------

    async def child_ended(self) -> None:
        """Wait until a background child ends with a notice for the parent (one the parent has not read),
        or a child sends it a message (`parent_send`)."""
        # Only these (`board.on_notice`) wake the parent: a /workflow's answers wait, as its line says, for
        # the person's next message.
        while True:
            if self._ended.is_set() and self.handle.inbox.pending(WAKES):
                return
            self._ended.clear()
            await self._ended.wait()

    def wake_message(self) -> str | None:
        """The notices waiting for the parent, taken as the message of a turn it starts on its own (None:
        waking is off, or nothing waits)."""
        if not self.wake:
            return None
        notices = self.handle.inbox.take(WAKES)
        return "\n\n".join(d.text for d in notices) if notices else None

    async def wake_turn(self, message: str) -> RunResult:
        """The parent's turn on its children's notices, started without the person's message (as `run`
        continues a parent whose children end); saved as any turn."""
        return await self.handle.ask(message)

    def interrupt(self, reason: str = INTERRUPTED) -> bool:
        """Abort the running turn and the sub-agents it waits for (background ones run on); False when
        no turn is running.

        Args:
            reason: the error the aborted results carry (Ctrl-C's, or "stopped by SIGTERM").
        """
        if not self.handle.cancel(reason):
            return False
        self.runner.cancel(background=False, reason=reason)  # the sub-agents it waits for say the same
        return True

    # -- background sub-agents ------------------------------------------------------------------------

    @property
    def board(self) -> TaskBoard:
        return self.handle.board

    def background(self) -> list[BoardTask]:
        """The background sub-agents of this chat and the parent's background commands, in start order
        (the board also holds the foreground sub-agents, for their answers and conversations)."""
        return [task for task in self.board.tasks() if task.background]

    def tasks(self) -> list[TaskStatus]:
        """Every background sub-agent of this chat, in start order."""
        return [task.snapshot() for task in self.background()]

    def alive(self) -> list[str]:
        """The ids of the background sub-agents still queued or running."""
        return [task.id for task in self.board.alive()]

    def cancel_task(self, task_id: str) -> str:
        """Cancel one background sub-agent (its `bash` processes are killed); its id.

        Raises `TaskNotFoundError` (listing the ids) or `TaskStateError` (it is not running)."""
        return self.board.stop(task_id, CANCELLED_BY_USER).id

    def send_to(self, task_id: str, message: str) -> bool:
        """Send a background sub-agent a message: whether it was running (it reads the message at its
        next turn) rather than ended (it resumes with it)."""
        task = self.board.get(task_id)
        running = task.alive
        task.send(message)
        return running

    def stop_background(self, reason: str = CANCELLED_BY_USER) -> list[str]:
        """Cancel every background sub-agent still running; their ids."""
        return [task.id for task in self.board.cancel_all(reason)]

    async def close(self) -> None:
        """The chat ends: cancel the background sub-agents still running and wait until they are saved."""
        await self.board.close(CHAT_ENDED)

    async def compact(self) -> tuple[int, int] | None:
        """Summarise everything but the last reply now: `(tokens_before, tokens_after)`, or None
        when there is nothing to summarise yet."""
        return await self.handle.compact()

    def observe(self, event: Event) -> None:
        """Count the sub-agents' runs and usage from their end events; keep the parent's last reasoning."""
        if event.label == self.label and event.kind in ("turn_start", "reasoning"):
            if event.kind == "turn_start":
                self._thinking = False
            else:
                piece = cast(ReasoningData, event.data)["text"]
                self.last_reasoning = (self.last_reasoning if self._thinking else "") + piece
                self._thinking = True
        if event.kind == "task_end" and event.label.startswith(f"{self.label} > "):
            end = cast(TaskEndData, event.data)
            self.ended_children[event.label] = RunUsage(**end["usage"]) if "usage" in end else RunUsage()

    def children_usage(self) -> tuple[int, RunUsage]:
        """How many sub-agents this chat started and their usage so far: each ended one's at its last
        end, each background one's live from its session (over all its generations)."""
        usage = dict(self.ended_children)
        for task in self.background():
            if not hasattr(task, "session"):  # a background command: no sub-agent, no tokens
                continue
            if task.session is not None:
                usage[task.label] = task.session.usage
            else:
                usage.setdefault(task.label, RunUsage())
        total = RunUsage()
        for counts in usage.values():
            total = total.add(counts)
        return len(usage), total

    def in_background(self, label: str) -> bool:
        """Whether `label` is one of this chat's background sub-agents (its end is told by its notice)."""
        return any(task.label == label for task in self.background())

    # -- reports ----------------------------------------------------------------------------------------

    def usage_lines(self) -> list[str]:
        session = self.handle.session
        u = session.usage if session else RunUsage()
        window = session.host.context_window if session else 0
        (n, c), background = self.children_usage(), self.background()
        lines = [
            f"{self.label}: {u.turns} turns, {u.input_tokens:,} in ({u.cached_tokens:,} cached), {u.output_tokens:,} out; "
            f"context {u.context_tokens:,} of {window:,} tokens; KV cache {u.kv_bytes / 2**20:.1f} MiB; "
            f"{u.compactions} compactions",
            f"sub-agents: {n} started, {c.turns} turns, {c.input_tokens:,} in "
            f"({c.cached_tokens:,} cached), {c.output_tokens:,} out"
            + (f"; {len(background)} in the background, {len(self.alive())} running" if background else ""),
        ]
        if self.run_id:
            lines.append(f"saved as run {self.run_id}")
        return lines

    def agent_lines(self) -> list[str]:
        lines = []
        for name in self.runner.catalog.names():
            spec = self.runner.catalog.get(name)
            mark = " (this chat)" if name == self.spec.name else ""
            lines.append(f"{name}{mark} [{spec.source}]: {spec.description}")
        if "subagent" not in self.spec.tools:
            lines.append(
                f"note: {self.spec.name} has no subagent tool, so it cannot delegate; chat with --agent orchestrator"
            )
        return lines


__all__ = ["Chat", "DEFAULT_CHAT_AGENT"]
