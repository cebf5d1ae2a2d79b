"""Admission control without a model: what gives way for a waiting turn, in order, and the refusal."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest

from mlx_subagents.errors import PromptTooLongError
from mlx_subagents.host.kv.kv_pool import KV_STEP, CacheState, KVPool, KVShape
from mlx_subagents.host.kv.prefix_cache import SharedPrefixes
from mlx_subagents.host.mlx.admission import Admission
from mlx_subagents.host.mlx.turn import Request, Turn
from tests.host.test_kv_pool import cache_holding

SHAPE = KVShape(fixed=0, per_token=4096)  # a KV step (256 tokens) is 1 MiB
MIB = 2**20
assert SHAPE.bytes_for(KV_STEP) == MIB


def turn(name: str, n_prompt: int = 300, max_tokens: int = 100, prefix: int = 0) -> Turn:
    """A waiting turn of `n_prompt + max_tokens` tokens (3 MiB with a step of slack), whose first `prefix`
    tokens are its agent's shareable prefix."""
    t = Turn(name, CacheState(), Request([], None, max_tokens, 0.0), threading.Event())
    t.ids, t.max_tokens, t.prefix = list(range(n_prompt)), max_tokens, list(range(prefix))
    return t


def admission(budget: int | None) -> Admission:
    return Admission(
        KVPool(budget), SharedPrefixes(), SHAPE, batching=True, reuse=True, trimmable=True, shares=lambda: True
    )


def park(a: Admission, name: str, n_tokens: int = 10) -> None:
    a.pool.park(name, CacheState(prompt_cache=cache_holding(n_tokens, 1.0), token_ids=list(range(n_tokens))))


def test_a_turn_that_fits_starts_and_idle_caches_make_room_least_recent_first_never_its_own() -> None:
    a = admission(3 * MIB + 8 * 1024)  # the turn, and one idle cache of 10 tokens (8 KiB as allocated)
    park(a, "old")
    park(a, "own")  # the waiting turn's session: its idle cache is part of what the turn counts
    park(a, "new")
    assert a.judge(turn("own"), []) == "start"
    # One eviction made room: the least recently used other session, not the turn's own.
    assert (a.pool.counters.evictions, a.pool.idle("old").prompt_cache) == (1, None)
    assert a.pool.idle("own").prompt_cache is not None and a.pool.idle("new").prompt_cache is not None
    assert admission(None).judge(turn("x", 10**6), []) == "start"  # unbounded: everything fits


def test_a_new_shared_prefix_is_given_up_before_the_turn_waits() -> None:
    a = admission(3 * MIB)
    t = turn("a", prefix=200)  # 3 MiB of its own and 1 MiB for a new shared copy of its prefix
    assert a.judge(t, []) == "retry"
    assert t.prefix == []  # it prefills privately
    assert a.judge(t, []) == "start"


def test_with_nothing_in_flight_unused_shared_prefixes_are_dropped_oldest_first() -> None:
    a = admission(3 * MIB + 16 * 1024)
    a.prefixes.add(list(range(1000, 1500)), cache_holding(500, 1.0))  # no session starts from these
    a.prefixes.add(list(range(2000, 2500)), cache_holding(500, 2.0))
    assert a.prefixes.nbytes() == 2 * 16 * 1024  # 500 tokens in two KV steps, keys and values of 4 floats
    assert a.judge(turn("a"), []) == "retry"
    assert list(range(1000, 1500)) not in a.prefixes and list(range(2000, 2500)) in a.prefixes
    assert a.judge(turn("a"), []) == "start"


def test_a_turn_that_fits_only_alone_waits_for_the_work_in_flight_counted_once() -> None:
    a = admission(4 * MIB)
    running, waiting = turn("running"), turn("waiting")
    assert a.judge(running, []) == "start"
    # Together they need 6 MiB (a batch pads both to the longer): the second waits, however often it is asked.
    assert [a.judge(waiting, [running]) for _ in range(3)] == ["wait"] * 3
    assert a.pool.counters.admission_waits == 1
    assert a.judge(waiting, []) == "start"  # the first one ended


def test_a_turn_that_cannot_fit_even_alone_is_refused_in_one_line() -> None:
    a = admission(2 * MIB)
    with pytest.raises(PromptTooLongError) as refused:
        a.judge(turn("a"), [])
    assert str(refused.value) == (
        "this turn needs about 3.0 MiB of KV cache (400 tokens) but the KV budget is 2.0 MiB; "
        "raise --kv-budget or lower max_tokens"
    )


@pytest.mark.parametrize(
    ("shares", "prefix", "counted_once"), [(True, 300, True), (False, 300, False), (True, 200, False)]
)
def test_a_first_turn_counts_the_prefix_it_adds_once_where_it_goes_on_from_it(
    shares: bool, prefix: int, counted_once: bool
) -> None:
    """A session's first turn (800 tokens) that adds its agent's prefix goes on from the entry: the prefix
    is counted there only (2 MiB for 300 tokens, and 3 for the rest of the turn), so a budget of 5 MiB
    keeps it shared. Where the model's caches hold no prefix once, or the prefix is too short to share
    (200 tokens: it is copied into the session), the turn holds it as well: counted twice (7 and 6 MiB),
    the prefix is given up and the turn runs whole (5 MiB)."""
    a = Admission(
        KVPool(5 * MIB), SharedPrefixes(), SHAPE, batching=True, reuse=True, trimmable=True, shares=lambda: shares
    )
    first = turn("a", n_prompt=700, max_tokens=100, prefix=prefix)
    verdicts = [a.judge(first, [])]
    if verdicts[0] == "retry":
        verdicts.append(a.judge(first, []))
    assert verdicts == (["start"] if counted_once else ["retry", "start"])
    assert first.prefix == (list(range(prefix)) if counted_once else [])


def test_before_refusing_a_turn_the_caches_keeping_a_prefix_in_use_give_way_and_it_runs_whole() -> None:
    """Nothing in flight, and the turn's own idle session holds its conversation over a shared prefix:
    the prefix and the turn's own part, each in whole KV steps, need a step more than the same tokens
    whole, which the budget holds. Its cache is evicted (so the prefix is no longer in use), the prefix
    dropped, and the turn starts whole instead of being refused."""
    from mlx_subagents.host.kv.prefixed_cache import PrefixedKVCache

    shape = KVShape(fixed=0, per_token=32)  # one layer, one head of 4 floats: keys and values
    a = Admission(
        KVPool(25_000), SharedPrefixes(), shape, batching=True, reuse=True, trimmable=True, shares=lambda: True
    )
    layer = PrefixedKVCache()
    layer.update_and_fetch(mx.ones((1, 1, 300, 4)), mx.ones((1, 1, 300, 4)))
    own = CacheState(prompt_cache=a.prefixes.add(list(range(300)), [layer]), token_ids=list(range(300)))
    del layer
    a.pool.park("own", own)
    assert a.prefixes.nbytes() == 300 * 32 and a.prefixes.drop_oldest() == 0  # the entry, in use
    t = turn("own", n_prompt=400, max_tokens=100)
    t.state = own
    # Over the prefix: 9,600 bytes of it and 2 steps (16,384) for the rest; whole: 3 steps (24,576).
    verdicts = [a.judge(t, []) for _ in range(3)]
    assert verdicts[-1] == "start" and set(verdicts[:-1]) == {"retry"}
    assert len(a.prefixes) == 0 and a.pool.counters.evictions == 1
