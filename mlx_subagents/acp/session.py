"""One ACP session: a chat (`runs/chat.py`) with the chosen agent in the client's workspace.

The session's agent (the orchestrator by default), its model and plan mode are its config options;
its chat is made at its first prompt (or at `session/load`, from the saved run): on a runner of its
own in its workspace over the process's hosts, with the editor (`ClientEditor`) as the runner's
editor, person and consent; or, while `subagent serve` runs, on the server (`RemoteChat`: one model
and one batch for every editor window and client), its events, consent questions and the tools'
requests of the editor coming back over the chat's connection. A prompt is one turn of the chat,
saved as any turn; a cancel interrupts it (saved as aborted); a change of model or mode after the
first turn reopens the saved run with it, as `subagent resume` would (the conversation goes on; its
KV cache is prefilled again, once).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import acp
from acp.schema import ClientCapabilities, PromptResponse, SessionInfoUpdate, Usage

from ..errors import RequestError, SubagentError
from ..events import Event, EventSink
from ..host.protocol import Message
from ..results import RunResult
from ..runs.agent_mcp import client_servers
from ..runs.chat import DEFAULT_CHAT_AGENT, Chat
from ..runs.options import RunOptions
from ..runs.runner import Runner
from ..runs.transcripts import load_run, read_transcript
from ..serve.state import ServerInfo
from ..tools.editor import Approval, CallRef, FileChange, current_call
from .client_editor import ClientEditor
from .updates import Updates

log = logging.getLogger("mlx_subagents.acp")

CANCELLED = "cancelled in the editor (session/cancel)"
CANCELLED_REQUEST = "cancelled in the editor ($/cancel_request of its prompt)"
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
    """One session: its workspace, choices, chat (once made) and the turn running now.

    Args:
        options: the command's options (a session's choices go over them).
        server: the running `subagent serve` the chat runs on; None: here, on `make_runner`'s runner.
        mcp_servers: the client's MCP servers (`{name: definition}`), offered after consent.
    """

    id: str
    cwd: Path
    conn: Any
    capabilities: ClientCapabilities
    make_runner: MakeRunner
    options: RunOptions
    server: ServerInfo | None = None
    choices: Choices = field(default_factory=Choices)
    mcp_servers: dict[str, dict[str, Any]] = field(default_factory=dict)
    chat: Any = None  # a `Chat`, or a `RemoteChat` on the server
    updates: Updates | None = None
    editor: ClientEditor | None = None
    turn: asyncio.Task[RunResult] | None = None
    title: str = ""
    call_ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))  # its tool calls', for good
    _requests: set[asyncio.Task[None]] = field(default_factory=set)  # the server's requests being answered

    @property
    def run_id(self) -> str | None:
        return self.chat.run_id if self.chat is not None else None

    @property
    def started(self) -> bool:
        """Whether its conversation has a turn (saved) that a change of agent would lose."""
        return self.run_id is not None

    async def open(self, resume: str | None = None) -> Any:
        """Its chat, made now if it is not yet: a new one with its agent, or the saved run `resume`."""
        if self.chat is not None:
            return self.chat
        self.updates = Updates(self._send, "", self.cwd, 0, self.call_ids)
        self.editor = ClientEditor(self.conn, self.id, self.capabilities, self.updates)
        if self.server is not None:
            self.chat, window = await self._on_server(resume)
        else:
            self.chat, window = await self._here(resume)
        self.choices.agent = self.chat.label  # a top-level task's label is its agent's name
        self.updates.label, self.updates.window = self.chat.label, window
        return self.chat

    async def _here(self, resume: str | None) -> tuple[Chat, int]:
        assert self.editor is not None and self.updates is not None
        choices = self.choices
        runner = self.make_runner(
            self.cwd, on_event=self.updates, ask=self.editor.ask, model=choices.model, plan=choices.plan
        )
        runner.editor = runner.person = self.editor
        runner.preparer.client_servers = client_servers(self.mcp_servers)
        try:
            chat = await Chat.start(runner, choices.agent, resume=resume)
        except BaseException:
            await runner.close()
            raise
        return chat, chat.handle.host.context_window

    async def _on_server(self, resume: str | None) -> tuple[Any, int]:
        """The chat on the running server, its editor's requests answered here (`_on_message`)."""
        from ..serve.client import make_hello
        from ..serve.protocol import ChatRequest, EditorOffer
        from ..serve.remote_chat import RemoteChat

        assert self.server is not None and self.editor is not None
        choices, editor = self.choices, self.editor
        options = replace(
            self.options, plan=self.options.plan or choices.plan, model=choices.model or self.options.model
        )
        offer = EditorOffer(
            reads_files=editor.reads_files, writes_files=editor.writes_files, runs_commands=editor.runs_commands
        )
        request = ChatRequest(agent=choices.agent, resume=resume, editor=offer, mcp_servers=self.mcp_servers)
        hello = make_hello("chat", options=options, workspace=str(self.cwd), interactive=True, chat=request)
        remote = RemoteChat(self.server, hello, None, self._on_message)
        await remote.start()
        return remote, remote.window

    def _on_message(self, connection: Any, message: dict[str, Any]) -> None:
        """A line of the server's chat that is not a turn's end: an event, a question, an editor's request."""
        assert self.updates is not None
        if "event" in message:
            self.updates(Event(**message["event"]))
        elif "ask" in message or "editor" in message:
            task = asyncio.ensure_future(self._answer(connection, message))
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)
        elif "warnings" in message:
            for line in message["warnings"]:
                log.warning("%s", line)

    async def _answer(self, connection: Any, message: dict[str, Any]) -> None:
        """The editor's answer to the server: a consent question's, or a tool's request's (for its call)."""
        assert self.editor is not None
        editor, op, n = self.editor, message.get("editor"), message.get("id")
        if op is None:
            connection.send({"answer": await editor.ask(str(message["ask"])), "id": n})
            return
        call = message.get("call")
        current_call.set(CallRef(*call) if call else None)
        try:
            connection.send({"edited": n, "value": await editor_request(editor, str(op), message)})
        except FileNotFoundError as exc:
            connection.send({"edited": n, "error": str(exc), "missing": True})
        except (SubagentError, OSError) as exc:
            connection.send({"edited": n, "error": str(exc)})

    async def _send(self, update: Any) -> None:
        await self.conn.session_update(session_id=self.id, update=update)

    async def prompt(self, text: str) -> PromptResponse:
        """One turn of the chat on `text`; the stop reason the editor reads (a failure's error is said first)."""
        if self.turn is not None and not self.turn.done():
            raise RequestError(
                f"session {self.id} is running a turn; wait for its end or send session/cancel before the next prompt"
            )
        chat = await self.open()
        if not self.title:  # the editor's thread takes the first message as its title, as session/list does
            self.title = title_of(text)
            assert self.updates is not None
            self.updates.put(SessionInfoUpdate(session_update="session_info_update", title=self.title))
        self.turn = asyncio.ensure_future(chat.turn(text))
        try:
            result = await asyncio.shield(self.turn)
        finally:
            assert self.updates is not None
            await self.updates.flush()
        if result.status == "failed" and result.error:
            self.updates.say(f"\n\n[{result.stop_reason}] {result.error}")
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
        for request in list(self._requests):  # a command in the editor's terminal is killed
            request.cancel()
        return bool(self.chat.interrupt(reason))

    async def close(self, reason: str = CANCELLED) -> None:
        """End the session: its turn interrupted and saved, its background sub-agents stopped, its runner
        closed (the hosts stay: they are the process's, or the server's)."""
        self.cancel(reason)
        if self.turn is not None:
            await asyncio.gather(self.turn, return_exceptions=True)
        if self.chat is not None:
            chat, self.chat = self.chat, None
            await chat.close()
            if isinstance(chat, Chat):
                await chat.runner.close()
            else:
                await chat.disconnect()
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
        """The conversation saved so far (a loaded session's, to show again)."""
        if self.run_id is None:
            return []
        record = load_run(self.run_id)
        return read_transcript(record.transcript_path(record.tasks[0])).messages or []


