"""The outbox: what a turn's caller learns while the turn runs (its prefill begun, its streamed text),
handed from the mlx thread to the caller's event loop in one place (`post`).

The stages write into it (the decode stage a turn's new tokens, the prefill stage a prefill that
begins); it detokenizes a turn's tokens when they go out, all since the last wake-up at once, so
each caller gets one piece of text per wake-up, not one per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from .turn import Turn, TurnOutput

# Streamed text reaches the callers' loops at most this often (plus a turn's first text and its end at
# once): a wake-up per token costs a syscall and a thread switch per step, more than a token of a
# small model on a CPU, and no reader sees a difference at 50 Hz. (Each wake-up also stalls this
# thread while the woken loop holds the GIL: 0.6-1.5 ms measured on a loaded 2-core machine.)
# A turn's tokens are detokenized when its text goes out, all since the last wake-up at once, and each
# caller gets them as one piece of text: one callback per turn per wake-up, not one per token, which
# also keeps the woken loop's turn with the GIL short.
DEFAULT_STREAM_INTERVAL_S = 0.02


def post(loop: asyncio.AbstractEventLoop, callback: Callable[..., Any], *args: Any) -> None:
    """Run `callback(*args)` on a caller's `loop`: the one way anything leaves the mlx thread for a
    caller before its reply (a closed loop's caller is gone: nothing to tell)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)


def _deliver(items: list[tuple[Callable[[TurnOutput], None], TurnOutput]]) -> None:
    for receive, output in items:
        receive(output)


class Outbox:
    """Turns with tokens their callers have not had yet, flushed at most every DEFAULT_STREAM_INTERVAL_S."""

    def __init__(self, eos: frozenset[int]) -> None:
        self._eos = eos  # an end-of-turn token is not text
        self._turns: list[Turn] = []
        self._flushed_at = 0.0
        self._first_text = False  # it holds a turn's first text: send it now

    def token(self, turn: Turn) -> None:
        """Queue the turn's newest token for streaming. Until a turn's first text appears its tokens are
        detokenized at once, so that text goes out at the end of this step."""
        if turn.sink is None:
            return
        if not turn.queued:
            turn.queued = True
            self._turns.append(turn)
        if not turn.streamed:
            self.detokenize(turn)
            if turn.detokenizer.text:
                turn.streamed = self._first_text = True

    def prefill_begun(self, turn: Turn) -> None:
        """Tell the turn's caller, once, that its prefill begins: the tokens to compute and those cached.
        Sliced, that is its first slice, not its opening: until then it waits behind other prompts."""
        if turn.told:
            return
        turn.told = True
        if turn.sink is not None:
            post(turn.sink.loop, turn.sink.receive, TurnOutput(prefill=(len(turn.ids) - turn.pos, turn.pos)))

    def flush(self, force: bool = False) -> None:
        """Hand the streamed text so far, with each turn's tokens so far, to each caller's loop in one
        wake-up (see DEFAULT_STREAM_INTERVAL_S)."""
        if not self._turns:
            return
        now = time.perf_counter()
        if not (force or self._first_text or now - self._flushed_at >= DEFAULT_STREAM_INTERVAL_S):
            return
        self._flushed_at, self._first_text = now, False
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Callable[[TurnOutput], None], TurnOutput]]] = {}
        for turn in self._turns:
            turn.queued = False
            self.detokenize(turn)
            if text := turn.detokenizer.last_segment:
                sink = turn.sink
                assert sink is not None  # only a turn with a sink is queued
                by_loop.setdefault(sink.loop, []).append((sink.receive, TurnOutput(text, len(turn.generated))))
        self._turns.clear()
        for loop, items in by_loop.items():
            post(loop, _deliver, items)

    def detokenize(self, turn: Turn) -> None:
        """Feed the turn's detokenizer the tokens it has not had (an end-of-turn token is not text)."""
        detokenizer, eos = turn.detokenizer, self._eos
        for token in turn.generated[turn.fed :]:
            if token not in eos:
                detokenizer.add_token(token)
        turn.fed = len(turn.generated)
