"""A mapping bounded to the entries used last: the one cache shape for what is costly to make again.

A grammar compiled for a tool set, whether one tool's schema can be expressed, a JSON schema that passed
its check: each is asked again with every request of a conversation, and each key comes from a client, so
the cache is bounded (the least recently used entry goes first) rather than growing with every distinct
key a client sends. `functools.lru_cache` does not fit where the value is made under a lock of the
caller's or where the key is a digest of an argument rather than the argument.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Recent(Generic[K, V]):
    """The `limit` entries used last, by key; not thread-safe (a caller with threads holds its lock)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a Recent mapping keeps at least one entry, not {limit}")
        self.limit = limit
        self._entries: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        """The value kept for `key`, now the most recently used one; None when it is not kept."""
        if key not in self._entries:
            return None
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key: K, value: V) -> None:
        """Keeps `value` for `key` as the most recently used entry, dropping the least recent beyond `limit`."""
        self._entries[key] = value
        self._entries.move_to_end(key)
        if len(self._entries) > self.limit:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries
