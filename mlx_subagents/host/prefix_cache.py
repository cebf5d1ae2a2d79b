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
from typing import TYPE_CHECKING, Any

from .kv_pool import cache_nbytes

if TYPE_CHECKING:  # imported where they run: importing the host stays quick (no mlx-lm)
    from .prefixed_cache import SharedPrefix

DEFAULT_MAX_SHARED_PREFIXES = 8


class SharedPrefixes:
    """LRU map of prefix token ids -> the KV cache after prefilling exactly them."""

    def __init__(self, max_entries: int = DEFAULT_MAX_SHARED_PREFIXES) -> None:
        self.max_entries = max_entries
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

            self._caches[key] = freeze(cache, len(ids))
        self._caches.move_to_end(key)
        taken = copy.deepcopy(self._caches[key])
        while len(self._caches) > self.max_entries and self.drop_oldest():  # the new one is in use (`taken`)
            pass
        return taken

    def start(self, ids: list[int]) -> tuple[list[Any], int] | None:
        """A cache starting from the entry of the longest strict prefix of `ids`, and its length; None if
        none. Longest: a fork's entry (its parent's whole conversation) wins over its agent's prefix."""
        key = self._longest(ids)
        if key is None:
            return None
        self._caches.move_to_end(key)
        self.hits += 1
        return copy.deepcopy(self._caches[key]), len(key)

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


def _shared_of(cache: list[Any]) -> SharedPrefix | None:
    return next((c.shared for c in cache if getattr(c, "shared", None) is not None), None)


def shared_prefix_of(cache: list[Any] | None) -> tuple[int, Any]:
    """The shared prefix a cache starts from: its length in tokens and its `SharedPrefix` ((0, None): none)."""
    shared = _shared_of(cache) if cache else None
    return (0, None) if shared is None else (shared.length, shared)


def _entry_nbytes(cache: list[Any]) -> int:
    shared = _shared_of(cache)
    return cache_nbytes(cache) + (shared.nbytes if shared is not None else 0)


def _in_use(cache: list[Any]) -> bool:
    """Whether a session (or a batch) starts from the entry: more users than the entry's own layers."""
    shared = _shared_of(cache)
    own = sum(1 for c in cache if getattr(c, "shared", None) is shared)
    return shared is not None and len(shared.users) > own
