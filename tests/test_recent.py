"""The bounded cache of what is costly to make again: the least recently used entry goes first."""

from __future__ import annotations

import pytest

from mlx_subagents.recent import Recent


def test_the_least_recently_used_entry_goes_first_and_a_read_counts_as_use() -> None:
    recent: Recent[str, int] = Recent(2)
    recent.put("a", 1)
    recent.put("b", 2)
    assert recent.get("a") == 1  # "a" used last now: "b" is the oldest
    recent.put("c", 3)
    assert ("a" in recent, "b" in recent, "c" in recent, len(recent)) == (True, False, True, 2)
    assert recent.get("b") is None


def test_putting_a_kept_key_again_replaces_its_value_and_keeps_one_entry() -> None:
    recent: Recent[str, bool] = Recent(2)
    recent.put("a", False)
    recent.put("b", True)
    recent.put("a", True)  # "a" replaced and used last: "b" goes at the next put
    recent.put("c", True)
    assert (recent.get("a"), "b" in recent, len(recent)) == (True, False, 2)


def test_a_falsy_value_is_kept_and_told_apart_from_a_missing_one() -> None:
    recent: Recent[str, bool] = Recent(4)
    recent.put("inexpressible", False)
    assert (recent.get("inexpressible"), recent.get("unknown")) == (False, None)


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="a Recent mapping keeps at least one entry, not 0"):
        Recent(0)
