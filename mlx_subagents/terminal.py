"""The terminal front end of `subagent chat`: a prompt line, the reply streamed as it is generated,
tool calls and the sub-agents' progress as they happen (`render.EventLines`), the slash commands,
and Ctrl-C (the first press stops the turn, the second quits). The conversation is `chat.Chat`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TextIO, TypeVar

from rich.console import Console
from rich.markup import escape

from .chat import DEFAULT_CHAT_AGENT, Chat
from .errors import SubagentError
from .events import Event, EventSink, Fanout
from .interrupts import EXIT_INTERRUPTED, two_press_sigint
from .render import EventLines
from .results import RunResult
from .runner import Runner

T = TypeVar("T")
PROMPT = "> "
COMMANDS = {
    "/agents": "list the agents the parent can delegate to",
    "/usage": "tokens, context and KV cache of this chat and its sub-agents",
    "/compact": "summarise the conversation so far, to free context",
    "/think": "show the last reply's reasoning in full (the chat shows it folded)",
    "/help": "this list",
    "/exit": "leave the chat (also Ctrl-D)",
}


class ReplyStream:
    """Writes the parent's reply as it is generated (the host streams only visible text: tool calls
    show up as events), without the whitespace a reply may start with."""

    def __init__(self, file: TextIO) -> None:
        self.file = file
        self.reset()
        self.dirty = False

    def reset(self) -> None:
        """A new reply starts."""
        self.started = False
        self.wrote = False

    def __call__(self, text: str) -> None:
        self._write(text)

    def end_line(self) -> None:
        if self.dirty:
            self.file.write("\n")
            self.file.flush()
            self.dirty = False

    def _write(self, text: str) -> None:
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        if text:
            self.file.write(text)
            self.file.flush()
            self.wrote = True
            self.dirty = not text.endswith("\n")


class ChatView:
    """The chat's events on stderr (`EventLines`, chat layout), each line clear of the streamed reply."""

    def __init__(self, err: Console, stream: ReplyStream | None) -> None:
        self.stream = stream
        self.lines = EventLines(err, "chat", before_line=stream.end_line if stream is not None else None)
        self.thought = 0  # characters of reasoning streamed in the reply so far

    @property
    def parent(self) -> str:
        return self.lines.root

    @parent.setter
    def parent(self, label: str) -> None:
        self.lines.root = label

    def handle(self, event: Event) -> None:
        if event.label == self.parent and event.kind == "reasoning":
            self.thought += len(event.data["text"])
        if self.stream is not None and event.label == self.parent and event.kind == "turn_start":
            self.stream.end_line()
            self.stream.reset()
        if event.label == self.parent and event.kind in ("turn_start", "usage") and self.thought:
            # the reasoning folded to one dim line; `/think` unfolds it
            if self.lines.before_line is not None:
                self.lines.before_line()
            self.lines.console.print(f"[dim](thought: {self.thought:,} characters; /think shows it)[/]")
            self.thought = 0
        self.lines.handle(event)


def run_chat(
    make_runner: Callable[[EventSink], Runner],
    *,
    agent: str = DEFAULT_CHAT_AGENT,
    once: str | None = None,
    resume: str | None = None,
    out: Console,
    err: Console,
) -> int:
    """Run the chat on this terminal (or one turn with `once`); returns the exit code.

    Args:
        make_runner: the command's runner, given the event sink it reports to.

    Errors that stop the chat before it starts (unknown agent, bad run id) are raised.
    """
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    stream = ReplyStream(out.file) if once is None else None
    view = ChatView(err, stream)
    sink = Fanout([view.handle])
    runner = make_runner(sink)
    try:
        chat = _interruptible(loop, Chat.start(runner, agent, resume=resume, on_text=stream), None, err)
        sink.targets.insert(0, chat.observe)
        view.parent = chat.label
        if once is not None:
            return _once(loop, chat, once, out, err)
        _repl(loop, chat, view, out, err)
        return 0
    finally:
        loop.run_until_complete(runner.close())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
        asyncio.set_event_loop(None)
        loop.close()


