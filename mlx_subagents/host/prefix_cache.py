"""Shared prefixes: one KV cache of an agent's system prompt and tools, copied into each new session;
and of a parent's conversation at a fork, copied into each of its forks (`Scheduler.fork`).

Sessions of one agent start with the same tokens (system prompt + tool list). The
first new session to prefill them leaves a copy here; a later new session whose
prompt starts with the same tokens begins from a copy of it and prefills only
its own task. Entries are copies, so dropping one (least recently used first,
under memory pressure or past `max_entries`) never loses anything but time.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

from .kv_pool import cache_nbytes

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
        return sum(cache_nbytes(c) for c in self._caches.values())

    def add(self, ids: list[int], cache: list[Any]) -> None:
        """Keep a copy of `cache`, which holds exactly `ids`."""
        self._caches[tuple(ids)] = copy.deepcopy(cache)
        while len(self._caches) > self.max_entries:
            self._caches.popitem(last=False)

    def start(self, ids: list[int]) -> tuple[list[Any], int] | None:
        """A private copy of the cache holding the longest strict prefix of `ids`, and its length; None
        if none. Longest: a fork's entry (its parent's whole conversation) wins over its agent's prefix."""
        keys = [k for k in self._caches if len(k) < len(ids) and tuple(ids[: len(k)]) == k]
        if not keys:
            return None
        key = max(keys, key=len)
        self._caches.move_to_end(key)
        self.hits += 1
        return copy.deepcopy(self._caches[key]), len(key)

    def drop_oldest(self) -> int:
        """Forget the least recently used entry; the bytes freed (0 when empty)."""
        if not self._caches:
            return 0
        _, cache = self._caches.popitem(last=False)
        return cache_nbytes(cache)
