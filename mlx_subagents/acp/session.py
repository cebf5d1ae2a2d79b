"""One ACP session: a chat (`runs/chat.py`) with the chosen agent in the client's workspace.

The session's agent (the orchestrator by default), its model and plan mode are its config options;
its chat is made at its first prompt (or at `session/load`, from the saved run), on a runner of its
own in its workspace over the process's hosts, with the editor (`ClientEditor`) as the runner's
editor, person and consent. A prompt is one turn of the chat, saved as any turn; a cancel interrupts
it (saved as aborted); a change of model or mode after the first turn reopens the saved run with it,
as `subagent resume` would (the conversation goes on; its KV cache is prefilled again, once).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import acp
from acp.schema import ClientCapabilities, PromptResponse, Usage

from ..errors import RequestError
from ..events import EventSink
from ..host.protocol import Message
from ..results import RunResult
from ..runs.chat import DEFAULT_CHAT_AGENT, Chat
from ..runs.runner import Runner
from ..tools.mcp import McpServerConfig
from .client_editor import ClientEditor
from .updates import Updates

CANCELLED = "cancelled in the editor (session/cancel)"
CLIENT_GONE = "the editor went away"


class MakeRunner(Protocol):
    """Makes a session's runner: in `cwd`, its events to `on_event`, its consent asked through `ask`,
    with the session's choices (`model`, `plan`) over the command's options."""

    def __call__(self, cwd: Path, *, on_event: EventSink, ask: Any, model: str | None, plan: bool) -> Runner: ...


@dataclass
class Choices:
    """What the person chose for a session (its config options)."""

    agent: str = DEFAULT_CHAT_AGENT
    model: str | None = None  # None: the agent's own, else the command's default
    plan: bool = False


@dataclass
class EditorSession:
    """One session: its workspace, choices, chat (once made) and the turn running now."""

    id: str
    cwd: Path
    conn: Any
    capabilities: ClientCapabilities
    make_runner: MakeRunner
    choices: Choices = field(default_factory=Choices)
    mcp_servers: list[McpServerConfig] = field(default_factory=list)
    chat: Chat | None = None
    updates: Updates | None = None
    turn: asyncio.Task[RunResult] | None = None
    title: str = ""

    @property
    def run_id(self) -> str | None:
        return self.chat.run_id if self.chat is not None else None

    @property
    def started(self) -> bool:
        """Whether its conversation has a turn (saved) that a change of agent would lose."""
        return self.run_id is not None

    async def open(self, resume: str | None = None) -> Chat:
        """Its chat, made now if it is not yet: a new one with its agent, or the saved run `resume`."""
        if self.chat is not None:
            return self.chat
        self.updates = Updates(self._send, "", self.cwd, 0)
        editor = ClientEditor(self.conn, self.id, self.capabilities, self.updates)
        choices = self.choices
        runner = self.make_runner(
            self.cwd, on_event=self.updates, ask=editor.ask, model=choices.model, plan=choices.plan
        )
        runner.editor = runner.person = editor
        runner.preparer.client_servers = list(self.mcp_servers)
        try:
            self.chat = await Chat.start(runner, choices.agent, resume=resume)
        except BaseException:
            await runner.close()
            raise
        self.choices.agent = self.chat.spec.name
        self.updates.label = self.chat.label
        self.updates.window = self.chat.handle.host.context_window
        return self.chat

    async def _send(self, update: Any) -> None:
        await self.conn.session_update(session_id=self.id, update=update)

    async def prompt(self, text: str) -> PromptResponse:
        """One turn of the chat on `text`; the stop reason the editor reads (a failure's error is said first)."""
        if self.turn is not None and not self.turn.done():
            raise RequestError(
                f"session {self.id} is running a turn; wait for its end or send session/cancel before the next prompt"
            )
        chat = await self.open()
        self.title = self.title or text
        self.turn = asyncio.ensure_future(chat.turn(text))
        try:
            result = await asyncio.shield(self.turn)
        finally:
            assert self.updates is not None
            await self.updates.flush()
        if result.status == "failed" and result.error:
            self.updates.put(acp.update_agent_message_text(f"\n\n[{result.stop_reason}] {result.error}"))
            await self.updates.flush()
        u = result.usage
        usage = Usage(
            total_tokens=u.input_tokens + u.output_tokens,
            input_tokens=u.input_tokens,
            output_tokens=u.output_tokens,
            cached_read_tokens=u.cached_tokens,
        )
        return PromptResponse(stop_reason=stop_reason(result), usage=usage)

    def cancel(self, reason: str = CANCELLED) -> bool:
        """Interrupt the turn running now and the sub-agents it waits for (saved as aborted)."""
        if self.chat is None or self.turn is None or self.turn.done():
            return False
        return self.chat.interrupt(reason)

    async def close(self, reason: str = CANCELLED) -> None:
        """End the session: its turn interrupted and saved, its background sub-agents stopped, its runner
        closed (the hosts stay: they are the process's)."""
        self.cancel(reason)
        if self.turn is not None:
            await asyncio.gather(self.turn, return_exceptions=True)
        if self.chat is not None:
            await self.chat.close()
            await self.chat.runner.close()
            self.chat = None
        if self.updates is not None:
            await self.updates.close()

    async def reopen(self, choices: Choices) -> None:
        """The session with new choices: its saved run continued with them (a model or mode changed after
        its first turn), or a fresh chat at the next prompt; the agent is chosen before the first turn."""
        if choices.agent != self.choices.agent and self.started:
            raise RequestError(
                f"session {self.id} already talks with {self.choices.agent}; the agent is chosen before the first "
                "prompt: start a new session (session/new) for another agent"
            )
        if self.turn is not None and not self.turn.done():
            raise RequestError(f"session {self.id} is running a turn; change its options after the turn ends")
        run_id = self.run_id
        if self.chat is not None:
            await self.close()
        self.choices = choices
        if run_id is not None:
            await self.open(resume=run_id)

    def conversation(self) -> list[Message]:
        """The conversation so far (a loaded session's, to show again)."""
        session = self.chat.handle.session if self.chat is not None else None
        return list(session.messages) if session is not None else []


def stop_reason(result: RunResult) -> acp.schema.StopReason:
    """ACP's stop reason for a turn's result."""
    if result.status == "aborted":
        return "cancelled"
    if result.stop_reason == "max_turns":
        return "max_turn_requests"
    if result.stop_reason == "max_tokens":
        return "max_tokens"
    return "end_turn"
