"""The prompt worker: turns' prompts made in a thread of their own (`turn_prompt.py`), never on the mlx
thread, then the turns handed to the mlx thread's scheduler in the groups they were asked in.

Turns asked in the same pass of the caller's loop (a fan-out of sub-agents, `asyncio.gather`) are made
together and submitted in one job of the mlx thread, so the scheduler receives them at once, as it did
when it tokenized them itself, and they prefill oldest first (short ones as one padded batch,
`prefill.py`). One thread
makes every prompt, in the order asked: a session's turns reach the scheduler in their order.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from .mlx_thread import Deliver, MlxThread
from .scheduler import Scheduler
from .turn import Turn
from .turn_prompt import Basis, TurnPrompt

Made = TurnPrompt | BaseException


class PromptWorker:
    """Makes the prompts of one host's turns and submits the turns (see the module docstring)."""

    def __init__(self, mlx: MlxThread, scheduler: Scheduler) -> None:
        self._mlx, self._scheduler = mlx, scheduler
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="prompts")
        self._asked: list[tuple[Turn, asyncio.Future[None]]] = []

    async def submit(self, turn: Turn) -> None:
        """Make `turn`'s prompt and queue the turn on the mlx thread (its reply comes through its sink).
        Raises its prompt's own error (longer than the window holds, a template that refuses it), with
        nothing queued; a caller cancelled meanwhile sets the turn's `cancel` (it ends where it waits)."""
        loop = asyncio.get_running_loop()
        queued: asyncio.Future[None] = loop.create_future()
        if not self._asked:  # the first of this pass: the others asked in it come before this runs
            loop.call_soon(self._make_asked, loop)
        self._asked.append((turn, queued))
        await asyncio.shield(queued)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _make_asked(self, loop: asyncio.AbstractEventLoop) -> None:
        asked, self._asked = self._asked, []
        made = loop.run_in_executor(self._thread, self._make, [turn for turn, _ in asked])
        made.add_done_callback(lambda done: self._queue(asked, done))

    def _make(self, turns: list[Turn]) -> list[Made]:
        """Each turn's prompt, from what its session holds now (worker thread), or what it failed with."""
        made: list[Made] = []
        for turn in turns:
            try:
                made.append(self._scheduler.prompts.make(turn.request, Basis.of(turn.state)))
            except Exception as exc:
                made.append(exc)
        return made

    def _queue(self, asked: list[tuple[Turn, asyncio.Future[None]]], done: asyncio.Future[list[Made]]) -> None:
        """On the caller's loop: the turns whose prompts were made go to the mlx thread in one job."""
        if done.cancelled():  # the host stopped
            for _, queued in asked:
                queued.cancel()
            return
        turns: list[Turn] = []
        for (turn, queued), made in zip(asked, done.result(), strict=True):
            if isinstance(made, BaseException):
                queued.set_exception(made)
                continue
            turn.prompt = made
            turns.append(turn)

        def submit(deliver: Deliver) -> None:
            for turn in turns:
                self._scheduler.submit(turn)
            deliver(True, None)

        if turns:
            self._mlx.submit(submit)
        for (_, queued), made in zip(asked, done.result(), strict=True):
            if not isinstance(made, BaseException):
                queued.set_result(None)
