"""`subagent chat`: a person talks with a parent agent that delegates through the `subagent` tool.

`Chat` is the conversation, without a terminal: one `AgentSession` kept across turns (its KV
cache is reused turn after turn), saved as a run like any other (`subagent show`, `subagent resume`
and `subagent chat --resume` work on it), and `interrupt()` for Ctrl-C, which aborts the current
turn and its sub-agents but keeps the chat. `run_chat` is the terminal front end: a prompt line,
the reply streamed as it is generated, tool calls and the children's progress as they happen, and
the slash commands.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TextIO, TypeVar

from rich.console import Console
from rich.markup import escape

from .caps import CapItem, check_request
from .errors import RequestError, RunNotFoundError, SubagentError
from .events import Event, EventSink
from .execution import INTERRUPTED
from .host.protocol import TextCallback
from .interrupts import EXIT_INTERRUPTED, two_press_sigint
from .results import RunResult, RunUsage
from .runner import Runner, close_open_tool_calls
from .session import AgentSession, system_prompt
from .transcripts import RunRecord, RunRecorder, TaskEntry, TaskTranscript, load_run, read_transcript

T = TypeVar("T")
DEFAULT_CHAT_AGENT = "orchestrator"
PROMPT = "> "
COMMANDS = {
    "/agents": "list the agents the parent can delegate to",
    "/usage": "tokens, context and KV cache of this chat and its sub-agents",
    "/compact": "summarise the conversation so far, to free context",
    "/help": "this list",
    "/exit": "leave the chat (also Ctrl-D)",
}
TOOL_CALL_MARK = "<tool_call>"


class Chat:
    """One parent conversation across turns: its session, its transcript, its children's usage.

    Create with `await Chat.start(runner, agent)`; then `await chat.turn(message)` per message.
    """

    def __init__(
        self,
        runner: Runner,
        agent: str,
        *,
        label: str | None = None,
        model: str | None = None,
        on_text: TextCallback | None = None,
    ) -> None:
        self.runner = runner
        self.spec = runner.agent(agent)
        self.label = label or self.spec.name
        self.model = model
        self.on_text = on_text
        self.session: AgentSession | None = None
        self.record: RunRecord | None = None
        self.transcript: TaskTranscript | None = None
        self.n_children = 0
        self.children_usage = RunUsage()
        self._forward: EventSink = runner.on_event
        runner.on_event = self._child_event  # children report through the runner
        self._running: asyncio.Task[RunResult] | None = None
        self._interrupted = False

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
            chat = cls(runner, agent, on_text=on_text)
            await runner.host_for(runner.model_for(chat.spec))
            return chat
        record = load_run(resume, runner.home)
        entry = record.task(None)
        log = read_transcript(record.transcript_path(entry))
        if log.messages is None:
            raise RunNotFoundError(f"run {record.run_id} has no saved conversation to continue")
        chat = cls(runner, log.meta["agent"], label=entry.label, model=log.meta.get("model"), on_text=on_text)
        chat.record = record
        chat.transcript = TaskTranscript(log.path, generation=log.generations)
        chat.session = await chat._open_session()
        chat.session.messages = close_open_tool_calls(log.messages)
        return chat

    @property
    def run_id(self) -> str | None:
        return self.record.run_id if self.record else None

    # -- turns ------------------------------------------------------------------------------------------

    async def turn(self, message: str) -> RunResult:
        """Send one message; the parent answers, delegating as it sees fit. Saved when it ends.

        An `interrupt()` ends the turn with an aborted result (what was done is kept); the chat goes on.
        """
        if not message.strip():
            raise RequestError("the message is empty; type what the agent should do")
        check_request([CapItem(self.label, message, self.spec)])
        session = await self._begin(message)
        self._interrupted = False
        self._running = asyncio.ensure_future(session.follow_up(message, message))
        try:
            result = await self._running
        except asyncio.CancelledError:
            if not self._interrupted:  # cancelled from outside the chat: save, then propagate
                self._save(session.partial_result(message, "cancelled", INTERRUPTED))
                raise
            result = session.partial_result(message, "cancelled", INTERRUPTED)
        except Exception as exc:
            error = str(exc) if isinstance(exc, SubagentError) else f"{type(exc).__name__}: {exc}"
            result = session.partial_result(message, "error", error).model_copy(update={"status": "failed"})
        finally:
            self._running = None
        session.messages = close_open_tool_calls(session.messages)
        self._save(result)
        return result

    def interrupt(self) -> bool:
        """Abort the running turn and every sub-agent it started; False when no turn is running."""
        if self._running is None or self._running.done():
            return False
        self._interrupted = True
        self.runner.cancel()
        self._running.cancel()
        return True

    async def compact(self) -> tuple[int, int] | None:
        """Summarise everything but the last reply now: `(tokens_before, tokens_after)`, or None
        when there is nothing to summarise yet."""
        if self.session is None:
            return None
        before = await self.session.host.count_tokens(self.session.messages, self.session.schemas)
        if not await self.session.compact(keep_recent_tokens=0):
            return None
        if self.transcript is not None:
            self.transcript.write("messages", messages=self.session.messages)
        return before, self.session.usage.context_tokens

    # -- reports ----------------------------------------------------------------------------------------

    def usage_lines(self) -> list[str]:
        u = self.session.usage if self.session else RunUsage()
        window = self.session.host.context_window if self.session else 0
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

    # -- internals --------------------------------------------------------------------------------------

    async def _open_session(self) -> AgentSession:
        return await self.runner.open_session(
            self.spec.name,
            label=self.label,
            model=self.model,
            children_home=self.record.folder if self.record else None,
            on_event=self._parent_event,
            on_text=self.on_text,
        )

    async def _begin(self, message: str) -> AgentSession:
        """The session for this turn; the first turn of a new chat creates the run and the session."""
        if self.session is not None:
            if self.transcript is not None:
                self.transcript.generation += 1
                self.transcript.follow_up(message)
            return self.session
        if self.runner.save_transcripts:
            entry = TaskEntry(index=0, label=self.label, agent=self.spec.name)
            recorder = RunRecorder("single", self.runner.workspace.root, [entry], self.runner.home)
            self.record = recorder.record
            self.transcript = recorder.transcript(0)
        session = self.session = await self._open_session()
        session.messages = [{"role": "system", "content": system_prompt(self.spec, session.workspace)}]
        if self.transcript is not None:
            self.transcript.start(
                run_id=self.run_id,
                label=self.label,
                step_id=None,
                agent=self.spec.name,
                model=session.host.model_id,
                cwd=str(session.workspace.root),
                task=message,
            )
        return session

    def _save(self, result: RunResult) -> None:
        if self.transcript is None or self.record is None or self.session is None:
            return
        self.transcript.finish(self.session.messages, result)
        self.record.tasks[0].status = result.status
        self.record.status = "interrupted" if result.status == "aborted" else "finished"
        self.record.succeeded = int(result.ok)
        self.record.write()

    def _parent_event(self, event: Event) -> None:
        if self.transcript is not None:
            self.transcript.event(event)
        self._forward(event)

    def _child_event(self, event: Event) -> None:
        if event.kind == "task_end" and event.label.startswith(f"{self.label} > "):
            self.n_children += 1
            if "usage" in event.data:
                self.children_usage = self.children_usage.add(RunUsage(**event.data["usage"]))
        self._forward(event)


# --- the terminal front end ---------------------------------------------------------------------------


class ReplyStream:
    """Writes the parent's reply as it is generated, hiding tool-call markup (shown as events)."""

    def __init__(self, file: TextIO) -> None:
        self.file = file
        self.reset()
        self.dirty = False

    def reset(self) -> None:
        self.pending = ""
        self.hidden = False
        self.started = False
        self.wrote = False

    def __call__(self, text: str) -> None:
        if self.hidden:
            return
        text = self.pending + text
        at = text.find(TOOL_CALL_MARK)
        if at >= 0:
            self._write(text[:at])
            self.hidden, self.pending = True, ""
            return
        keep = next(
            (n for n in range(min(len(text), len(TOOL_CALL_MARK) - 1), 0, -1) if TOOL_CALL_MARK.startswith(text[-n:])),
            0,
        )
        self._write(text[: len(text) - keep])
        self.pending = text[len(text) - keep :]

    def flush(self) -> None:
        """The generation ended: what was held back was not markup after all."""
        if not self.hidden:
            self._write(self.pending)
        self.pending = ""

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
    """Renders the parent's tool calls and its children's progress (indented) on stderr."""

    def __init__(self, err: Console, stream: ReplyStream | None) -> None:
        self.err = err
        self.stream = stream
        self.parent = ""

    def handle(self, event: Event) -> None:
        if event.label == self.parent:
            self._parent(event)
        elif self.parent and event.label.startswith(f"{self.parent} > "):
            self._child(event)

    def _parent(self, event: Event) -> None:
        stream = self.stream
        if event.kind == "turn_start" and stream is not None:
            stream.end_line()
            stream.reset()
        elif event.kind == "usage" and stream is not None:
            stream.flush()
        elif event.kind == "tool_call":
            self._line(f"[cyan]▸ {escape(event.data['description'])}[/]")
        elif event.kind == "tool_result" and event.data.get("is_error"):
            self._line(f"  [red]{escape(_first_line(event.data['output']))}[/]")
        elif event.kind == "compaction":
            self._line(f"[yellow]compacted {event.data['tokens_before']:,} -> {event.data['tokens_after']:,} tokens[/]")

    def _child(self, event: Event) -> None:
        path = event.label[len(self.parent) + 3 :]
        indent = "  " * (path.count(" > ") + 1)
        if event.kind == "task_start":
            self._line(f"{indent}[dim]↳ {escape(path)} ({event.agent}) started[/]")
        elif event.kind == "tool_call":
            self._line(f"{indent}  [dim]{escape(path)}:[/] [cyan]{escape(event.data['description'])}[/]")
        elif event.kind == "task_end":
            data = event.data
            turns = data.get("usage", {}).get("turns", 0)
            if data.get("status") == "completed":
                self._line(f"{indent}[green]✓ {escape(path)} completed[/] [dim]({turns} turns)[/]")
            else:
                reason = data.get("error") or data.get("stop_reason", "")
                style = "yellow" if data.get("status") == "aborted" else "red"
                self._line(f"{indent}[{style}]✗ {escape(path)} {data.get('status')}: {escape(str(reason))}[/]")

    def _line(self, markup: str) -> None:
        if self.stream is not None:
            self.stream.end_line()
        self.err.print(markup)


def _first_line(text: str) -> str:
    return text.splitlines()[0][:200] if text else ""


def run_chat(
    runner: Runner,
    *,
    agent: str = DEFAULT_CHAT_AGENT,
    once: str | None = None,
    resume: str | None = None,
    out: Console,
    err: Console,
) -> int:
    """Run the chat on this terminal (or one turn with `once`); returns the exit code.

    Errors that stop the chat before it starts (unknown agent, bad run id) are raised.
    """
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    stream = ReplyStream(out.file) if once is None else None
    view = ChatView(err, stream)
    runner.on_event = view.handle
    try:
        chat = _interruptible(loop, Chat.start(runner, agent, resume=resume, on_text=stream), None, err)
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


__all__ = ["Chat", "ChatView", "ReplyStream", "run_chat", "DEFAULT_CHAT_AGENT"]