async def editor_request(editor: ClientEditor, op: str, message: dict[str, Any]) -> Any:
    """One request of the server's tools (`serve/remote_editor.py`) done by the editor here; its value."""
    if op == "approve":
        change = message.get("change")
        made = FileChange(Path(change["path"]), change["old_text"], change["new_text"]) if change else None
        return await editor.approve(Approval(message["tool"], message["title"], made, message.get("command")))
    if op == "elicit":
        params = elicit_params().validate_python(message["params"])
        answer = await editor.elicit(str(message["server"]), params)
        return answer.model_dump(by_alias=True, mode="json", exclude_none=True)
    if op == "confirm":
        return await editor.confirm(str(message["question"]))
    if op == "read":
        return await editor.read_text(Path(message["path"]))
    if op == "write":
        return await editor.write_text(Path(message["path"]), message["content"])
    if op == "run":
        args, cwd = message["args"], Path(message["cwd"])
        ran = await editor.run_command(args, cwd, float(message["timeout"]), int(message["max_bytes"]))
        return {"output": ran.output, "exit_code": ran.exit_code, "truncated": ran.truncated}
    raise RequestError(f"unknown editor request {op!r}")


@functools.cache
def elicit_params() -> Any:
    """The reader of an MCP server's form (or URL) as the server's chat sent it (made once, when asked)."""
    import mcp_types
    from pydantic import TypeAdapter

    return TypeAdapter(mcp_types.ElicitRequestParams)


def title_of(text: str) -> str:
    """A session's title: the first line of its first message, cut at 200 characters."""
    lines = text.strip().splitlines()
    return lines[0][:200] if lines else ""


def stop_reason(result: RunResult) -> acp.schema.StopReason:
    """ACP's stop reason for a turn's result."""
    if result.status == "aborted":
        return "cancelled"
    if result.stop_reason == "max_turns":
        return "max_turn_requests"
    if result.stop_reason == "max_tokens":
        return "max_tokens"
    return "end_turn"
