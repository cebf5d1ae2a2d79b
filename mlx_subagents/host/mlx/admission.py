"""Admission control: whether the first waiting turn's KV cache fits the budget beside the work in
flight, and what gives way when it does not.

A turn is counted at its worst case, its prompt plus `max_tokens` (`kv_pool.admission_bytes`), over
the shared prefix it starts from, which is counted once with the prefixes. A session's first turn that
adds its agent's prefix goes on from the entry it adds (`prefixed_cache.freeze`), so that prefix too is
counted once, there, where the model's caches share prefixes at all and the prefix is long enough to
be shared (`MIN_SHARED_TOKENS`; a shorter one is copied into the session). When it does not fit:

1. idle sessions' caches are evicted, least recently used first (`KVPool.reserve`), never the
   turn's own session;
2. a new shared prefix the turn would add is given up: it prefills privately;
3. with nothing in flight, shared prefixes no session starts from are dropped, oldest first;
4. with nothing in flight, if the turn fits alone holding all its tokens, every idle cache still in
   memory is evicted, the turn's own session's and those holding nothing but a prefix included: they
   keep prefixes in use, and a turn over a prefix (the prefix and its own part, each in whole KV
   steps) can need a step more than the same tokens whole. Then step 3 drops those prefixes, and the
   turn runs whole;
5. with nothing in flight and still no room, the turn is refused in one line (it cannot fit even
   alone); otherwise it waits for the work in flight to end.

The scheduler (`scheduler.py`) asks `judge` for its first waiting turn at every step, first come
first served, and does what the verdict says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from ...errors import PromptTooLongError
from ..kv.kv_pool import KVPool, KVShape, TurnSize, admission_bytes, shared_prefix_of
from ..kv.prefix_cache import SharedPrefixes
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
        shares: whether the model's caches hold a shared prefix once (some layer is `OverPrefix`), so
            that a turn adding one goes on from it (else every session holds its own copy); asked once,
            at the first turn that adds a prefix (on the mlx thread: it makes a cache).
    """

    def __init__(
        self,
        pool: KVPool,
        prefixes: SharedPrefixes,
        shape: KVShape,
        *,
        batching: bool,
        reuse: bool,
        trimmable: bool,
        shares: Callable[[], bool],
    ) -> None:
        self.pool, self.prefixes, self.shape = pool, prefixes, shape
        self._batching, self._reuse, self._trimmable = batching, reuse, trimmable
        self._ask_shares, self._shares = shares, None

    def judge(self, turn: Turn, active: list[Turn]) -> Verdict:
        """What to do with `turn`, the first waiting, beside the turns in flight (`active`); making room
        (evicting idle caches, giving up sharing, dropping unused prefixes) is done here.

        Raises:
            PromptTooLongError: it cannot fit even with nothing else in flight.
        """
        needed = self.needed([*active, turn])
        if self.pool.reserve(needed, keep=turn.name):
            return "start"
        if turn.prefix and turn.prefix not in self.prefixes:
            turn.prefix = []  # no room to keep a shared copy: prefill this one privately
            return "retry"
        if not active and self._drop_prefixes(needed, turn.name):
            return "retry"
        if not active and len(self.prefixes) and self._fits_whole(turn) and self.pool.release():
            return "retry"  # the prefixes the evicted caches kept in use can go now (step 3)
        if not active:
            raise PromptTooLongError(
                f"this turn needs about {needed / 2**20:.1f} MiB of KV cache ({turn.final_length} tokens) but the "
                f"KV budget is {self.pool.budget / 2**20:.1f} MiB; raise --kv-budget or lower max_tokens"
            )
        if not turn.waited:
            turn.waited = True
            self.pool.counters.admission_waits += 1
        return "wait"

    def needed(self, turns: list[Turn]) -> int:
        """What the pool must hold with these turns in flight: their worst case and the shared prefixes."""
        return self.estimate(turns) + self.prefixes.nbytes()

    def estimate(self, turns: list[Turn]) -> int:
        """Worst-case bytes of these turns together, shared prefixes they will add included (a shared prefix
        they start from is counted once, with the entries)."""
        new_prefixes = {tuple(t.prefix) for t in turns if t.prefix and t.prefix not in self.prefixes}
        sizes = []
        for t in turns:
            shared, prefix = t.shared if t.shared is not None else self._starts_from(t)
            adds = tuple(t.prefix)
            if t.shared is None and adds in new_prefixes and self._goes_on_from(adds) and len(adds) > shared:
                shared, prefix = len(adds), adds  # it adds the entry and goes on from it: counted there
            sizes.append(TurnSize(t.final_length, len(t.ids), shared, prefix))
        return admission_bytes(
            self.shape,
            sizes,
            batched=self._batching,
            trimmable=self._trimmable,
            new_prefixes=[len(p) for p in new_prefixes],
        )

    def _fits_whole(self, turn: Turn) -> bool:
        """Whether the turn fits the budget alone, holding all its tokens itself (no prefix shared)."""
        whole = TurnSize(turn.final_length, len(turn.ids))
        needed = admission_bytes(self.shape, [whole], batched=self._batching, trimmable=self._trimmable)
        return self.pool.budget is None or needed <= self.pool.budget

    def _goes_on_from(self, prefix: tuple[int, ...]) -> bool:
        """Whether a turn that adds `prefix` as a shared prefix goes on from it, holding only what follows."""
        from ..kv.prefixed_cache import MIN_SHARED_TOKENS  # mlx-lm is imported where the host runs

        if len(prefix) < MIN_SHARED_TOKENS:
            return False
        if self._shares is None:
            self._shares = self._ask_shares()
        return self._shares

    def _starts_from(self, turn: Turn) -> tuple[int, Any]:
        """The shared prefix a turn not opened yet will start from: its session's cache's, or the entry of
        the longest shared prefix its prompt starts with; (0, None) when none."""
        state = turn.state
        if state.spill_path is not None:
            return self.prefixes.kept_for(state)  # it comes back over it (`SharedPrefixes.restore_over`)
        if state.prompt_cache is not None:
            return shared_prefix_of(state.prompt_cache)
        return self.prefixes.covering(turn.ids) if self._reuse else (0, None)

    def _drop_prefixes(self, needed: int, keep: str) -> bool:
        """Last resort under pressure: forget shared prefixes no session starts from (safe to drop), oldest first."""
        while freed := self.prefixes.drop_oldest():
            needed -= freed
            if self.pool.reserve(needed, keep=keep):
                return True
        return False
