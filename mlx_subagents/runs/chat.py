"""`subagent chat`: a person talks with a parent agent that delegates through the `subagent` tool.

`Chat` is the conversation without a terminal: the runner's multi-turn task (`TaskHandle`: one
session kept across turns, its KV cache reused turn after turn, each turn a generation saved like
any task's, so `subagent show`, `subagent resume` and `subagent chat --resume` work on it), plus what
a person asks of a chat: a tally of the sub-agents' work, `/usage` and `/agents` reports.
`interrupt()` (Ctrl-C) aborts the current turn and the sub-agents it waits for, but keeps the chat.

Sub-agents the parent starts in the background (`background: true`) are on `chat.board`: they run
on while the parent answers, after its turn ends and while the user types; `tasks()`,
`cancel_task(id)` and `send_to(id, text)` are what `/tasks`, `/cancel` and `/send` do, `workflow(name,
input)` is `/workflow`, and `close()`
(the chat ends) cancels the ones still running. The terminal front end is `terminal.run_chat`.
"""

from __future__ import annotations

from typing import cast

from ..agents.inbox import Delivery
from ..errors import RequestError
from ..events import Event, ReasoningData, TaskEndData
from ..host.protocol import TextCallback
from ..results import MultiRunResult, RunResult, RunUsage, TaskStatus
from ..tools.subagent import Delegation, format_outcome
from .board import TaskBoard
from .runner import Runner
from .task import TaskHandle

DEFAULT_CHAT_AGENT = "orchestrator"
INTERRUPTED = "aborted by the user (Ctrl-C)"
CANCELLED_BY_USER = "cancelled by the user"
CHAT_ENDED = "the chat ended"


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

    async def turn(self, message: str) -> RunResult:
        """Send one message; the parent answers, delegating as it sees fit. Saved when it ends.

        An `interrupt()` ends the turn with an aborted result (what was done is kept); the chat goes on.
        """
        if not message.strip():
            raise RequestError("the message is empty; type what the agent should do")
        self.runner.refresh_agents()  # an agent file added since the last turn can be started now
        return await self.handle.ask(message)

    async def workflow(self, name: str, input: str) -> MultiRunResult:
        """`/workflow NAME INPUT`: the named workflow's steps run as the parent's sub-agents, checked as
        `subagent workflow` checks them and as the parent's own calls are (its grants, the caps); the
        parent reads the steps' answers at its next turn, as a notice, so the chat can go on from them."""
        if not name.strip():
            raise RequestError("say which workflow: /workflow NAME INPUT (subagent workflows lists them)")
        call = Delegation("workflow", (), self.handle.workspace, workflow=name.strip(), input=input)
        # Saved in the chat's run folder; before the chat's first message there is none: a run of its own.
        parent = self.board.parent or self.handle.prepared.as_parent(None)
        outcome = await self.runner.delegate(call, parent, self.board)
        answer = format_outcome(call, outcome).output
        self.handle.inbox.put(Delivery("task_notice", f"[the user ran the workflow {call.workflow}]\n{answer}"))
        return outcome

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

    def background(self) -> list[TaskHandle]:
        """The background sub-agents of this chat, in start order (the board also holds the foreground
        ones, for their answers and conversations)."""
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
