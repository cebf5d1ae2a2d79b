"""Ctrl-C for the terminal commands: the first press stops the work, the second quits at once."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console

from .tools import kill_all_processes

EXIT_INTERRUPTED = 130


@contextmanager
def two_press_sigint(
    loop: asyncio.AbstractEventLoop, err: Console, message: str, stop: Callable[[], None]
) -> Iterator[None]:
    """While the block runs, Ctrl-C kills every bash process group, prints `message` and calls
    `stop`; a second Ctrl-C exits with 130 without waiting for anything."""
    presses = 0

    def on_sigint() -> None:
        nonlocal presses
        presses += 1
        kill_all_processes()
        if presses > 1:
            os._exit(EXIT_INTERRUPTED)
        err.print(f"[yellow]{message}[/]")
        stop()

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)
