"""The KV pool as the one owner of the bytes held: its one read (`KVPool.held_bytes`) against the caches the
garbage collector finds alive, after each step of a mixed plan; `reserve`'s yes and no; a first turn's new
shared prefix held once."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlx_subagents.host import GenerateArgs, MlxModelHost
from mlx_subagents.host.kv.kv_pool import CacheState, KVPool
from tests.host.test_kv_pool import cache_holding

SYSTEM = {"role": "system", "content": "You are a scout. " + " ".join(f"Rule {n}: report paths." for n in range(40))}


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """For a test that walks the heap (`live_kv_bytes`): what this process held before the test (a test worker
    holds millions of objects: every module the suite imported, its fixtures) leaves the garbage collector's
    view for the test (`gc.freeze`, undone after), so that each walk goes over what the test made, not all."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def live_kv_bytes(collect: bool = False) -> int:
    """The bytes of every cache layer in this process's memory (with `frozen_heap`, made since the test
    began), found by the garbage collector (not by the pool): each layer's arrays (`nbytes`, mlx-lm's own sum
    over them) and each shared prefix once. Garbage not collected yet is in both counts (the pool's references
    are weak), so only a baseline collects."""
    from mlx_lm.models.cache import _BaseCache

    if collect:
        gc.collect()
    layers = [o for o in gc.get_objects() if isinstance(o, _BaseCache)]
    shared = {id(s): s for s in (getattr(layer, "shared", None) for layer in layers) if s is not None}
    return sum(layer.nbytes for layer in layers) + sum(s.nbytes for s in shared.values())


def talk(task: int) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": f"Task {task}: find module {task * 7}."}]


