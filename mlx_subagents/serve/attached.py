"""The server's side of an attached command: a job (`run`, `parallel`, ...) or a chat, for one client.

The client's runner is its own (its workspace, flags and consent) over the server's hosts; its
events go back as they happen, a consent question is asked at its terminal (`Talk.ask`, without
blocking the other clients), and a cancel (Ctrl-C, SIGTERM) or the connection's end aborts its
work there, which saves what was done, as in a process of its own. See `protocol.py` for the lines.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ..errors import SubagentError
from ..events import Event, Fanout
from ..mcp_server.server_log import log_path
from ..runs.agent_mcp import client_servers
from ..runs.chat import Chat
from ..runs.runner import Runner
from ..text import warning_line
from .clients import DISCONNECTED, Client
from .protocol import Hello
from .remote_editor import RemoteEditor
from .wire import Oversized, load, send

# The running `service.Service` (not imported: it imports this module).
Service = Any
# What a chat's control connection may ask (each answered at once): `Chat`'s quick calls.
CHAT_CALLS = (
    "wake_message",
    "interrupt",
    "alive",
    "tasks",
    "background",
    "in_background",
    "cancel_task",
    "send_to",
    "stop_background",
    "usage_lines",
    "agent_lines",
    "last_reasoning",
    "run_id",
)

# What an MCP server's elicitation during an attached chat is declined with (its questions are not
# passed to the chat's terminal: `--standalone` asks them there).
NO_PERSON = "nobody can answer here: an attached subagent chat does not pass questions on (chat --standalone does)"

log = logging.getLogger("mlx_subagents.serve")


class Talk:
    """One attached client's connection: its events out, its consent questions asked and answered."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._asked: dict[int, asyncio.Future[bool]] = {}
        self.stopped: str | None = None  # why its work was cancelled before anything ran
        self.on_op: Callable[[dict[str, Any]], None] | None = None  # a chat's ops, once it has started
        self.editor: RemoteEditor | None = None  # an editor's chat (`subagent acp`): its requests' answers

    def on_event(self, event: Event) -> None:
        send(self.writer, {"event": event.to_json()})

    async def ask(self, question: str) -> bool:
        """Ask the person at the client's terminal; a client gone is a no."""
        if self.writer.is_closing():
            return False
        n = len(self._asked) + 1
        self._asked[n] = answer = asyncio.get_running_loop().create_future()
        send(self.writer, {"ask": question, "id": n})
        return await answer

    def answered(self, message: dict[str, Any]) -> None:
        answer = self._asked.get(message.get("id"))  # type: ignore[arg-type]
        if answer is not None and not answer.done():
            answer.set_result(message.get("answer") is True)

    def gone(self) -> None:
        """The client went away: every question still open is a no."""
        for answer in self._asked.values():
            if not answer.done():
                answer.set_result(False)


def start_runner(service: Service, client: Client, hello: Hello, talk: Talk, sink: Any = None) -> Runner:
    """The client's runner in its workspace; the agent files' warnings go to it first."""
    folder = hello.folder()
    if folder is None:
        raise SubagentError("the hello names no workspace (cwd or workspace)")
    ask = talk.ask if hello.interactive else None
    runner = service.make_runner(client, folder, sink or talk.on_event, interactive=hello.interactive, ask=ask)
    send(talk.writer, {"warnings": [warning_line(w) for w in runner.catalog.all_warnings()]})
    return runner


async def serve(
    service: Service, hello: Hello, lines: AsyncIterator[str | Oversized], writer: asyncio.StreamWriter
) -> None:
    if hello.hello == "job":
        await serve_job(service, hello, lines, writer)
    elif hello.hello == "chat":
        await serve_chat(service, hello, lines, writer)
    else:
        await serve_control(service, hello, lines, writer)


# -- a job --------------------------------------------------------------------------------------------


async def serve_job(
    service: Service, hello: Hello, lines: AsyncIterator[str | Oversized], writer: asyncio.StreamWriter
) -> None:
    """Run the hello's job for the client and send its result (or why it did not run)."""
    if hello.job is None:
        send(writer, {"error": "a job hello needs its job"})
        return
    job, talk = hello.job, Talk(writer)
    options = service.client_options(hello.options, hello.env_model)  # a bad one: the connection's error line
    client = service.add_client("cli", options, pid=hello.pid, name=f"subagent {job.command}")
    runner: Runner | None = None
    send(writer, {"ok": service.info.model_dump() if service.info else {}})
    try:
        runner = start_runner(service, client, hello, talk)
        client.work = work = asyncio.ensure_future(job.run(runner))
        listener = asyncio.ensure_future(listen(lines, talk, lambda reason: stop(runner, work, talk, reason)))
        try:
            await answer(writer, work, talk)
        finally:
            listener.cancel()
    except SubagentError as exc:
        send(writer, {"error": str(exc)})
    finally:
        client.work, client.connected = None, False
        if runner is not None:
            await runner.close()
        service.clients.remove(client)
        await drain(writer)


def stop(runner: Runner, work: asyncio.Future[Any], talk: Talk, reason: str) -> None:
    """A cancel or the client's end: abort its runs (saved as aborted); before anything ran, the job itself."""
    if not runner.cancel(reason=reason) and not work.done():
        talk.stopped = reason
        work.cancel()


async def answer(writer: asyncio.StreamWriter, work: asyncio.Future[Any], talk: Talk) -> None:
    """The job's last line: its result, its refusal, or that it was stopped before anything ran."""
    try:
        result = await work
    except asyncio.CancelledError:
        if talk.stopped is None:
            raise
        send(writer, {"interrupted": talk.stopped})
    except SubagentError as exc:
        send(writer, {"error": str(exc)})
    except Exception as exc:
        log.exception("an attached job failed")
        send(writer, {"error": f"internal error: {type(exc).__name__}: {exc}; the server log is {log_path()}"})
    else:
        send(writer, {"result": result.model_dump(mode="json")})


async def listen(lines: AsyncIterator[str | Oversized], talk: Talk, stop: Callable[[str], None]) -> None:
    """The client's lines: answers, cancels, a chat's ops; its end stops its work."""
    try:
        async for line in lines:
            message = load(line) if isinstance(line, str) else None
            if message is None:
                log.warning("a malformed line from an attached client, ignored")
            elif "answer" in message:
                talk.answered(message)
            elif "cancel" in message:
                stop(str(message["cancel"] or "aborted by the user (Ctrl-C)"))
            elif talk.on_op is not None and "op" in message:
                talk.on_op(message)
            elif talk.editor is not None and "edited" in message:
                talk.editor.answered(message)
    except ConnectionError:
        pass
    talk.gone()
    if talk.editor is not None:
        talk.editor.gone()
    stop(DISCONNECTED)


async def drain(writer: asyncio.StreamWriter) -> None:
    try:
        await writer.drain()
    except ConnectionError:
        pass


# -- a chat -------------------------------------------------------------------------------------------


class ChatOps:
    """A chat's slow calls (a turn, a workflow, a compaction, the end), each answered when done."""

    def __init__(self, chat: Chat, writer: asyncio.StreamWriter) -> None:
        self.chat = chat
        self.writer = writer
        self.running: set[asyncio.Task[None]] = set()
        # `child_ended` waits: answered when a background child's notice waits for the parent (the client's
        # terminal then wakes it), cancelled when the client goes, never waited for.
        self.waiting: set[asyncio.Task[None]] = set()

    def __call__(self, message: dict[str, Any]) -> None:
        op, n = message.get("op"), message.get("id")
        if op == "child_ended":
            waits = asyncio.ensure_future(self.run(n, self.chat.child_ended))
            self.waiting.add(waits)
            waits.add_done_callback(self.waiting.discard)
            return
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "turn": lambda: self.chat.turn(str(message.get("message", ""))),
            "wake_turn": lambda: self.chat.wake_turn(str(message.get("message", ""))),
            "workflow": lambda: self.chat.workflow(str(message.get("name", "")), str(message.get("input", ""))),
            "compact": self.chat.compact,
            "close": self.chat.close,
        }
        if op not in calls:
            send(self.writer, {"done": n, "error": f"unknown chat op {op!r}", "type": "SubagentError"})
            return
        task = asyncio.ensure_future(self.run(n, calls[str(op)]))
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def run(self, n: Any, call: Callable[[], Awaitable[Any]]) -> None:
        try:
            value = await call()
        except asyncio.CancelledError:
            send(self.writer, {"done": n, "error": "interrupted", "type": "CancelledError"})
        except SubagentError as exc:
            send(self.writer, {"done": n, "error": str(exc), "type": type(exc).__name__})
        except Exception as exc:
            log.exception("a chat op failed")
            send(
                self.writer,
                {"done": n, "error": f"internal error: {type(exc).__name__}: {exc}", "type": "SubagentError"},
            )
        else:
            send(self.writer, {"done": n, "value": dumped(value)})


