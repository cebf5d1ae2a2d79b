"""The outbox: what a turn's caller learns while the turn runs (its prefill begun, its streamed text),
handed from the mlx thread to the caller's event loop in one place (`send`), and at its end its
reply, after the text.

The stages write into it (the decode stage a turn's new tokens, the prefill stage a prefill that
begins); it detokenizes a turn's tokens when they go out, all since the last wake-up at once, so
each caller gets one piece of text per wake-up, not one per token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from ..protocol import Reply
from .mlx_thread import post
from .turn import Turn, TurnOutput

# Streamed text reaches the callers' loops at most this often (plus a turn's first text and its end at
# once): a wake-up per token costs a syscall and a thread switch per step, more than a token of a
# small model on a CPU, and no reader sees a difference at 50 Hz. (Each wake-up also stalls this
# thread while the woken loop holds the GIL: 0.6-1.5 ms measured on a loaded 2-core machine.)
# A turn's tokens are detokenized when its text goes out, all since the last wake-up at once, and each
# caller gets them as one piece of text: one callback per turn per wake-up, not one per token, which
# also keeps the woken loop's turn with the GIL short.
DEFAULT_STREAM_INTERVAL_S = 0.02


Outputs = dict[Turn, TurnOutput]


def send(outputs: Outputs) -> None:
    """Hand each turn's outputs to its caller's loop, one wake-up per loop: the one place a turn's
    outputs (its prefill begun, its text, its reply or error) leave the mlx thread."""
    by_loop: dict[asyncio.AbstractEventLoop | None, list[tuple[Callable[[TurnOutput], None], TurnOutput]]] = {}
    for turn, output in outputs.items():
        if turn.sink is not None:
            by_loop.setdefault(turn.sink.loop, []).append((turn.sink.receive, output))
    for loop, items in by_loop.items():
        if loop is None:  # a caller stepping the scheduler on this thread
            _receive(items)
        else:
            post(loop, _receive, items)


def _receive(items: list[tuple[Callable[[TurnOutput], None], TurnOutput]]) -> None:
    for receive, output in items:
        receive(output)


class Outbox:
    """Turns with outputs their callers have not had yet: text flushed at most every
    DEFAULT_STREAM_INTERVAL_S, a prefill begun and an end at once; what it sent since `sent` was last
    read is what `sent` returns."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._eos = frozenset(tokenizer.eos_token_ids)  # an end-of-turn token is not text
        self._turns: list[Turn] = []
        self._ends: Outputs = {}  # replies and errors not sent yet
        self._sent: Outputs = {}
        self._flushed_at = 0.0
        self._first_text = False  # it holds a turn's first words: send them now

    def token(self, turn: Turn) -> None:
        """Queue the turn's newest token for streaming. Until a turn's first words appear its tokens are
        detokenized at once, so that they go out at the end of this step. Words, not any text: a reply's
        leading whitespace (a newline or two is a common first token) is nothing its caller shows (the
        endpoints strip it), and the prefill waits for a turn's first words (`DecodeStage.starting`)."""
        if turn.sink is None or not turn.sink.streams:
            return
        if turn.out.detokenizer is None:
            turn.out.detokenizer = self._tokenizer.detokenizer
        if not turn.out.queued:
            turn.out.queued = True
            self._turns.append(turn)
        if not turn.out.streamed:
            self.detokenize(turn)
            if turn.out.detokenizer.text.strip():
                turn.out.streamed = self._first_text = True

    def prefill_begun(self, turn: Turn) -> None:
        """Tell the turn's caller, once, that its prefill begins: the tokens to compute and those cached.
        Sliced, that is its first slice, not its opening: until then it waits behind other prompts."""
        if turn.out.told:
            return
        turn.out.told = True
        if turn.sink is not None and turn.sink.streams:
            self._send({turn: TurnOutput(prefill=(len(turn.ids) - turn.prefill.pos, turn.prefill.pos))})

    def end(self, turn: Turn, reply: Reply | None = None, error: BaseException | None = None) -> None:
        """The turn's reply (or the error it failed with) goes to its caller now, after the text streamed so far."""
        self._ends[turn] = TurnOutput(reply=reply, error=error)
        self.flush(force=True)

    def flush(self, force: bool = False) -> None:
        """Hand the streamed text so far, with each turn's tokens so far, and the ends to each caller's
        loop in one wake-up (see DEFAULT_STREAM_INTERVAL_S)."""
        outputs, self._ends = self._ends, {}
        now = time.perf_counter()
        if self._turns and (force or self._first_text or now - self._flushed_at >= DEFAULT_STREAM_INTERVAL_S):
            self._flushed_at, self._first_text = now, False
            for turn in self._turns:
                turn.out.queued = False
                self.detokenize(turn)
                if text := turn.out.detokenizer.last_segment:
                    streamed = TurnOutput(text, len(turn.generated))
                    outputs[turn] = streamed.then(outputs[turn]) if turn in outputs else streamed
            self._turns.clear()
        if outputs:
            self._send(outputs)

    def _send(self, outputs: Outputs) -> None:
        for turn, output in outputs.items():
            self._sent[turn] = self._sent[turn].then(output) if turn in self._sent else output
        send(outputs)

    def sent(self) -> Outputs:
        """What went to the callers since the last call, one output per turn (and it forgets them)."""
        sent, self._sent = self._sent, {}
        return sent

    def detokenize(self, turn: Turn) -> None:
        """Feed the turn's detokenizer the tokens it has not had (an end-of-turn token is not text)."""
        detokenizer, eos = turn.out.detokenizer, self._eos
        for token in turn.generated[turn.out.fed :]:
            if token not in eos:
                detokenizer.add_token(token)
        turn.out.fed = len(turn.generated)
