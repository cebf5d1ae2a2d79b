"""Ctrl-C, SIGTERM and SIGHUP for the terminal commands: stop the work, kill, save, exit.

The first signal kills every process the tools started, prints the message and calls `stop`, so
the tasks end as aborted and their transcripts keep their messages and result; a second one exits
at once. After Ctrl-C the command goes on as it chooses (a chat takes the next message). SIGTERM
(`timeout`, a process manager) and SIGHUP (a closed terminal) ask the program to end: once the
stopped work has been saved, the block exits with 128 + the signal's number (143, 129).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rich.console import Console

from ..runs.runner import Runner
from ..tools import kill_all_processes

EXIT_INTERRUPTED = 130
T = TypeVar("T")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def two_press_sigint(
    loop: asyncio.AbstractEventLoop, err: Console, message: str, stop: Callable[[], None]
) -> Iterator[None]:
    """While the block runs, Ctrl-C, SIGTERM or SIGHUP kills every tool process, prints `message`
    (or which signal came) and calls `stop`; a second signal exits at once with 128 + its number.
    After SIGTERM or SIGHUP the block raises `SystemExit(128 + signal)` once the work has ended."""
    presses = 0
    terminated: signal.Signals | None = None

    def on_signal(signum: signal.Signals) -> None:
        nonlocal presses, terminated
        presses += 1
        if signum != signal.SIGINT:
            terminated = signum
        kill_all_processes()
        if presses > 1:
            os._exit(128 + signum)
        note = message if signum == signal.SIGINT else f"{signum.name} received: stopping every task"
        try:
            err.print(f"[yellow]{note}[/]")
        except OSError:  # SIGHUP: the terminal may be gone
            pass
        stop()

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        yield
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)
        if terminated is not None:
            raise SystemExit(128 + terminated)


def run_async(runner: Runner, work: Callable[[], Awaitable[T]], err: Console) -> T:
    """Run `work` with Ctrl-C wired to the runner: the first press aborts every task, the second quits."""

    async def main() -> T:
        main_task = asyncio.current_task()

        def stop() -> None:
            if not runner.cancel() and main_task is not None:
                main_task.cancel()  # nothing started yet: stop loading

        message = "interrupted: stopping every task (Ctrl-C again to quit at once)"
        with two_press_sigint(asyncio.get_running_loop(), err, message, stop):
            async with runner:
                return await work()

    return asyncio.run(main())
