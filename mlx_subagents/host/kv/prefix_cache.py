"""Shared prefixes: one KV cache of an agent's system prompt and tools, which each new session of the
agent starts from; and of a parent's conversation at a fork, which each of its forks starts from
(`Scheduler.fork`).

Sessions of one agent start with the same tokens (system prompt + tool list). The first new session
to prefill them leaves them here (and continues from them itself); a later new session whose prompt
starts with the same tokens begins from them and prefills only its own task. A dense attention
layer's prefix is held once in memory however many sessions start from it (`prefixed_cache.py`:
each session keeps only its tail); other layers (sliding windows, quantized caches, a hybrid model's
recurrent state) are copied into each session. An entry is dropped (least recently used first, under
memory pressure or past `max_entries`) only while no session starts from it, so dropping one loses
nothing but time and always frees its bytes.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

from .kv_pool import CacheState, KVPool, cache_nbytes, shared_of, shared_prefix_of

DEFAULT_MAX_SHARED_PREFIXES = 8


class SharedPrefixes:
    """LRU map of prefix token ids -> the KV cache after prefilling exactly them."""

    def __init__(self, max_entries: int = DEFAULT_MAX_SHARED_PREFIXES, pool: KVPool | None = None) -> None:
        """`pool`: where every cache made here registers (the entries, and the copies handed out)."""
        self.max_entries = max_entries
        self._register = pool.register if pool is not None else (lambda cache: cache)
        self._caches: OrderedDict[tuple[int, ...], list[Any]] = OrderedDict()
        self.hits = 0

    def __contains__(self, ids: list[int]) -> bool:
        return tuple(ids) in self._caches

    def __len__(self) -> int:
        return len(self._caches)

    def nbytes(self) -> int:
        """The bytes the entries hold: each shared prefix once, and the layers copied into sessions."""
        return sum(_entry_nbytes(c) for c in self._caches.values())

    def add(self, ids: list[int], cache: list[Any]) -> list[Any]:
        """Keep what `cache` holds (exactly `ids`) as the entry for `ids`; a cache that starts from it,
        which the caller may take instead of `cache` (then `cache`'s own copy of the prefix can go)."""
        key = tuple(ids)
        if key not in self._caches:
            from .prefixed_cache import freeze

            self._caches[key] = self._register(freeze(cache, len(ids)))
        self._caches.move_to_end(key)
        taken = self._register(copy.deepcopy(self._caches[key]))
        while len(self._caches) > self.max_entries and self.drop_oldest():  # the new one is in use (`taken`)
            pass
        return taken

    def add_from(self, ids: list[int], state: CacheState) -> bool:
        """Make `ids`, the start of what an idle session's cache holds, an entry, and that session go on
        from it: the tokens are then held once, for it and each new session that starts with them (a
        client's conversation another one repeats). False where they would be copied, not shared (a layer
        that cannot start from a shared prefix, or fewer than `MIN_SHARED_TOKENS`)."""
        from mlx_lm.models.cache import trim_prompt_cache

        from .prefixed_cache import MIN_SHARED_TOKENS, OverPrefix, over_prefix

        cache = state.prompt_cache
        if not cache or len(ids) < MIN_SHARED_TOKENS or not all(isinstance(c, OverPrefix) for c in cache):
            return False
        head = copy.deepcopy(cache)  # views: nothing copied until the entry is frozen from them
        trim_prompt_cache(head, head[0].offset - len(ids))
        self.add(ids, head)
        state.prompt_cache = self._register(over_prefix(self._caches[tuple(ids)], cache))
        state.measure()
        return True

    def start(self, ids: list[int]) -> tuple[list[Any], int] | None:
        """A cache starting from the entry of the longest strict prefix of `ids`, and its length; None if
        none. Longest: a fork's entry (its parent's whole conversation) wins over its agent's prefix."""
        key = self._longest(ids)
        if key is None:
            return None
        self._caches.move_to_end(key)
        self.hits += 1
        return self._register(copy.deepcopy(self._caches[key])), len(key)

    def kept_for(self, state: CacheState) -> tuple[int, Any]:
        """The shared prefix a spilled cache comes back over: the one it started from, while it is still
        held ((0, None): it comes back whole)."""
        shared = state.spilled_over() if state.spilled_over is not None else None
        if shared is None:
            return 0, None
        entry = self._caches.get(tuple(state.token_ids[: shared.length]))
        return (shared.length, shared) if entry is not None and shared_of(entry) is shared else (0, None)

    def restore_over(self, state: CacheState) -> None:
        """A spilled cache just read back (holding all its tokens) goes on over the shared prefix it
        started from, if that is still held: the session holds only its tail again."""
        length, shared = self.kept_for(state)
        state.spilled_over = None
        if shared is None or state.prompt_cache is None:
            return
        from .prefixed_cache import over_prefix

        key = tuple(state.token_ids[:length])
        self._caches.move_to_end(key)
        state.prompt_cache = self._register(over_prefix(self._caches[key], state.prompt_cache))

    def covering(self, ids: list[int]) -> tuple[int, Any]:
        """The shared prefix `start(ids)` would start from: its length and its `SharedPrefix` ((0, None): none)."""
        key = self._longest(ids)
        return (0, None) if key is None else shared_prefix_of(self._caches[key])

    def _longest(self, ids: list[int]) -> tuple[int, ...] | None:
        keys = [k for k in self._caches if len(k) < len(ids) and tuple(ids[: len(k)]) == k]
        return max(keys, key=len) if keys else None

    def drop_oldest(self) -> int:
        """Forget the least recently used entry no session starts from; the bytes freed (0: none is left
        that no session starts from)."""
        for key, cache in self._caches.items():
            if not _in_use(cache):
                del self._caches[key]
                return _entry_nbytes(cache)
        return 0


def _entry_nbytes(cache: list[Any]) -> int:
    shared = shared_of(cache)
    return cache_nbytes(cache) + (shared.nbytes if shared is not None else 0)


def _in_use(cache: list[Any]) -> bool:
    """Whether a session (or a batch) starts from the entry: more users than the entry's own layers."""
    shared = shared_of(cache)
    own = sum(1 for c in cache if getattr(c, "shared", None) is shared)
    return shared is not None and len(shared.users) > own