@pytest.mark.slow
@pytest.mark.usefixtures("frozen_heap")
@pytest.mark.parametrize("bits", [16, 8])
def test_the_pools_one_read_is_the_bytes_of_every_live_cache_after_each_step(
    quantizable: Callable[[str], Path], bits: int
) -> None:
    """Make, a shared prefix, a fork, three turns in one batch (read between their steps too), a spill under
    a lowered budget, the restore, an eviction and a session freed: after each, the pool's one read equals
    the bytes of the caches alive (whatever else this process held before the host, taken out)."""
    readings: list[tuple[str, int, int]] = []

    async def go() -> None:
        before = live_kv_bytes(collect=True)
        async with MlxModelHost(
            str(quantizable("qwen3")), kv_budget=0, kv_bits=bits, prefix_cache=0, drop_below_tokens=1
        ) as host:
            pool = host._scheduler.pool

            async def check(step: str) -> None:
                held, live = await host._mlx.run(lambda: (pool.held_bytes(), live_kv_bytes() - before))
                readings.append((step, held, live))

            a, b = host.session("a"), host.session("b")
            first = await a.generate(talk(1), GenerateArgs(max_tokens=8))
            await check("make")
            assert len(host._scheduler.prefixes) == 1
            second = await b.generate(talk(2), GenerateArgs(max_tokens=8))
            await check("prefix")
            fork = host.session("a-fork", fork_of="a")
            forked = [*talk(1), {"role": "assistant", "content": first.text}, {"role": "user", "content": "And?"}]
            await fork.generate(forked, GenerateArgs(max_tokens=8))
            await check("fork")
            gathered = asyncio.gather(
                *(host.session(f"g{i}").generate(talk(10 + i), GenerateArgs(max_tokens=24)) for i in range(3))
            )
            while not gathered.done() and len(readings) < 12:  # between their steps (a job runs between two)
                await check("batch")
            await gathered
            await check("batch")
            idle = await host._mlx.run(pool.held_bytes)
            await host.set_kv_budget(idle // 2)  # the idle caches over half of it are spilled
            assert pool.counters.spills > 0
            await check("spill")
            await host.set_kv_budget(None)
            again = [*talk(2), {"role": "assistant", "content": second.text}, {"role": "user", "content": "Again."}]
            await b.generate(again, GenerateArgs(max_tokens=8))  # b was spilled (a holds only the fork's prefix)
            assert pool.counters.restores > 0
            await check("restore")
            assert await host._mlx.run(pool.release)
            await check("evict")
            for name in ("a", "g0", "a-fork"):
                await host.session(name).close()
            await check("free")

    asyncio.run(go())
    steps = [step for step, _, _ in readings]
    assert {"make", "prefix", "fork", "batch", "spill", "restore", "evict", "free"} <= set(steps)
    assert steps.count("batch") > 2  # read while the batch held rows, not only after
    assert [(step, held) for step, held, _ in readings] == [(step, live) for step, _, live in readings]
    assert all(held > 0 for _, held, _ in readings)


@pytest.mark.slow
@pytest.mark.usefixtures("frozen_heap")
def test_the_pools_one_read_counts_a_prefill_group_at_every_step(tiny_qwen3: tuple[Any, Any]) -> None:
    """Two short prompts arriving with nothing decoding are prefilled as one group, 8 tokens a slice,
    then decode in the batch: after every step of the scheduler the one read equals the bytes alive."""
    from tests.host.test_batching import task
    from tests.host.test_prefill import make_turn, scheduler

    results: dict[str, Any] = {}
    sch = scheduler(tiny_qwen3, 64, step_size=8)
    before = live_kv_bytes(collect=True)
    for name, i in (("b", 1), ("c", 2)):
        sch.submit(make_turn(name, task(i), 4, results))
    grouped, readings = 0, []
    while sch.has_work():
        sch.step()
        grouped += bool(sch.prefill.groups)
        readings.append((sch.pool.held_bytes(), live_kv_bytes() - before))
    assert set(results) == {"b", "c"} and grouped > 1
    assert [held for held, _ in readings] == [live for _, live in readings]


def test_reserve_says_no_when_the_worst_case_cannot_fit_and_yes_after_an_eviction() -> None:
    """A budget of 3 KV steps of the test cache: two idle sessions hold 2; a turn's worst case of 2 fits only
    once the least recently used idle cache is evicted (yes), one of 4 never does (no)."""
    one = cache_holding(10, 1.0)[0].nbytes  # a cache of 10 tokens holds one KV step as allocated
    pool = KVPool(3 * one)
    for name in ("old", "new"):
        pool.park(name, CacheState(prompt_cache=cache_holding(10, 1.0), token_ids=list(range(10))))
    assert pool.held_bytes() == pool.idle_bytes() == 2 * one
    assert pool.reserve(one) and pool.counters.evictions == 0  # it fits beside both
    assert pool.reserve(2 * one)
    assert pool.counters.evictions == 1 and pool.idle("old").prompt_cache is None
    assert pool.idle("new").prompt_cache is not None
    assert pool.held_bytes() == pool.idle_bytes() == one  # the evicted cache left the pool's count when freed
    assert not pool.reserve(4 * one)  # over the budget even alone


@pytest.mark.slow
@pytest.mark.usefixtures("frozen_heap")
def test_a_first_turns_new_shared_prefix_is_held_once(tiny_qwen3_path: Path) -> None:
    """A session's first turn adds its agent's prefix and goes on from it: the bytes held are the prefix
    once and the session's own tail, to the byte (the arrays the garbage collector finds agree), not the
    prefix a second time in the session's cache."""

    async def go() -> tuple[int, int, int, int]:
        async with MlxModelHost(str(tiny_qwen3_path), kv_budget=0, prefix_cache=0) as host:
            await host.session("a").generate(talk(1), GenerateArgs(max_tokens=8))
            scheduler = host._scheduler

            def read() -> tuple[int, int, int, int]:
                cache = scheduler.pool.idle("a").prompt_cache  # type: ignore[union-attr]
                shared = {layer.shared for layer in cache}
                assert len(shared) == 1 and None not in shared
                (prefix,) = shared
                return scheduler.pool.held_bytes(), prefix.nbytes, sum(c.nbytes for c in cache), live_kv_bytes()

            return await host._mlx.run(read)

    before = live_kv_bytes(collect=True)
    held, prefix, tail, live = asyncio.run(go())
    assert held == prefix + tail == live - before
    assert 0 < tail < prefix


def test_registering_a_cache_twice_counts_it_once_and_a_freed_one_not_at_all() -> None:
    pool = KVPool(None)
    cache = cache_holding(300, 1.0)
    pool.register(cache)
    pool.register(cache)
    assert pool.held_bytes() == sum(c.nbytes for c in cache) > 0
    del cache
    gc.collect()
    assert pool.held_bytes() == 0
    mx.clear_cache()


def test_the_last_resort_evicts_the_idle_sessions_over_a_prefix_drops_it_and_the_turn_runs_whole() -> None:
    """Nothing in flight; two idle sessions start from one shared prefix, and the turn of one of them fits
    only whole (over the prefix it needs the prefix and its own part, each in whole KV steps: a step more).
    Both sessions give way (the other holding nothing of its own), the prefix is dropped, and the turn
    starts with nothing else held: the pool's one read is 0 and the turn's worst case whole fits."""
    from mlx_subagents.host.kv.kv_pool import KVShape, TurnSize, admission_bytes
    from mlx_subagents.host.kv.prefix_cache import SharedPrefixes
    from mlx_subagents.host.kv.prefixed_cache import PrefixedKVCache
    from mlx_subagents.host.mlx.admission import Admission
    from tests.host.test_admission import turn

    shape = KVShape(fixed=0, per_token=32)  # one layer, one head of 4 floats: keys and values
    pool = KVPool(25_000, drop_below_tokens=10**6)  # evicted caches are dropped, not spilled
    prefixes = SharedPrefixes(pool=pool)
    a = Admission(pool, prefixes, shape, batching=True, reuse=True, trimmable=True, shares=lambda: True)
    layer = PrefixedKVCache()
    layer.update_and_fetch(mx.ones((1, 1, 300, 4)), mx.ones((1, 1, 300, 4)))
    own = CacheState(prompt_cache=prefixes.add(list(range(300)), [layer]), token_ids=list(range(300)))
    del layer
    started = prefixes.start([*range(300), 7])
    assert started is not None
    other = CacheState(prompt_cache=started[0], token_ids=list(range(300)))
    del started  # the session's state holds its cache, nothing else
    pool.park("other", other)
    pool.park("own", own)
    assert pool.held_bytes() == 300 * 32  # the prefix once; neither session holds anything of its own yet
    t = turn("own", n_prompt=400, max_tokens=100)
    t.state = own
    verdicts = [a.judge(t, [])]
    while verdicts[-1] == "retry" and len(verdicts) < 5:
        verdicts.append(a.judge(t, []))
    assert verdicts == ["retry", "retry", "start"]  # the sessions evicted; the prefix dropped; it fits whole
    assert len(prefixes) == 0 and pool.counters.evictions == 2 and other.prompt_cache is None
    gc.collect()
    assert pool.held_bytes() == 0
    whole = admission_bytes(shape, [TurnSize(400 + 100, 400)], batched=True, trimmable=True)
    assert whole <= pool.budget  # type: ignore[operator]
