"""The terminal front end of `subagent chat`: a prompt line, the reply streamed as it is generated,
tool calls and the sub-agents' progress as they happen (`render.EventLines`), the slash commands,
and the signals. The conversation is `chat.Chat`.

The event loop never waits on the keyboard (`promptline.PromptLine` reads in a thread), so background
sub-agents work while the user types, and their lines and notices print above the prompt. Ctrl-C
stops the current turn; pressed again, it stops the background sub-agents too (see `ChatLoop`).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from rich.console import Console
from rich.markup import escape
from rich.rule import Rule

from ..errors import SubagentError
from ..events import EventSink, Fanout
from ..render import tasks_table
from ..results import RunResult
from ..runs.chat import DEFAULT_CHAT_AGENT, INTERRUPTED, Chat
from ..runs.runner import Runner
from ..text import NO_ANSWER
from ..tools import kill_all_processes
from .asking import TerminalPerson
from .chat_view import ChatView, ReplyStream
from .interrupts import EXIT_INTERRUPTED, STOP_SIGNALS, stop_reason, two_press_sigint
from .promptline import PromptLine

T = TypeVar("T")
PROMPT = "> "
COMMANDS = {
    "/agents": "list the agents the parent can delegate to",
    "/usage": "tokens, context and KV cache of this chat and its sub-agents",
    "/compact": "summarise the conversation so far, to free context",
    "/think": "show the last reply's reasoning in full (the chat shows it folded)",
    "/workflow": '/workflow NAME INPUT (or {"steps": [...]}): run a workflow as the parent\'s sub-agents; it reads their answers next',
    "/tasks": "the sub-agents running in the background: id, agent, status, turn, tokens, last tool, time",
    "/send": "/send ID TEXT: a message to a background sub-agent (read at its next turn, or it resumes)",
    "/cancel": "/cancel ID: stop a background sub-agent (its bash commands are killed)",
    "/wake": "/wake on|off: whether a background sub-agent's end starts the parent's next turn (on)",
    "/help": "this list",
    "/exit": "leave the chat (also Ctrl-D)",
}


def run_chat(
    make_runner: Callable[[EventSink], Runner],
    *,
    agent: str = DEFAULT_CHAT_AGENT,
    once: str | None = None,
    resume: str | None = None,
    wake: bool = True,
    out: Console,
    err: Console,
) -> int:
    """Run the chat on this terminal (or one turn with `once`); returns the exit code.

    Args:
        make_runner: the command's runner, given the event sink it reports to.
        wake: a background sub-agent's end starts the parent's next turn when it waits for nothing else.

    Errors that stop the chat before it starts (unknown agent, bad run id) are raised.
    """

    def start(sink: EventSink, on_text: Any) -> tuple[Runner, Awaitable[Chat]]:
        runner = make_runner(sink)
        return runner, Chat.start(runner, agent, resume=resume, on_text=on_text)

    return drive_chat(start, once=once, wake=wake, out=out, err=err)


def drive_chat(
    start: Callable[[EventSink, Any], tuple[Any, Awaitable[Any]]],
    *,
    once: str | None,
    out: Console,
    err: Console,
    wake: bool = True,
) -> int:
    """The chat's terminal over what `start(sink, on_text)` gives: what to close at the end (a runner,
    or a server's connection) and the chat starting (a `Chat`, or the same calls on a server)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    stream = ReplyStream(out.file) if once is None else None
    view = ChatView(err, stream)
    sink = Fanout([view.handle])
    runner, starting = start(sink, stream)
    try:
        chat = _interruptible(loop, starting, None, err)
        chat.wake = wake
        sink.targets.insert(0, chat.observe)
        view.parent, view.in_background = chat.label, chat.in_background
        if once is not None:
            return _once(loop, chat, once, out, err)
        return loop.run_until_complete(ChatLoop(chat, view, out, err).run())
    finally:
        loop.run_until_complete(runner.close())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
        asyncio.set_event_loop(None)
        loop.close()


