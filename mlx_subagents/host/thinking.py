"""Thinking budgets: a thought that runs past its budget is closed, and the model answers.

One logits processor per request watches the tokens it is shown: it notices the
thought opening (in the prompt, as Qwen3.5's template does, or in the reply), counts
its tokens, and once the budget is spent forces the end marker's token(s), one per
step. Being a logits processor, it works the same in the batched and the serialized
decode path; the scheduler's loop is not touched.

Its state lives on the device and a call only builds a graph: reading the newest token
on the host would wait for the step in flight, undoing the pipelining of both decode
paths, which build step n+1 while step n computes (as `testing/forced.py` does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # mlx is imported where it runs: importing the host stays quick
    import mlx.core as mx

# The generation prompt that opens a thought is short (`<|im_start|>assistant\n<think>\n`).
_PROMPT_TAIL = 32


@dataclass(frozen=True)
class ThoughtState:
    """Where a reply stands, as device arrays (read them only once the step is evaluated)."""

    thinking: mx.array  # bool: inside a thought
    spent: mx.array  # int32: tokens of this thought so far (meaningless outside one)
    forced: mx.array  # int32: end-marker tokens emitted while forcing
    tail: mx.array  # int32: the newest tokens, padded with -1, to match the markers against


@dataclass(frozen=True)
class _Markers:
    """The markers and the vocabulary on the device, made on the thread that decodes."""

    start: mx.array
    end: mx.array
    vocab: mx.array


class ThoughtBudget:
    """Forces `end` once `budget` tokens were thought; serves one request (like every processor).

    Both decode paths pass the context plus the tokens generated so far, so the first call
    sees the prompt and each later call one new token (several are taken in order).

    Until `budget` tokens were generated nothing can be forced (a thought counts only its own
    tokens), so until then a call adds nothing to the graph; the state is then worked out from
    those tokens in one go, and from there on updated per token.
    """

    def __init__(self, budget: int, start: Sequence[int], end: Sequence[int], opened: bool) -> None:
        if not end:
            raise ValueError("a thought budget needs an end marker to close the thought with")
        self.budget = max(0, budget)
        self.start, self.end = tuple(start), tuple(end)
        self.opened = opened
        self.state: ThoughtState | None = None  # made once something could be forced
        self._markers: _Markers | None = None
        self._first: int | None = None  # the context length at the first call: the prompt
        self._seen = 0  # context tokens taken into the state
        # A token ending both markers would open and close at once: the catch-up cannot tell which
        # came first, so such markers are followed token by token from the start.
        self._defer = not (_is_suffix(self.start, self.end) or _is_suffix(self.end, self.start))

    def __call__(self, tokens: mx.array | Sequence[int], logits: mx.array) -> mx.array:
        import mlx.core as mx

        n = len(tokens)  # a shape: no evaluation
        if self._first is None:
            self._first = self._seen = n
        if n < self._seen:
            raise RuntimeError("a ThoughtBudget serves one request; make a fresh one per request")
        if self.state is None:
            if self._defer and n - self._first < self.budget:
                return logits  # no thought is `budget` tokens long yet
            self._markers = _Markers(
                mx.array(self.start, dtype=mx.int32),
                mx.array(self.end, dtype=mx.int32),
                mx.arange(logits.shape[-1], dtype=mx.int32),
            )
            caught = min(n - self._first, self.budget) if self._defer else 0
            self.state = self._catch_up(_ids(tokens, self._first, self._first + caught))
            self._seen = self._first + caught
        if n > self._seen:
            new = _ids(tokens, self._seen, n)
            for i in range(n - self._seen):
                self.state = self._advance(self.state, new[i : i + 1])
            self._seen = n
        return self._mask(self.state, logits)

    def _catch_up(self, history: mx.array) -> ThoughtState:
        """The state after `history`, none of whose tokens was forced or counted past the budget:
        only the markers moved it. The thought open at its end is the one the prompt opened if no
        end marker came, else the first one opened after the last end marker."""
        import mlx.core as mx

        markers = self._markers
        assert markers is not None
        m = history.size
        width = max(len(self.start), len(self.end))
        tail = mx.concatenate([mx.full((max(0, width - m),), -1, dtype=mx.int32), history[max(0, m - width) :]])
        if m == 0:
            return ThoughtState(mx.array(self.opened), mx.array(0), mx.array(0), tail)
        index = mx.arange(m)
        last_close = mx.max(mx.where(_hits(history, self.end), index, -1))
        first_open = mx.min(mx.where(_hits(history, self.start) & (index > last_close), index, m))
        kept = mx.array(self.opened) & (last_close < 0)  # the prompt's thought, never closed
        thinking = kept | (first_open < m)
        spent = mx.where(kept, m, m - 1 - first_open)
        return ThoughtState(thinking, spent, mx.array(0), tail)

    def _advance(self, state: ThoughtState, token: mx.array) -> ThoughtState:
        """The state after `token` (shape (1,)): a thought opens on the start marker, counts its
        tokens, steps through the end marker while forcing it, and closes on the end marker."""
        import mlx.core as mx

        markers = self._markers
        assert markers is not None
        tail = mx.concatenate([state.tail[1:], token])
        opens = _ends_with(tail, markers.start)
        closes = _ends_with(tail, markers.end)
        spent = state.spent + 1
        on_marker = (spent > self.budget) & (state.forced < len(self.end)) & (token[0] == self._next_end(state.forced))
        # Outside a thought the count and the forcing start over; spent is read only inside one.
        thinking = mx.where(state.thinking, ~closes, opens)
        spent = mx.where(state.thinking, spent, 0)
        forced = mx.where(state.thinking & ~closes, state.forced + on_marker, 0)
        return ThoughtState(thinking, spent, forced, tail)

    def _mask(self, state: ThoughtState, logits: mx.array) -> mx.array:
        """`logits`, or once the budget is spent a fresh mask keeping only the next end-marker token:
        not on top of `logits`, so it wins over processors that ran before it."""
        import mlx.core as mx

        markers = self._markers
        assert markers is not None
        force = state.thinking & (state.spent >= self.budget)
        keep = markers.vocab == self._next_end(state.forced)
        forced = mx.where(keep, mx.array(0.0, dtype=logits.dtype), mx.array(-mx.inf, dtype=logits.dtype))
        return mx.where(force, forced, logits)

    def _next_end(self, forced: mx.array) -> mx.array:
        """The end-marker token to force after `forced` of them (kept in range: forcing emits the
        marker whole, so the count is back to 0 before it could run past the end)."""
        assert self._markers is not None
        import mlx.core as mx

        return self._markers.end[mx.minimum(forced, len(self.end) - 1)]


def _ids(tokens: mx.array | Sequence[int], start: int, stop: int) -> mx.array:
    """`tokens[start:stop]` as an int32 device array (a slice of a pending context stays pending)."""
    import mlx.core as mx

    ids = tokens[start:stop]
    return (ids if isinstance(ids, mx.array) else mx.array(list(ids))).astype(mx.int32)


def _hits(ids: mx.array, marker: tuple[int, ...]) -> mx.array:
    """For each position of `ids`, whether the tokens up to it end with `marker` (never an empty one)."""
    import mlx.core as mx

    m, k = ids.size, len(marker)
    if not marker or k > m:
        return mx.zeros((m,), dtype=mx.bool_)
    hit = ids[k - 1 :] == marker[-1]
    for j, token in enumerate(marker[:-1]):
        hit = hit & (ids[j : m - k + 1 + j] == token)
    return mx.concatenate([mx.zeros((k - 1,), dtype=mx.bool_), hit])


def _is_suffix(suffix: tuple[int, ...], of: tuple[int, ...]) -> bool:
    return bool(suffix) and len(suffix) <= len(of) and of[len(of) - len(suffix) :] == suffix


def _ends_with(tail: mx.array, marker: mx.array) -> mx.array:
    """Whether `tail` ends with `marker` (never for an empty marker), as a device bool."""
    import mlx.core as mx

    if marker.size == 0:
        return mx.array(False)
    return mx.all(tail[tail.size - marker.size :] == marker)


def prompt_opens_thought(tokenizer: Any, prompt_ids: Sequence[int]) -> bool:
    """Whether the prompt ends inside a thought (its generation prompt wrote the start marker)."""
    if not getattr(tokenizer, "has_thinking", False):
        return False
    ids = list(prompt_ids[-_PROMPT_TAIL:])
    return tokenizer.rfind_think_start(ids) > tokenizer.rfind_think_end(ids)


def thought_budget(tokenizer: Any, budget: int, prompt_ids: Sequence[int]) -> ThoughtBudget | None:
    """The processor for one request of a thinking model, or None for a model that does not think."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    opened = prompt_opens_thought(tokenizer, prompt_ids)
    return ThoughtBudget(budget, tokenizer.think_start_tokens, tokenizer.think_end_tokens, opened)