async def serve_chat(
    service: Service, hello: Hello, lines: AsyncIterator[str | Oversized], writer: asyncio.StreamWriter
) -> None:
    """A chat for the client: started (or continued), its ops run, ended when the client ends it or goes."""
    request, talk = hello.chat, Talk(writer)
    if request is None:
        send(writer, {"error": "a chat hello needs its chat"})
        return
    client = service.add_client("chat", service.client_options(hello.options, hello.env_model), pid=hello.pid)
    client.name = f"subagent {'acp' if request.editor else 'chat'} --agent {request.agent}"
    send(writer, {"ok": service.info.model_dump() if service.info else {}})
    sink = Fanout([talk.on_event])
    chat: Chat | None = None
    listener = asyncio.ensure_future(listen(lines, talk, lambda reason: interrupt(chat, reason)))
    try:
        runner = start_runner(service, client, hello, talk, sink)
        runner.no_person = NO_PERSON
        if request.editor is not None:  # an editor's chat: its tools go through the client's editor
            runner.editor = runner.person = talk.editor = RemoteEditor(writer, request.editor)
            runner.preparer.client_servers = client_servers(request.mcp_servers)
        chat = await Chat.start(
            runner, request.agent, resume=request.resume, on_text=lambda t: send(writer, {"text": t})
        )
        sink.targets.insert(0, chat.observe)
        key = secrets.token_hex(16)
        service.chats[key] = chat
        window = chat.handle.host.context_window
        send(writer, {"started": {"label": chat.label, "workspace": str(chat.workspace), "key": key, "window": window}})
        talk.on_op = ops = ChatOps(chat, writer)
        await listener  # until the client goes: its ops run meanwhile
        for waits in list(ops.waiting):
            waits.cancel()
        for task in list(ops.running):
            await task
        await chat.close()  # its background sub-agents end with it, as when a chat's process ends
        service.chats.pop(key, None)
    except SubagentError as exc:
        send(writer, {"error": str(exc)})
    finally:
        listener.cancel()
        client.connected = False
        for runner in client.runners:
            await runner.close()
        service.clients.remove(client)
        await drain(writer)


def interrupt(chat: Chat | None, reason: str) -> None:
    """Ctrl-C or the client's end: stop the turn running now (the chat's background sub-agents run on
    until it ends)."""
    if chat is not None:
        chat.interrupt(reason)


async def serve_control(
    service: Service, hello: Hello, lines: AsyncIterator[str | Oversized], writer: asyncio.StreamWriter
) -> None:
    """A chat's quick calls, answered one by one; only with the key its chat connection was given."""
    chat = service.chats.get(hello.key or "")
    if chat is None:
        send(writer, {"error": "no chat has this key"})
        return
    send(writer, {"ok": True})
    async for line in lines:
        message = load(line) if isinstance(line, str) else None
        name = (message or {}).get("call")
        if name not in CHAT_CALLS:
            send(writer, {"error": f"unknown call {name!r}", "type": "SubagentError"})
        else:
            send(writer, quick_call(chat, str(name), list((message or {}).get("args") or [])))
        await drain(writer)


def quick_call(chat: Chat, name: str, args: list[Any]) -> dict[str, Any]:
    try:
        value = getattr(chat, name)
        value = value(*args) if callable(value) else value
    except SubagentError as exc:
        return {"error": str(exc), "type": type(exc).__name__}
    return {"value": dumped(value)}


def dumped(value: Any) -> Any:
    """A value as JSON: models dumped, tuples as lists, handles as their status."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (list, tuple)):
        return [dumped(v) for v in value]
    if hasattr(value, "snapshot"):
        return value.snapshot().model_dump(mode="json")
    if isinstance(value, Path):
        return str(value)
    return value


__all__ = ["serve"]
