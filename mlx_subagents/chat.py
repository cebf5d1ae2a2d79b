"""`subagent chat`: a person talks with a parent agent that delegates through the `subagent` tool.

`Chat` is the conversation without a terminal: the runner's multi-turn task (`TaskHandle`: one
session kept across turns, its KV cache reused turn after turn, each turn a generation saved like
any task's, so `subagent show`, `subagent resume` and `subagent chat --resume` work on it), plus what
a person asks of a chat: a tally of the sub-agents' work, `/usage` and `/agents` reports.
`interrupt()` (Ctrl-C) aborts the current turn and its sub-agents but keeps the chat. The terminal
front end is `terminal.run_chat`.
"""

from __future__ import annotations

from .errors import RequestError
from .events import Event
from .handle import TaskHandle
from .host.protocol import TextCallback
from .results import RunResult, RunUsage
from .runner import Runner

DEFAULT_CHAT_AGENT = "orchestrator"


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
        self.n_children = 0
        self.children_usage = RunUsage()
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
        return await self.handle.ask(message)

    def interrupt(self) -> bool:
        """Abort the running turn and every sub-agent it started; False when no turn is running."""
        return self.runner.cancel()

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
                self.last_reasoning = (self.last_reasoning if self._thinking else "") + event.data["text"]
                self._thinking = True
        if event.kind == "task_end" and event.label.startswith(f"{self.label} > "):
            self.n_children += 1
            if "usage" in event.data:
                self.children_usage = self.children_usage.add(RunUsage(**event.data["usage"]))

    # -- reports ----------------------------------------------------------------------------------------

    def usage_lines(self) -> list[str]:
        session = self.handle.session
        u = session.usage if session else RunUsage()
        window = session.host.context_window if session else 0
        c = self.children_usage
        lines = [
            f"{self.label}: {u.turns} turns, {u.input_tokens:,} in ({u.cached_tokens:,} cached), {u.output_tokens:,} out; "
            f"context {u.context_tokens:,} of {window:,} tokens; KV cache {u.kv_bytes / 2**20:.1f} MiB; "
            f"{u.compactions} compactions",
            f"sub-agents: {self.n_children} runs, {c.turns} turns, {c.input_tokens:,} in ({c.cached_tokens:,} cached), "
            f"{c.output_tokens:,} out",
        ]
        if self.run_id:
            lines.append(f"saved as run {self.run_id}")
        return lines

    def agent_lines(self) -> list[str]:
        assert self.runner.catalog is not None
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
