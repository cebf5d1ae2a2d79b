"""Ctrl-C, SIGTERM and SIGHUP for the terminal commands: stop the work, kill, save, exit.

The first signal kills every process the tools started (an attached command has none: its tools
run in the server), prints the message and calls `stop` with the reason the aborted tasks carry
("aborted by the user (Ctrl-C)", "stopped by SIGTERM"), so the tasks end as aborted and their
transcripts keep their messages and result; a second one exits at once. After Ctrl-C the command
goes on as it chooses (a chat takes the next message). SIGTERM (`timeout`, a process manager) and
SIGHUP (a closed terminal) ask the program to end: once the stopped work has been saved, the
command exits with 128 + the signal's number (143, 129).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from rich.console import Console

from ..results import stop_reason

if TYPE_CHECKING:
    from ..runs.runner import Runner

EXIT_INTERRUPTED = 130
T = TypeVar("T")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class Signalled:
    """Which termination signal (SIGTERM, SIGHUP) came while a block ran, if any."""

    signum: signal.Signals | None = None

    @property
    def exit_code(self) -> int | None:
        """128 + the signal's number, or None: the command exits as its result says."""
        return None if self.signum is None else 128 + self.signum


@contextmanager
def two_press_sigint(
    loop: asyncio.AbstractEventLoop,
    err: Console,
    message: str,
    stop: Callable[[str], None],
    *,
    exit_after: bool = True,
    tools_here: bool = True,
) -> Iterator[Signalled]:
    """While the block runs, Ctrl-C, SIGTERM or SIGHUP kills every tool process, prints `message`
    (or which signal came) and calls `stop(reason)`; a second signal exits at once with 128 + its
    number. After SIGTERM or SIGHUP the block raises `SystemExit(128 + signal)` once the work has
    ended, unless `exit_after` is False: the caller prints what was done and exits with the code
    the yielded `Signalled` holds. `tools_here` False: the tools run in another process (the
    server of an attached command), so there are none to kill and the tools are never imported."""
    presses = 0
    signalled = Signalled()

    def on_signal(signum: signal.Signals) -> None:
        nonlocal presses
        presses += 1
        if signum != signal.SIGINT:
            signalled.signum = signum
        if tools_here:
            from ..tools import kill_all_processes

            kill_all_processes()
        if presses > 1:
            os._exit(128 + signum)
        note = message if signum == signal.SIGINT else f"{signum.name} received: stopping every task"
        try:
            err.print(f"[yellow]{note}[/]")
        except OSError:  # SIGHUP: the terminal may be gone
            pass
        stop(stop_reason(signum))

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        yield signalled
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)
        if exit_after and signalled.exit_code is not None:
            raise SystemExit(signalled.exit_code)


@dataclass(frozen=True)
class Finished(Generic[T]):
    """What a command's work returned, and the exit code a termination signal chose (None: none came)."""

    value: T
    exit_code: int | None = None


def run_async(runner: Runner, work: Callable[[], Awaitable[T]], err: Console) -> Finished[T]:
    """Run `work` with the signals wired to the runner: the first aborts every task, the second quits.
    Returns even after SIGTERM or SIGHUP, so that the command prints what was done before it exits."""

    async def main() -> Finished[T]:
        main_task = asyncio.current_task()

        def stop(reason: str) -> None:
            if not runner.cancel(reason=reason) and main_task is not None:
                main_task.cancel()  # nothing started yet: stop loading

        message = "interrupted: stopping every task (Ctrl-C again to quit at once)"
        loop = asyncio.get_running_loop()
        with two_press_sigint(loop, err, message, stop, exit_after=False) as signalled:
            try:
                async with runner:
                    value = await work()
            except asyncio.CancelledError:
                if signalled.exit_code is not None:  # stopped while loading: nothing to print
                    raise SystemExit(signalled.exit_code) from None
                raise
        return Finished(value, signalled.exit_code)

    return asyncio.run(main())
