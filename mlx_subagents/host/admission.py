"""Admission control: whether the first waiting turn's KV cache fits the budget beside the work in
flight, and what gives way when it does not.

A turn is counted at its worst case, its prompt plus `max_tokens` (`kv_pool.admission_bytes`), over
the shared prefix it starts from, which is counted once with the prefixes. When it does not fit:

1. idle sessions' caches are evicted, least recently used first (`KVPool.make_room`), never the
   turn's own session;
2. a new shared prefix the turn would add is given up: it prefills privately;
3. with nothing in flight, shared prefixes no session starts from are dropped, oldest first;
4. with nothing in flight and still no room, the turn is refused in one line (it cannot fit even
   alone); otherwise it waits for the work in flight to end.

The scheduler (`scheduler.py`) asks `judge` for its first waiting turn at every step, first come
first served, and does what the verdict says.
"""

from __future__ import annotations

from typing import Any, Literal

from ..errors import PromptTooLongError
from .kv_pool import KVPool, KVShape, TurnSize, admission_bytes
from .prefix_cache import SharedPrefixes, shared_prefix_of
from .turn import Turn

# "start": it fits, start it now; "retry": something gave way, judge it again; "wait": not now.
Verdict = Literal["start", "retry", "wait"]


class Admission:
    """Admission control of one scheduler against its pool's budget (see the module docstring).

    Args:
        pool: the sessions' idle caches and the budget.
        prefixes: the shared prefixes held in memory.
        shape: the bytes a cache costs per token.
        batching: turns decode in one batch (their caches are counted as the batch holds them).
        reuse: a turn may start from a shared prefix.
        trimmable: a session's cache can be trimmed back (False for hybrid caches: they snapshot).
    """

    def __init__(
        self, pool: KVPool, prefixes: SharedPrefixes, shape: KVShape, *, batching: bool, reuse: bool, trimmable: bool
    ) -> None:
        self.pool, self.prefixes, self.shape = pool, prefixes, shape
        self._batching, self._reuse, self._trimmable = batching, reuse, trimmable

    def judge(self, turn: Turn, active: list[Turn]) -> Verdict:
        """What to do with `turn`, the first waiting, beside the turns in flight (`active`); making room
        (evicting idle caches, giving up sharing, dropping unused prefixes) is done here.

        Raises:
            PromptTooLongError: it cannot fit even with nothing else in flight.
        """
        needed = self.estimate([*active, turn]) + self.prefixes.nbytes()
        if self.pool.budget is None or self.pool.make_room(needed, keep=turn.name):
            return "start"
        if turn.prefix and turn.prefix not in self.prefixes:
            turn.prefix = []  # no room to keep a shared copy: prefill this one privately
            return "retry"
        if not active and self._drop_prefixes(needed, turn.name):
            return "retry"
        if not active:
            raise PromptTooLongError(
                f"this turn needs about {needed / 2**20:.1f} MiB of KV cache ({turn.final_length} tokens) but the "
                f"KV budget is {self.pool.budget / 2**20:.1f} MiB; raise --kv-budget or lower max_tokens"
            )
        if not turn.waited:
            turn.waited = True
            self.pool.counters.admission_waits += 1
        return "wait"

    def estimate(self, turns: list[Turn]) -> int:
        """Worst-case bytes of these turns together, shared prefixes they will add included (a shared prefix
        they start from is counted once, with the entries)."""
        new_prefixes = {tuple(t.prefix) for t in turns if t.prefix and t.prefix not in self.prefixes}
        sizes = []
        for t in turns:
            shared, prefix = t.shared if t.shared is not None else self._starts_from(t)
            sizes.append(TurnSize(t.final_length, len(t.ids), shared, prefix))
        return admission_bytes(
            self.shape,
            sizes,
            batched=self._batching,
            trimmable=self._trimmable,
            new_prefixes=[len(p) for p in new_prefixes],
        )

    def _starts_from(self, turn: Turn) -> tuple[int, Any]:
        """The shared prefix a turn not opened yet will start from: its session's cache's, or the entry of
        the longest shared prefix its prompt starts with; (0, None) when none."""
        state = turn.state
        if state.prompt_cache is not None or state.spill_path is not None:
            return shared_prefix_of(state.prompt_cache)
        return self.prefixes.covering(turn.ids) if self._reuse else (0, None)

    def _drop_prefixes(self, needed: int, keep: str) -> bool:
        """Last resort under pressure: forget shared prefixes no session starts from (safe to drop), oldest first."""
        while freed := self.prefixes.drop_oldest():
            needed -= freed
            if self.pool.make_room(needed, keep=keep):
                return True
        return False