def _once(loop: asyncio.AbstractEventLoop, chat: Any, message: str, out: Console, err: Console) -> int:
    try:
        result = _interruptible(loop, chat.turn(message), chat, err)
    finally:
        loop.run_until_complete(chat.close())  # background sub-agents end with the chat
    if result.output and result.status != "aborted":
        out.print(result.output, markup=False)
    _report_end(result, err, interactive=False)
    err.print(f"[dim]{escape(chat.usage_lines()[0])}[/]")
    _saved(chat, err)
    if result.status == "aborted":
        return EXIT_INTERRUPTED
    return 0 if result.ok else 1


class ChatLoop:
    """The interactive chat: prompt, turns and slash commands on one event loop that never blocks.

    Signals stay wired for the whole chat. Ctrl-C during a turn stops that turn and the sub-agents it
    waits for; background sub-agents run on until a second press (or a press at the prompt) stops
    them; with none running, the second press quits at once. Leaving the chat cancels the background
    sub-agents still running and waits until they are saved. SIGTERM and SIGHUP stop everything,
    save, and exit with 128 + the signal's number.
    """

    def __init__(self, chat: Chat, view: ChatView, out: Console, err: Console) -> None:
        self.chat = chat
        self.view = view
        self.out = out
        self.err = err
        self.prompt = PromptLine(PROMPT)
        # The MCP servers' questions come to the person here, on the same prompt line.
        self.person = TerminalPerson(self.prompt, view.show)
        if isinstance(chat, Chat):  # an attached chat's runner is the server's: it declines, saying why
            chat.runner.person = self.person
        self.work: asyncio.Future[Any] | None = None  # the turn (or command) running now
        self.presses = 0  # Ctrl-C presses during `work`
        self.terminated: signal.Signals | None = None
        self.main: asyncio.Task[Any] | None = None

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.main = asyncio.current_task()
        self.view.prompt = self.prompt
        self.err.print(
            f"[dim]chat with {escape(self.chat.label)} in {escape(str(self.chat.workspace))}; "
            "/help for commands, Ctrl-C stops a turn, /exit leaves[/]"
        )
        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, self.on_signal, signum)
        try:
            await self.lines()
        except asyncio.CancelledError:
            if self.terminated is None:
                raise
        finally:
            self.view.prompt = None
            self.prompt.restore_terminal()
            if alive := self.chat.alive():
                self.err.print(f"[yellow]stopping {len(alive)} background sub-agent(s): {escape(', '.join(alive))}[/]")
            await self.chat.close()  # Ctrl-C stays wired while they stop and save
            for signum in STOP_SIGNALS:
                loop.remove_signal_handler(signum)
        _saved(self.chat, self.err)
        if self.terminated is not None:
            raise SystemExit(128 + self.terminated)
        return 0

    async def lines(self) -> None:
        """Read and act on lines until /exit, Ctrl-D or a stop signal."""
        while self.terminated is None:
            try:
                line = await self.next_line()
            except EOFError:
                self.out.print()
                return
            if not line.strip():
                continue
            if line.startswith("/"):
                if not await self.command(line):
                    return
            else:
                await self.turn(line)

    async def next_line(self) -> str:
        """The person's next line. Meanwhile, when a background sub-agent ends and the parent waits for
        nothing else (no turn runs, nothing is typed), its notice starts the parent's next turn, as `run`
        goes on from its children's ends; `/wake off` (or `--no-wake`) waits for the person instead."""
        while True:
            read = asyncio.ensure_future(self.prompt.read())
            if not self.chat.wake:
                return await read
            ended = asyncio.ensure_future(self.chat.child_ended())
            try:
                done, _ = await asyncio.wait({read, ended}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                ended.cancel()
            if read in done:
                return read.result()
            read.cancel()  # the read stays pending in the prompt line: the next one gets the person's line
            message = None if self.prompt.typed() else self.chat.wake_message()
            if message is None:  # the person is typing: the notice goes with their message
                return await self.prompt.read()
            await self.woken(message)

    async def woken(self, message: str) -> None:
        """The parent's turn on its children's notices, the prompt taken down meanwhile and put back after."""
        with self.prompt.above():
            self.view.prompt = None  # the turn's lines go where a turn's always go, the prompt is back after
            try:
                self.err.print("[dim]the parent goes on from the notice (/wake off waits for your message)[/]")
                await self.turn(message, woken=True)
            finally:
                self.view.prompt = self.prompt

    async def turn(self, line: str, *, woken: bool = False) -> None:
        try:
            result = await self.run_work(self.chat.wake_turn(line) if woken else self.chat.turn(line))
        except SubagentError as exc:
            self.err.print(f"[red]error:[/] {escape(str(exc))}")
            return
        except asyncio.CancelledError:
            self.err.print("[yellow]interrupted[/]")
            return
        stream = self.view.stream
        if stream is not None and stream.wrote:
            stream.end_line()
        elif result.output and result.status != "aborted":
            self.out.print(result.output, markup=False)
        _report_end(result, self.err, interactive=True)

    async def run_work(self, work: Awaitable[T]) -> T:
        """Await a turn or a command as the chat's current work, which Ctrl-C stops."""
        self.presses = 0
        self.work = asyncio.ensure_future(work)
        try:
            return await self.work
        finally:
            self.work = None

    async def command(self, line: str) -> bool:
        """Run a slash command; False for /exit."""
        name, _, rest = line.strip().partition(" ")
        name, out, err, chat = name.lower(), self.out, self.err, self.chat
        if name in ("/exit", "/quit"):
            return False
        if name == "/usage":
            for text in chat.usage_lines():
                out.print(text, markup=False)
        elif name == "/agents":
            for text in chat.agent_lines():
                out.print(text, markup=False)
        elif name == "/compact":
            await self.compact_command()
        elif name == "/workflow":
            await self.workflow_command(rest.strip())
        elif name == "/think":
            out.print(chat.last_reasoning or "(no reasoning in the last reply)", markup=False, style="dim")
        elif name in ("/tasks", "/send", "/cancel"):
            self.task_command(name, rest.strip())
        elif name == "/wake":
            self.wake_command(rest.strip())
        elif name == "/help":
            for command, text in COMMANDS.items():
                out.print(f"{command:<10} {text}")
        else:
            err.print(
                f"[red]unknown command {escape(name)}[/]; commands: {', '.join(COMMANDS)} "
                "(start a message with a space to send a leading '/')"
            )
        return True

    async def compact_command(self) -> None:
        """`/compact`: the conversation summarised as the chat's current work (Ctrl-C leaves it as it was)."""
        try:
            done = await self.run_work(self.chat.compact())
        except asyncio.CancelledError:
            self.err.print("[yellow]compaction interrupted; nothing changed[/]")
            return
        self.out.print(f"compacted: {done[0]:,} -> {done[1]:,} tokens" if done else "nothing to compact yet")

    async def workflow_command(self, rest: str) -> None:
        """`/workflow NAME INPUT`: a workflow run as the parent's sub-agents, each step's answer shown."""
        flow, _, text = rest.partition(" ")
        try:
            outcome = await self.run_work(self.chat.workflow(flow, text.strip()))
        except asyncio.CancelledError:
            self.err.print("[yellow]workflow interrupted; what its steps had done is saved[/]")
            return
        except SubagentError as exc:
            self.err.print(f"[red]{escape(str(exc))}[/]")
            return
        for result in outcome.results:
            rule = f"step {escape(str(result.step_id))} ({result.agent}) · {result.status}"
            self.out.print(Rule(rule, align="left", style="dim"))
            self.out.print(result.output or NO_ANSWER, markup=False)
        self.out.print(
            f"{outcome.succeeded}/{outcome.total} steps completed; the parent reads their answers next", style="dim"
        )

    def wake_command(self, rest: str) -> None:
        """`/wake on|off`: whether a background sub-agent's end starts the parent's next turn; alone, says which."""
        if rest.lower() in ("on", "off"):
            self.chat.wake = rest.lower() == "on"
        elif rest:
            self.err.print(f"[red]usage: /wake on|off[/] (got {escape(rest)})")
            return
        self.out.print(
            "a background sub-agent's end starts the parent's next turn"
            if self.chat.wake
            else "the parent waits for your message when a background sub-agent ends"
        )

    def task_command(self, name: str, rest: str) -> None:
        """`/tasks`, `/send ID TEXT`, `/cancel ID`; a mistake (an unknown id, a cancelled task) is one red line."""
        task_id, _, text = rest.partition(" ")
        try:
            if name == "/tasks":
                rows = self.chat.tasks()
                if rows:
                    self.out.print(tasks_table(rows))
                else:
                    self.out.print("no background sub-agents yet (the parent starts them with background: true)")
            elif not task_id or (name == "/send" and not text.strip()):
                usage = "/send ID TEXT" if name == "/send" else "/cancel ID"
                known = ", ".join(t.id for t in self.chat.background()) or "none yet"
                self.err.print(f"[red]usage: {usage}[/] (background sub-agents: {escape(known)})")
            elif name == "/cancel":
                self.out.print(f"cancelling {self.chat.cancel_task(task_id)}", markup=False)
            elif self.chat.send_to(task_id, text.strip()):
                self.out.print(f"sent to {task_id}: it reads it at its next turn", markup=False)
            else:
                self.out.print(f"sent to {task_id}: it resumes with it", markup=False)
        except SubagentError as exc:
            self.err.print(f"[red]{escape(str(exc))}[/]")

    # -- signals ---------------------------------------------------------------------------------------

    def on_signal(self, signum: signal.Signals) -> None:
        """Ctrl-C: during a turn, the first press stops it, the second also stops the background
        sub-agents (or quits when there are none), the third quits; at the prompt, it stops the
        background sub-agents."""
        if signum != signal.SIGINT:
            self.terminate(signum)
            return
        alive = self.chat.alive()
        if self.work is None:
            if alive:
                self.stop_background()
            else:
                self.view.show("[dim](Ctrl-C stops a running turn; /exit or Ctrl-D leaves)[/]")
            return
        self.presses += 1
        if self.presses == 1:
            more = (
                f"; {len(alive)} background sub-agent(s) run on (Ctrl-C again stops them too)"
                if alive
                else " (Ctrl-C again to quit at once)"
            )
            self.err.print(f"\n[yellow]interrupted: stopping this turn and the sub-agents it waits for{more}[/]")
            self.person.interrupt()
            self.stop_work()
        elif self.presses == 2 and alive:
            self.stop_background()
        else:
            kill_all_processes()
            os._exit(EXIT_INTERRUPTED)

    def stop_background(self) -> None:
        ids = self.chat.stop_background()
        if ids:
            self.view.show(f"[yellow]stopping {len(ids)} background sub-agent(s): {escape(', '.join(ids))}[/]")

    def terminate(self, signum: signal.Signals) -> None:
        """SIGTERM or SIGHUP: stop every task (a second one exits at once); the chat ends once they are saved."""
        kill_all_processes()
        if self.terminated is not None:
            os._exit(128 + signum)
        self.terminated = signum
        try:
            if self.work is None:  # the chat ends from its prompt: off the screen, not drawn again
                self.view.prompt = None
                self.prompt.take_down()
            self.view.show(f"[yellow]{signum.name} received: stopping every task[/]")
        except OSError:  # SIGHUP: the terminal may be gone
            pass
        reason = stop_reason(signum)
        self.chat.stop_background(reason)
        if self.work is not None:
            self.stop_work(reason)
        elif self.main is not None:
            self.main.cancel()  # waiting at the prompt

    def stop_work(self, reason: str = INTERRUPTED) -> None:
        if self.work is not None and not self.chat.interrupt(reason):
            self.work.cancel()


def _interruptible(loop: asyncio.AbstractEventLoop, work: Awaitable[T], chat: Chat | None, err: Console) -> T:
    """Run `work` with Ctrl-C wired: the first press stops the turn (or `work`), the second quits."""
    task = loop.create_task(_await(work))

    def stop(reason: str) -> None:
        if chat is None or not chat.interrupt(reason):
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


__all__ = ["ChatLoop", "drive_chat", "run_chat"]
