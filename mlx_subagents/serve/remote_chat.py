"""A chat on the server (`subagent serve`), with `runs.chat.Chat`'s calls: the front ends' side of it.

`RemoteChat` has what a chat's front end asks of a `Chat` (the terminal's `ChatLoop`, an editor's
session), done on the server: the slow calls (a turn, `/workflow`, `/compact`, the end) over the
chat's connection, which also brings the reply as it streams, the events, the consent questions and
an editor's requests (given to `on_message`, the front end's); the quick ones (`/tasks`, `/usage`,
an interrupt, ...) over a second, blocking connection, so that they answer at once and exactly, as
the local `Chat`'s do.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import errors
from ..errors import SubagentError
from ..events import Event
from ..host.protocol import TextCallback
from ..results import MultiRunResult, RunResult, TaskStatus
from .client import Connection, ServerGone, connect, read_answer
from .state import ServerInfo
from .wire import dump


class RemoteChat:
    """A chat on the server, with `Chat`'s calls; `start()` it in the event loop that drives it."""

    def __init__(
        self,
        info: ServerInfo,
        hello: Any,
        on_text: TextCallback | None,
        on_message: Callable[[Connection, dict[str, Any]], None],
    ) -> None:
        self.info = info
        self.hello = hello
        self.on_text = on_text
        self.on_message = on_message  # the rest: warnings, events, consent questions (the front end's)
        self.label = ""
        self.workspace = Path(".")
        self.connection: Connection | None = None
        self._control: Any = None
        self._started: asyncio.Future[dict[str, Any]] | None = None
        self._ops: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)
        self._reader: asyncio.Task[None] | None = None
        self.wake = True  # a background child's end starts the parent's next turn (`/wake`), as in `Chat`
        self._child_ended: asyncio.Future[Any] | None = None

    # -- the connection -------------------------------------------------------------------------

    async def start(self) -> RemoteChat:
        """Connect, start the chat there (its model loaded, its consent asked here), open the quick line."""
        self.connection = await connect(self.info, self.hello)
        self._started = asyncio.get_running_loop().create_future()
        self._reader = asyncio.ensure_future(self._read())
        started = await self._started
        self.label, self.workspace = started["label"], Path(started["workspace"])
        self.window = int(started.get("window") or 0)
        self._control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._control.connect(self.info.socket)
        hello = self.hello.model_copy(update={"hello": "control", "key": started["key"], "chat": None})
        self._control.sendall(dump(hello.model_dump(mode="json", by_alias=True, exclude_none=True)))
        self._file = self._control.makefile("rb")
        read_answer(self._file, self.info)
        return self

    async def _read(self) -> None:
        assert self.connection is not None and self._started is not None
        try:
            while (message := await self.connection.next()) is not None:
                self._dispatch(message)
        finally:
            gone = self._gone()
            for waiting in [self._started, *self._ops.values()]:
                if not waiting.done():
                    waiting.set_exception(gone)

    def _gone(self) -> ServerGone:
        return ServerGone(f"the server (pid {self.info.pid}) went away; the chat is saved as far as it got")

    def _dispatch(self, message: dict[str, Any]) -> None:
        assert self._started is not None
        if "text" in message:
            if self.on_text is not None:
                self.on_text(str(message["text"]))
        elif "started" in message:
            self._started.set_result(message["started"])
        elif "done" in message:
            waiting = self._ops.pop(message["done"], None)
            if waiting is not None and not waiting.done():
                if "error" in message:
                    waiting.set_exception(raised(message))
                else:
                    waiting.set_result(message.get("value"))
        elif "error" in message and not self._started.done():
            self._started.set_exception(SubagentError(str(message["error"])))
        else:
            self.on_message(self.connection, message)  # type: ignore[arg-type]

    async def _op(self, op: str, **fields: Any) -> Any:
        assert self.connection is not None
        if self._reader is None or self._reader.done():
            raise self._gone()
        n = next(self._ids)
        self._ops[n] = waiting = asyncio.get_running_loop().create_future()
        self.connection.send({"op": op, "id": n, **fields})
        return await waiting

    def _call(self, name: str, *args: Any) -> Any:
        """A quick call on the control connection, answered at once."""
        try:
            self._control.sendall(dump({"call": name, "args": list(args)}))
            answer = read_answer(self._file, self.info)
        except OSError as exc:
            raise ServerGone(f"the server (pid {self.info.pid}) did not answer: {exc}") from None
        if "error" in answer:
            raise raised(answer)
        return answer.get("value")

    async def close(self) -> None:
        """End the chat there: its background sub-agents stop and are saved (the chat stays readable)."""
        if self._reader is not None and not self._reader.done():
            try:
                await self._op("close")
            except SubagentError:
                pass

    async def disconnect(self) -> None:
        """Close both connections (the server then lets the chat go)."""
        if self.connection is not None:
            self.connection.close()
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._reader is not None:
            self._reader.cancel()

    # -- `Chat`'s calls -----------------------------------------------------------------------------

    async def turn(self, message: str) -> RunResult:
        return RunResult.model_validate(await self._op("turn", message=message))

    async def workflow(self, name: str, input: str) -> MultiRunResult:
        return MultiRunResult.model_validate(await self._op("workflow", name=name, input=input))

    async def compact(self) -> tuple[int, int] | None:
        done = await self._op("compact")
        return (done[0], done[1]) if done else None

    async def child_ended(self) -> None:
        """Wait until a background child's notice waits for the parent on the server. One wait there at a
        time: the terminal stops waiting whenever the person types, and waits again after."""
        if self._child_ended is None or self._child_ended.done():
            self._child_ended = asyncio.ensure_future(self._op("child_ended"))
        await asyncio.shield(self._child_ended)

    def wake_message(self) -> str | None:
        """The notices waiting for the parent, taken on the server (None: waking is off, or none waits)."""
        return self._call("wake_message") if self.wake else None

    async def wake_turn(self, message: str) -> RunResult:
        return RunResult.model_validate(await self._op("wake_turn", message=message))

    def observe(self, event: Event) -> None:
        """The server's chat counts its sub-agents' work itself."""

    @property
    def run_id(self) -> str | None:
        return self._call("run_id") if self._control is not None else None

    @property
    def last_reasoning(self) -> str:
        return self._call("last_reasoning")

    def interrupt(self, reason: str = "aborted by the user (Ctrl-C)") -> bool:
        return bool(self._call("interrupt", reason))

    def alive(self) -> list[str]:
        return list(self._call("alive"))

    def tasks(self) -> list[TaskStatus]:
        return [TaskStatus.model_validate(t) for t in self._call("tasks")]

    def background(self) -> list[TaskStatus]:
        return [TaskStatus.model_validate(t) for t in self._call("background")]

    def in_background(self, label: str) -> bool:
        return bool(self._call("in_background", label))

    def cancel_task(self, task_id: str) -> str:
        return str(self._call("cancel_task", task_id))

    def send_to(self, task_id: str, message: str) -> bool:
        return bool(self._call("send_to", task_id, message))

    def stop_background(self, reason: str = "cancelled by the user") -> list[str]:
        return list(self._call("stop_background", reason))

    def usage_lines(self) -> list[str]:
        return list(self._call("usage_lines"))

    def agent_lines(self) -> list[str]:
        return list(self._call("agent_lines"))


def raised(message: dict[str, Any]) -> BaseException:
    """The exception the server's answer names: the same `SubagentError` class, or a cancellation."""
    if message.get("type") == "CancelledError":
        return asyncio.CancelledError()
    kind = getattr(errors, str(message.get("type")), SubagentError)
    kind = kind if isinstance(kind, type) and issubclass(kind, SubagentError) else SubagentError
    return kind(str(message.get("error")))


__all__ = ["RemoteChat", "raised"]
