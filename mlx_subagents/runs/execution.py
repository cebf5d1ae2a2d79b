"""`Execution`: when each generation of a plan runs: the steps it needs, a slot, the writer lease, a stop.

A plan is a list of `Generation`s whose `needs` point at other generations of the plan by index.
Every generation waits for its needs, then for one of `concurrency` places and a process-wide slot
(`Slots`, with its workspace's writer lease for an agent that can change files), then runs. One whose
need did not complete is skipped. `cancel()` (Ctrl-C, SIGTERM) stops every generation: a running one
at its next await (a bash tool kills its process group as it unwinds), keeping what it had done in
its result and transcript; a waiting one before it starts. Results come back in plan order whatever
the finishing order. What a generation does once it runs is the generation's (`runs/generation.py`).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass

from ..events import SLOT, WRITER_LEASE, WaitingData
from ..results import INTERRUPTED, RunResult
from .generation import Generation, _uncancel
from .slots import Slots

# A wait for a slot or the writer lease this long or longer is told in the task's `task_start` (`waited_s`).
MIN_WAIT_S = 0.01
WAITING_FOR_WRITER = "another agent that can change files is working in this workspace; writers take turns"
WAITING_FOR_SLOT = "every slot is taken (--concurrency); it starts when one frees"


@dataclass(eq=False)
class Execution:
    """One run of a plan: `start()` its generations (or `await run()` for all of them), `cancel()` to stop.

    Args:
        concurrency: how many of its generations run at once (the process-wide slots bound them too).
        slots: the process-wide slots and writer leases (None: only `concurrency` bounds it).
    """

    plan: list[Generation]
    concurrency: int = 4
    slots: Slots | None = None

    def __post_init__(self) -> None:
        self.cancelled = False
        self.reason = INTERRUPTED
        self._places = asyncio.Semaphore(self.concurrency)

    @property
    def results(self) -> list[RunResult | None]:
        return [generation.result for generation in self.plan]

    def start(self) -> None:
        """Queue every generation on its task and start waiting for its turn (in the current context)."""
        for generation in self.plan:
            generation.handle.queue(generation)
            generation.task = asyncio.create_task(self._node(generation), name=f"task-{generation.label}")
            generation.task.add_done_callback(lambda _task, g=generation: self._never_ran(g))

    async def run(self) -> list[RunResult]:
        """Run every generation (started here unless `start` was called); the results in plan order.
        Cancelled from outside, it stops them all."""
        if any(g.task is None for g in self.plan):
            self.start()
        tasks = [g.task for g in self.plan if g.task is not None]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            for generation in self.plan:
                self._never_ran(generation)
        return [r for r in self.results if r is not None]

    def cancel(self, reason: str | None = None) -> None:
        """Stop every running and waiting generation; safe to call more than once, from the loop's thread.

        Args:
            reason: the error the aborted results carry (default: Ctrl-C's).
        """
        if self.cancelled:
            return
        self.cancelled = True
        self.reason = reason or INTERRUPTED
        for generation in self.plan:
            generation.abort(self.reason)

    # -- one node of the graph ---------------------------------------------------------------------

    async def _node(self, generation: Generation) -> None:
        try:
            for need in generation.needs:
                await self.plan[need].done.wait()
            failed = [self.plan[n] for n in generation.needs if not _ok(self.plan[n].result)]
            if failed:
                generation.end_unrun("failed", "skipped", f"not run: {_describe(failed[0])} did not complete")
            else:
                asked = time.monotonic()
                if self._places.locked():  # this request's own concurrency: as a slot to the person
                    _waiting(generation, SLOT)
                async with self._places, self._lease(generation):
                    if (waited := time.monotonic() - asked) >= MIN_WAIT_S:
                        generation.waited = (round(waited, 3), generation.waited[1] if generation.waited else SLOT)
                    if generation.abort_reason is not None:
                        _unstarted(generation)
                    else:
                        await generation.run(self.results)
        except asyncio.CancelledError:
            if generation.abort_reason is None:
                raise
            _uncancel()
            if generation.result is None:
                _unstarted(generation)
        except Exception as exc:  # a task that could not even be set up fails alone
            if generation.result is None:
                generation.end_unrun("failed", "error", f"{type(exc).__name__}: {exc}")
            if generation.raise_errors:
                raise
        finally:
            generation.handle.end_now(generation)  # whatever stopped it, it ends
            generation.done.set()

    def _lease(self, generation: Generation) -> AbstractAsyncContextManager[object]:
        """The process-wide slot (and the workspace's writer lease) the generation runs in."""
        if self.slots is None:
            return nullcontext()
        prepared = generation.handle.prepared
        writer = prepared.workspace.root if prepared.spec.is_writer(prepared.denied) else None

        return self.slots.hold(writer, on_wait=lambda what: _waiting(generation, what), who=generation.label)

    def _never_ran(self, generation: Generation) -> None:
        """A generation stopped before its first step never ran `_node`: end it here, so that its task ends."""
        if generation.result is None and generation.task is not None and generation.task.done():
            if generation.abort_reason is None:
                generation.abort_reason = self.reason
            _unstarted(generation)
        if generation.task is not None and generation.task.done():
            generation.done.set()


def _waiting(generation: Generation, what: str) -> None:
    """The generation waits for `what` (a slot, the writer lease) before it starts: its `waiting` event,
    once for each (a request's own slot and the process-wide one read as one)."""
    if generation.waited is not None and generation.waited[1] == what:
        return
    generation.waited = (0.0, what)
    reason = WAITING_FOR_WRITER if what == WRITER_LEASE else WAITING_FOR_SLOT
    generation.report(None, "waiting", WaitingData(waiting_for=what, reason=reason))


def _unstarted(generation: Generation) -> None:
    """A generation stopped before it started ends as its stop says (a timeout: failed, as timed out)."""
    reason = f"{generation.abort_reason} before it started"
    generation.end_unrun(generation.stopped_status, generation.abort_stop, reason)


def _ok(result: RunResult | None) -> bool:
    return result is not None and result.ok


def _describe(step: Generation) -> str:
    """A step as the one that needs it names it: a background step by its id on its board."""
    if step.background:
        return f"step '{step.handle.id}'"
    result = step.result
    if result is None:
        return "a step it needs"
    return f"step '{result.step_id}'" if result.step_id else f"task '{result.label}'"
