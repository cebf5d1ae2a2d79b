"""A tool's blocking work in a daemon thread: bounded in time, stoppable, never in the way of exit.

`asyncio.to_thread` would put it in the loop's default executor, whose threads the interpreter
joins at exit: one blocked read and the process cannot quit. Here every call gets its own daemon
thread. When the awaiting task is cancelled or the time limit passes, the call raises at once and
the thread is asked to stop: long loops call `checkpoint()`, which raises in a stopped thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from contextlib import suppress
from typing import Any, TypeVar

from ..deadlines import within
from ..errors import ToolError

T = TypeVar("T")

DEFAULT_TOOL_TIMEOUT = 60.0

_current = threading.local()


class ToolStopped(ToolError):
    """Raised inside a tool thread whose call was cancelled or timed out."""


def checkpoint() -> None:
    """Raise `ToolStopped` if the calling tool thread was asked to stop; a no-op elsewhere."""
    stop: threading.Event | None = getattr(_current, "stop", None)
    if stop is not None and stop.is_set():
        raise ToolStopped("the tool call was stopped")


def start_thread(fn: Callable[..., T], *args: Any, what: str, stop: threading.Event | None = None) -> asyncio.Future[T]:
    """`fn(*args)` started now in a new daemon thread; the running loop's future gets its result or
    exception (nobody waits once the loop is closed). `stop` is what `checkpoint()` reads there."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():  # the caller gave up already
            return
        future.set_result(value) if ok else future.set_exception(value)

    def target() -> None:
        _current.stop = stop
        try:
            ok, value = True, fn(*args)
        except BaseException as exc:  # handed to the awaiting task, which decides
            ok, value = False, exc
        with suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, ok, value)

    threading.Thread(target=target, name=f"tool {what}", daemon=True).start()
    return future


async def run_in_thread(fn: Callable[..., T], *args: Any, timeout: float, what: str) -> T:
    """`fn(*args)` in a new daemon thread; `ToolError` naming `what` after `timeout` seconds."""
    stop = threading.Event()
    future = start_thread(fn, *args, what=what, stop=stop)
    try:
        return await within(future, timeout)
    except asyncio.TimeoutError:
        raise ToolError(f"{what} took longer than {timeout:g}s and was stopped; narrow the request") from None
    finally:
        stop.set()
