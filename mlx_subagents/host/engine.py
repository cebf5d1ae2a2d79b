"""The engine thread: the one place where mlx runs.

mlx streams are per thread (an array or cache made on one thread fails on
another), so every mlx call is a job on this thread. Async callers submit a
job and await its result; jobs run one at a time, in order, which is what
serializes model calls. A failing job hands its exception to its own caller
and the engine keeps going.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

T = TypeVar("T")


@dataclass
class _Job:
    fn: Callable[[], Any]
    deliver: Callable[[bool, Any], None]


class Engine:
    """A single worker thread running submitted callables in FIFO order."""

    def __init__(self, name: str = "mlx-engine") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def stop(self) -> None:
        """Finish queued jobs, then end the thread."""
        if self._started and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    async def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread and await its result (or exception)."""
        if not self._started:
            raise RuntimeError("the model host is not started; use `async with host:`")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if future.done():
                return
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

        def deliver(ok: bool, value: Any) -> None:
            try:
                loop.call_soon_threadsafe(settle, ok, value)
            except RuntimeError:  # the caller's loop is closed: nobody is waiting
                pass

        self._jobs.put(_Job(fn, deliver))
        return await future

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                result = job.fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                job.deliver(False, exc)
            else:
                job.deliver(True, result)
