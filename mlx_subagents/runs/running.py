"""What a runner runs now: its executions, in the foreground and in the background, each made on
the process-wide slots and writer leases, reached by one `cancel` (Ctrl-C, SIGTERM) until it ends.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from ..results import RunResult
from .execution import Execution
from .generation import Generation
from .options import RunOptions
from .slots import Slots, without_lease


class Running:
    """A runner's executions in progress and the slots they take, made in the event loop that uses them."""

    def __init__(self, options: RunOptions, cwd: Path) -> None:
        self.options = options
        self.cwd = cwd
        self._executions: set[Execution] = set()
        self._background: set[Execution] = set()
        self._slots: Slots | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None

    @property
    def current_slots(self) -> Slots | None:
        """The slots and writer leases as they are now (None before the first task), for a view."""
        return self._slots

    @property
    def slots(self) -> Slots:
        """The process-wide slots and writer leases, made in the event loop that uses them."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:
            self._slots, self._slots_loop = Slots(self.options.concurrency, self.cwd), loop
        return self._slots

    def make(self, plan: list[Generation], concurrency: int, *, background: bool = False) -> Execution:
        """A run of `plan` that `cancel()` reaches until it ends (`finish`)."""
        execution = Execution(plan, concurrency=concurrency, slots=self.slots)
        (self._background if background else self._executions).add(execution)
        return execution

    async def finish(self, execution: Execution) -> list[RunResult]:
        """Run `execution` to its end; `cancel()` no longer reaches it after."""
        try:
            return await execution.run()
        finally:
            self._executions.discard(execution)
            self._background.discard(execution)

    async def execute(self, plan: list[Generation]) -> list[RunResult]:
        """Run generations in the foreground, as one of the runner's runs; their results."""
        return await self.finish(self.make(plan, 1))

    def launch(self, plan: list[Generation]) -> None:
        """Run generations in the background, each as soon as its needs and a slot let it, in a context
        without the slot lease of whoever started them (`without_lease`)."""
        for generation in plan:
            generation.background = True  # its end is a notice on its board
        execution = self.make(plan, len(plan), background=True)
        without_lease().run(execution.start)  # queued now: its handles wait, join and cancel from here
        done = asyncio.ensure_future(self.finish(execution))
        done.add_done_callback(lambda task: task.cancelled() or task.exception())

    def cancel(self, *, background: bool = True, reason: str | None = None) -> bool:
        """Abort every run in progress (Ctrl-C); False when nothing was running yet.

        Args:
            background: also the background tasks (`start`, `background: true`); a chat's first Ctrl-C
                stops only the turn.
            reason: the error the aborted results carry (default: Ctrl-C's; "stopped by SIGTERM").
        """
        executions = self._executions | (self._background if background else set())
        for execution in list(executions):
            execution.cancel(reason)
        return bool(executions)