def _once(loop: asyncio.AbstractEventLoop, chat: Chat, message: str, out: Console, err: Console) -> int:
    result = _interruptible(loop, chat.turn(message), chat, err)
    if result.output and result.status != "aborted":
        out.print(result.output, markup=False)
    _report_end(result, err, interactive=False)
    err.print(f"[dim]{escape(chat.usage_lines()[0])}[/]")
    _saved(chat, err)
    if result.status == "aborted":
        return EXIT_INTERRUPTED
    return 0 if result.ok else 1


def _repl(loop: asyncio.AbstractEventLoop, chat: Chat, view: ChatView, out: Console, err: Console) -> None:
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass
    err.print(
        f"[dim]chat with {escape(chat.label)} in {escape(str(chat.runner.workspace.root))}; "
        "/help for commands, Ctrl-C stops a turn, /exit leaves[/]"
    )
    while True:
        try:
            line = input(PROMPT)
        except EOFError:
            out.print()
            break
        except KeyboardInterrupt:
            err.print("\n[dim](Ctrl-C stops a running turn; /exit or Ctrl-D leaves)[/]")
            continue
        if not line.strip():
            continue
        if line.startswith("/"):
            if not _command(loop, chat, line.split()[0].lower(), out, err):
                break
            continue
        try:
            result = _interruptible(loop, chat.turn(line), chat, err)
        except SubagentError as exc:
            err.print(f"[red]error:[/] {escape(str(exc))}")
            continue
        except asyncio.CancelledError:
            err.print("[yellow]interrupted[/]")
            continue
        if view.stream is not None and view.stream.wrote:
            view.stream.end_line()
        elif result.output and result.status != "aborted":
            out.print(result.output, markup=False)
        _report_end(result, err, interactive=True)
    _saved(chat, err)


def _command(loop: asyncio.AbstractEventLoop, chat: Chat, command: str, out: Console, err: Console) -> bool:
    """Run a slash command; False for /exit."""
    if command in ("/exit", "/quit"):
        return False
    if command == "/usage":
        for line in chat.usage_lines():
            out.print(line, markup=False)
    elif command == "/agents":
        for line in chat.agent_lines():
            out.print(line, markup=False)
    elif command == "/compact":
        try:
            done = _interruptible(loop, chat.compact(), None, err)
        except asyncio.CancelledError:
            err.print("[yellow]compaction interrupted; nothing changed[/]")
            return True
        out.print(f"compacted: {done[0]:,} -> {done[1]:,} tokens" if done else "nothing to compact yet")
    elif command == "/think":
        out.print(chat.last_reasoning or "(no reasoning in the last reply)", markup=False, style="dim")
    elif command == "/help":
        for name, text in COMMANDS.items():
            out.print(f"{name:<10} {text}")
    else:
        err.print(
            f"[red]unknown command {escape(command)}[/]; commands: {', '.join(COMMANDS)} "
            "(start a message with a space to send a leading '/')"
        )
    return True


def _interruptible(loop: asyncio.AbstractEventLoop, work: Awaitable[T], chat: Chat | None, err: Console) -> T:
    """Run `work` with Ctrl-C wired: the first press stops the turn (or `work`), the second quits."""
    task = loop.create_task(_await(work))

    def stop() -> None:
        if chat is None or not chat.interrupt():
            task.cancel()

    message = "\ninterrupted: stopping this turn and its sub-agents (Ctrl-C again to quit at once)"
    with two_press_sigint(loop, err, message, stop):
        return loop.run_until_complete(task)


async def _await(work: Awaitable[T]) -> T:
    return await work


def _report_end(result: RunResult, err: Console, *, interactive: bool) -> None:
    if result.status == "aborted":
        more = "; the chat goes on (/exit leaves)" if interactive else ""
        err.print(f"[yellow]turn interrupted: what was done is kept{more}[/]")
    elif not result.ok:
        err.print(f"[red]error:[/] {escape(result.error or result.stop_reason)}")


def _saved(chat: Chat, err: Console) -> None:
    if chat.run_id:
        err.print(f"[dim]saved as run {chat.run_id}; continue with: subagent chat --resume {chat.run_id}[/]")


__all__ = ["ChatView", "ReplyStream", "run_chat"]
