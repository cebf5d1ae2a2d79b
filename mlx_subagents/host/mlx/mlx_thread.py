"""The mlx thread: the one place where mlx runs.

mlx streams are per thread (an array or cache made on one thread fails on
another), so every mlx call happens on this thread. Async callers submit a job
and await its result; jobs run one at a time, in order. Between jobs the
thread advances its `Stepper` (the scheduler's batched prefill and decode), so
replies of many sessions progress together. A failing job hands its
exception to its own caller, a failing step fails the stepper's work in flight, and the thread
keeps going either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
Deliver = Callable[[bool, Any], None]


def post(loop: asyncio.AbstractEventLoop, callback: Callable[..., Any], *args: Any) -> None:
    """Run `callback(*args)` on a caller's `loop`: the one way anything leaves the mlx thread for a
    caller (a job's result, a turn's outputs; a closed loop's caller is gone: nothing to tell)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)


class Stepper(Protocol):
    def has_work(self) -> bool: ...

    def step(self) -> Any:
        """One unit of work; it hands its callers what it produced itself and returns it."""
        ...

    def fail_all(self, exc: BaseException) -> None:
        """A step raised: end every piece of work in flight with `exc`, so no caller waits forever."""
        ...


@dataclass
class _Job:
    fn: Callable[[Deliver], None]
    deliver: Deliver


class MlxThread:
    """A single worker thread: runs submitted jobs in FIFO order, steps the scheduler between them."""

    def __init__(self, name: str = "mlx") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False
        self.stepper: Stepper | None = None

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def stop(self) -> None:
        """Finish queued jobs, then end the thread."""
        if self._started and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    async def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the mlx thread and await its result (or exception)."""

        def job(deliver: Deliver) -> None:
            deliver(True, fn())

        return await self.run_deferred(job)

    async def run_deferred(self, fn: Callable[[Deliver], None]) -> Any:
        """Run `fn(deliver)` on the mlx thread; the result is whatever it (later) delivers."""
        return await self.submit(fn)

    def submit(self, fn: Callable[[Deliver], None]) -> asyncio.Future[Any]:
        """Queue `fn(deliver)`; the future gets what it delivers. A caller that must still learn the
        result after being cancelled awaits it through `asyncio.shield`."""
        if not self._started:
            raise RuntimeError("the model host is not started; use `async with host:`")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not future.done():
                future.set_result(value) if ok else future.set_exception(value)

        def deliver(ok: bool, value: Any) -> None:
            post(loop, settle, ok, value)

        self._jobs.put(_Job(fn, deliver))
        return future

    def has_jobs(self) -> bool:
        """Whether a job waits: a stepper that runs several units of work per step stops early for it."""
        return not self._jobs.empty()

    def _busy(self) -> bool:
        return self.stepper is not None and self.stepper.has_work()

    def _run(self) -> None:
        while True:
            if self._jobs.empty() and self._busy():  # cheaper than a raised `queue.Empty` per step
                self._step()
                continue
            job = self._jobs.get()  # only this thread takes jobs: with one queued it does not block
            if job is None:
                self._drain()
                return
            try:
                job.fn(job.deliver)
            except BaseException as exc:
                job.deliver(False, exc)
            # Let go of it: this frame outlives the job (the thread steps on), and what a job's closure
            # holds (a session's turn, its cache) must be freed when its owner lets go of it.
            job = None

    def _drain(self) -> None:
        """Before the thread ends, finish the mlx work it queued and destroy the streams it made.

        mlx keeps a thread's streams in C++ thread-local storage. Left to the thread-exit destructors,
        they are torn down after `join()` has returned (Python lets go of a thread before the OS thread
        ends), racing the interpreter's finalisation on the main thread: a destructor that needs the GIL
        then is unwound by Python, and the process dies with "terminate called without an active
        exception" (SIGABRT) after the command did its work. Synchronising by itself does not prevent it;
        `mx.clear_streams()` at the end of the thread, as mlx asks (ml-explore/mlx#3395, #4110), does.
        """
        self.stepper = None
        mx = sys.modules.get("mlx.core")
        if mx is None:  # this process never used mlx (scripted hosts)
            return
        try:
            generate = sys.modules.get("mlx_lm.generate")
            if generate is not None:
                mx.synchronize(generate.generation_stream)  # a thread-local stream: this thread's
            mx.synchronize()
            mx.clear_streams()
        except Exception:  # never fail a stop; the worst left is the race above
            pass

    def _step(self) -> None:
        """One step; if it raises, its work fails (each caller gets the exception) and the thread lives on."""
        assert self.stepper is not None
        try:
            self.stepper.step()
        except Exception as exc:
            self.stepper.fail_all(exc)
