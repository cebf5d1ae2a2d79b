"""KV caches over a shared prefix: the same logits as one cache holding it all, single and batched,
and the prefix held once in memory however many sessions start from it."""

from __future__ import annotations

import asyncio
import copy
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlx_subagents.host import GenerateArgs, MlxModelHost
from mlx_subagents.host.kv.kv_pool import KVPool, KVShape, TurnSize, admission_bytes, shared_prefix_of
from mlx_subagents.host.kv.prefix_cache import SharedPrefixes
from mlx_subagents.host.kv.prefixed_cache import MIN_SHARED_TOKENS, BatchPrefixedKVCache, PrefixedKVCache, SharedPrefix
from mlx_subagents.host.mlx.turn import Request, Turn

PREFIX = [(i * 7) % 500 + 3 for i in range(300)]
TAILS = [[(i * 13 + j) % 400 + 5 for i in range(10 + 7 * j)] for j in range(3)]
FOLLOW = [(i * 31) % 600 + 7 for i in range(12)]  # fed one at a time after each tail (decode steps)


def plain(model: Any) -> list[KVCache]:
    cache = [KVCache() for _ in model.layers]
    model(mx.array([PREFIX]), cache=cache)
    return cache


def shared_prefix(model: Any) -> SharedPrefix:
    cache = [PrefixedKVCache() for _ in model.layers]
    model(mx.array([PREFIX]), cache=cache)
    return SharedPrefix([c.frozen() for c in cache], len(PREFIX))


def over(shared: SharedPrefix, model: Any) -> list[PrefixedKVCache]:
    return [PrefixedKVCache(shared, layer) for layer in range(len(model.layers))]


def single_logits(model: Any, cache: list[Any], tail: list[int]) -> mx.array:
    steps = [model(mx.array([tail]), cache=cache)[:, -1]]
    steps += [model(mx.array([[token]]), cache=cache)[:, -1] for token in FOLLOW]
    return mx.concatenate(steps)


def batch_logits(model: Any, caches: list[list[Any]], kind: type) -> list[mx.array]:
    """Each row's tail fed on its own cache, then the rows merged as mlx-lm merges them (left-padded to the
    longest) and the decode steps fed to all at once."""
    firsts = [model(mx.array([tail]), cache=cache)[:, -1] for cache, tail in zip(caches, TAILS, strict=True)]
    merged = [kind.merge([c[layer] for c in caches]) for layer in range(len(model.layers))]
    steps = [model(mx.array([[token]] * len(caches)), cache=merged)[:, -1] for token in FOLLOW]
    return [mx.concatenate([first, *(step[i : i + 1] for step in steps)]) for i, first in enumerate(firsts)]


def same(a: list[mx.array], b: list[mx.array]) -> bool:
    return all(mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True))


def test_a_cache_over_a_shared_prefix_gives_the_logits_of_one_holding_it_all(tiny_qwen3: Any) -> None:
    model, _ = tiny_qwen3
    shared = shared_prefix(model)
    alone = [single_logits(model, plain(model), t) for t in TAILS]
    assert same([single_logits(model, over(shared, model), t) for t in TAILS], alone)
    # Every row of a batch over the shared prefix: its padding between the prefix and its tail is masked.
    assert same(batch_logits(model, [over(shared, model) for _ in TAILS], BatchPrefixedKVCache), alone)
    assert shared.layers[0][0].shape[2] == len(PREFIX) and shared.length == len(PREFIX)


def test_rows_of_another_prefix_make_the_batch_hold_them_whole(tiny_qwen3: Any) -> None:
    """A batch of rows over different prefixes (or none) holds each row whole, as mlx-lm's batch does; a
    row of another prefix that joins a shared batch makes it do so too. The tokens stay the same."""
    model, tokenizer = tiny_qwen3
    shared, other = shared_prefix(model), shared_prefix(model)  # equal values, different prefixes
    mixed = [over(shared, model), over(other, model), [PrefixedKVCache().__class__() for _ in model.layers]]
    model(mx.array([PREFIX]), cache=mixed[2])
    merged = BatchPrefixedKVCache.merge([c[0] for c in mixed])
    assert merged.shared is None and merged.keys.shape[2] == len(PREFIX)

    def decode(joining: list[list[Any]]) -> list[list[int]]:
        batch = BatchGenerator(model, stop_tokens=[[tokenizer.eos_token_id]], prefill_step_size=64)
        uids = batch.insert(TAILS[:1], max_tokens=[12], caches=[over(shared, model)], all_tokens=[PREFIX])
        out: dict[int, list[int]] = {uids[0]: []}
        for _ in range(4):  # the first row decodes alone a few steps, over its shared prefix
            for r in batch.next()[1]:
                out[r.uid].append(r.token)
        assert batch._generation_batch.prompt_cache[0].shared is shared
        for uid in batch.insert(TAILS[1:], max_tokens=[12, 12], caches=joining, all_tokens=[PREFIX] * 2):
            out[uid] = []
        while any(len(t) < 12 for t in out.values()):
            for r in batch.next()[1]:
                out[r.uid].append(r.token)
        return list(out.values())

    def reference() -> list[list[int]]:
        out = []
        for tail in TAILS:
            cache, tokens = plain(model), []
            logits = model(mx.array([tail]), cache=cache)[:, -1]
            for _ in range(12):
                tokens.append(int(mx.argmax(logits, axis=-1).item()))
                logits = model(mx.array([tokens[-1:]]), cache=cache)[:, -1]
            out.append(tokens)
        return out

    expected = reference()
    assert decode([over(shared, model), over(shared, model)]) == expected  # the same prefix: it stays shared
    assert decode([over(other, model), over(shared, model)]) == expected  # another prefix joins: held whole


def test_trimming_into_the_prefix_leaves_it_untouched(tiny_qwen3: Any) -> None:
    model, _ = tiny_qwen3
    shared = shared_prefix(model)
    before = [mx.array(k) for k, _ in shared.layers]  # copies of the shared keys
    cache = over(shared, model)
    model(mx.array([TAILS[0]]), cache=cache)
    for layer in cache:  # back 50 tokens into the prefix: the cache then holds what is left of it itself
        assert layer.trim(len(TAILS[0]) + 50) == len(TAILS[0]) + 50
        assert layer.shared is None and layer.offset == len(PREFIX) - 50
    reference = plain(model)
    for layer in reference:
        layer.trim(50)
    assert same([single_logits(model, cache, TAILS[1])], [single_logits(model, reference, TAILS[1])])
    assert all(mx.array_equal(k, b).item() for (k, _), b in zip(shared.layers, before, strict=True))


def test_entries_are_held_once_and_kept_while_a_session_starts_from_them(tiny_qwen3: Any) -> None:
    model, _ = tiny_qwen3
    prefixes = SharedPrefixes(max_entries=1)
    first = [PrefixedKVCache() for _ in model.layers]
    model(mx.array([PREFIX]), cache=first)
    own = sum(c.nbytes for c in first)  # the first session's buffer: the prefix in whole 256-token steps
    taken = prefixes.add(PREFIX, first)  # the first session goes on from the entry, its own buffer let go
    exact = 2 * len(model.layers) * first[0].keys[..., : len(PREFIX), :].nbytes
    assert prefixes.nbytes() == exact < own and sum(c.nbytes for c in taken) == 0
    sessions = [prefixes.start([*PREFIX, 1])[0] for _ in range(3)]  # type: ignore[index]
    assert all(layer.shared is taken[0].shared for s in sessions for layer in s)
    assert prefixes.nbytes() == exact  # four sessions, one prefix
    second = PREFIX[::-1]
    other = [PrefixedKVCache() for _ in model.layers]
    model(mx.array([second]), cache=other)
    fresh = prefixes.add(second, other)  # past max_entries, but both are in use: both kept
    assert PREFIX in prefixes and second in prefixes and fresh[0].shared is not None
    del fresh
    assert prefixes.drop_oldest() == exact and second not in prefixes  # the older one is in use: skipped
    assert prefixes.drop_oldest() == 0 and len(prefixes) == 1
    short = [PrefixedKVCache() for _ in model.layers]
    model(mx.array([[5, 6]]), cache=short)
    assert prefixes.add([5, 6], short)[0].shared is None  # under MIN_SHARED_TOKENS: copies, not held once
    assert [5, 6] not in prefixes and len(prefixes) == 1  # past max_entries and in use by none: dropped
    del taken, sessions
    assert prefixes.drop_oldest() == exact and len(prefixes) == 0


def test_a_spilled_prefixed_cache_comes_back_whole(tiny_qwen3: Any, tmp_path: Path) -> None:
    from mlx_subagents.host.kv.kv_pool import CacheState

    model, _ = tiny_qwen3
    shared = shared_prefix(model)
    cache = over(shared, model)
    model(mx.array([TAILS[0]]), cache=cache)
    held = PREFIX + TAILS[0]
    pool = KVPool(budget=None, spill_dir=tmp_path, drop_below_tokens=1)
    state = CacheState(prompt_cache=cache, token_ids=held)
    pool.evict(state)
    assert state.prompt_cache is None and state.spill_path is not None
    pool.restore(state)
    restored = state.prompt_cache
    assert restored is not None and all(type(c) is PrefixedKVCache and c.shared is None for c in restored)
    expected = over(shared, model)
    model(mx.array([TAILS[0]]), cache=expected)
    assert same([single_logits(model, restored, TAILS[1])], [single_logits(model, expected, TAILS[1])])


def test_copies_keep_the_shared_prefix(tiny_qwen3: Any) -> None:
    model, _ = tiny_qwen3
    shared = shared_prefix(model)
    cache = over(shared, model)
    model(mx.array([TAILS[0]]), cache=cache)
    twin = copy.deepcopy(cache)
    assert all(a.shared is b.shared is shared for a, b in zip(cache, twin, strict=True))
    model(mx.array([TAILS[1]]), cache=twin)  # the copy goes on; the original is unchanged
    assert cache[0].offset == len(PREFIX) + len(TAILS[0]) and twin[0].offset == cache[0].offset + len(TAILS[1])
    assert len(shared.users) == 2 * len(model.layers)


@pytest.mark.parametrize("prefixed", [True, False], ids=["over-a-prefix", "whole"])
def test_a_copy_going_on_leaves_the_original_untouched(tiny_qwen3: Any, prefixed: bool) -> None:
    """Both write into their buffers in place, after the same position: the copy's writes must not land in
    the original's arrays (a snapshot restored, an entry started twice)."""
    model, _ = tiny_qwen3

    def start() -> list[PrefixedKVCache]:
        if prefixed:
            cache = over(shared_prefix(model), model)
        else:
            cache = [PrefixedKVCache() for _ in model.layers]
            model(mx.array([PREFIX]), cache=cache)
        model(mx.array([TAILS[0]]), cache=cache)
        return cache

    reference, cache = start(), start()
    twin = copy.deepcopy(cache)
    expected = single_logits(model, reference, TAILS[1])
    model(mx.array([TAILS[1]]), cache=cache)
    model(mx.array([TAILS[2]]), cache=twin)  # where the original just wrote TAILS[1]
    steps = [model(mx.array([[token]]), cache=cache)[:, -1] for token in FOLLOW]
    assert same([mx.concatenate(steps)], [expected[1:]])


SYSTEM = {"role": "system", "content": "You are a scout. " + " ".join(f"Rule {n}: report paths." for n in range(40))}


def test_sessions_of_one_agent_hold_its_prefix_once(tiny_qwen3_path: Path) -> None:
    """Four sessions of one agent (one system prompt, their own tasks) on one host: every dense layer of
    their caches starts from one shared prefix, so the host holds it once, and the KV bytes it counts
    are that prefix and four tails; the same sessions without sharing hold four whole caches. The
    tokens are the same either way."""

    def task(i: int) -> list[dict[str, Any]]:
        return [SYSTEM, {"role": "user", "content": f"Task {i}: where is module {i * 7} configured?"}]

    async def go(share: bool) -> tuple[list[tuple[int, ...]], int, int, list[Any]]:
        async with MlxModelHost(str(tiny_qwen3_path), share_prefix=share) as host:
            replies = await asyncio.gather(
                *(host.session(f"s{i}").generate(task(i), GenerateArgs(max_tokens=16)) for i in range(4))
            )
            scheduler = host._scheduler
            caches = [scheduler.pool.idle(f"s{i}").prompt_cache for i in range(4)]  # type: ignore[union-attr]
            held = await host._mlx.run(scheduler.resident_bytes)
            return [r.token_ids for r in replies], held, scheduler.prefixes.nbytes(), caches

    shared_ids, shared_bytes, prefix_bytes, caches = asyncio.run(go(True))
    private_ids, private_bytes, _, private = asyncio.run(go(False))
    assert shared_ids == private_ids
    prefixes = {id(layer.shared) for cache in caches for layer in cache}
    assert len(prefixes) == 1 and None not in {layer.shared for cache in caches for layer in cache}
    tails = sum(layer.nbytes for cache in caches for layer in cache)
    assert shared_bytes == prefix_bytes + tails
    assert private_bytes == sum(layer.nbytes for cache in private for layer in cache)
    assert all(sum(layer.nbytes for layer in cache) < prefix_bytes for cache in caches)  # a tail, not a copy
    assert shared_bytes < private_bytes / 2


def test_making_room_for_a_turn_never_evicts_its_own_session(tiny_qwen3_path: Path) -> None:
    """Admission makes room by evicting idle caches, least recently used first; the session whose turn it
    admits is never one of them. Its idle cache is part of what its turn was counted for, and evicting it
    spilled it to disk only to read it back at once, whole: a cache over a shared prefix came back with
    its own copy of the prefix, more than its turn was counted for. Here s0 (used before s1) takes a second turn under a budget
    that holds its turn, s1's idle cache and the prefix: nothing is evicted, s0 goes on over the prefix,
    and the tokens are an unbounded host's."""

    def ask(i: int) -> dict[str, Any]:
        return {"role": "user", "content": f"Task {i}: where is module {i * 7} configured?"}

    async def go(n_second: int | None) -> tuple[list[Any], dict[str, int], int | None, bool]:
        async with MlxModelHost(str(tiny_qwen3_path)) as host:
            s0, s1 = host.session("s0"), host.session("s1")
            first = await s0.generate([SYSTEM, ask(0)], GenerateArgs(max_tokens=8))
            other = await s1.generate([SYSTEM, ask(1)], GenerateArgs(max_tokens=8))
            second = [SYSTEM, ask(0), {"role": "assistant", "content": first.text}, ask(2)]
            scheduler = host._scheduler
            if n_second is not None:  # s0's turn (its prompt as an unbounded host had it), s1's idle cache, the prefix
                stats = await host.memory_stats()
                turn = TurnSize(n_second + 8, n_second, other.usage.cached_tokens, "p")
                needed = admission_bytes(host.kv_shape, [turn], batched=True, trimmable=True)
                await host.set_kv_budget(needed + stats.kv_bytes_by_session["s1"] + scheduler.prefixes.nbytes())
            again = await s0.generate(second, GenerateArgs(max_tokens=8))
            stats = await host.memory_stats()
            held = scheduler.pool.idle("s0").prompt_cache  # type: ignore[union-attr]
            over = all(layer.shared is not None for layer in held)
            return [first, other, again], stats.pool, stats.kv_budget, over

    free, _, _, _ = asyncio.run(go(None))
    tight, pool, budget, over = asyncio.run(go(free[2].usage.prompt_tokens))
    assert [r.token_ids for r in tight] == [r.token_ids for r in free]
    assert (pool["evictions"], pool["spills"], pool["restores"]) == (0, 0, 0)
    assert budget is not None and pool["peak_bytes"] <= budget
    assert over and tight[2].usage.cached_tokens == free[2].usage.cached_tokens


def test_a_first_turn_under_a_tight_budget_keeps_its_prefix_for_the_next_session(tiny_qwen3_path: Path) -> None:
    """A first turn that adds its agent's shared prefix goes on from it, so admission counts the prefix
    once (with the entries), not there and again in the turn. Under a budget that holds the prefix and
    one session's tail but not the prefix twice, the first session keeps the prefix shared and the next
    session of the agent starts from it (counting it twice, the first turn gave up sharing: the next
    one prefilled the prefix again). The tokens are the ones an unbounded host gives."""

    def task(i: int) -> list[dict[str, Any]]:
        return [SYSTEM, {"role": "user", "content": f"Task {i}: where is module {i * 7} configured?"}]

    async def go(budget: int | None) -> tuple[list[Any], KVShape]:
        async with MlxModelHost(str(tiny_qwen3_path)) as host:
            await host.set_kv_budget(budget)  # after the start: it sizes no window for five such sessions
            replies = [await host.session(f"s{i}").generate(task(i), GenerateArgs(max_tokens=8)) for i in range(2)]
            return replies, host.kv_shape

    free, shape = asyncio.run(go(None))
    prefix = free[1].usage.cached_tokens  # the second session started from the agent's prefix
    first = free[0].usage.prompt_tokens
    assert prefix >= MIN_SHARED_TOKENS and free[0].usage.cached_tokens == 0
    counted_once = admission_bytes(
        shape, [TurnSize(first + 8, first, prefix, "p")], batched=True, trimmable=True, new_prefixes=[prefix]
    )
    counted_twice = admission_bytes(
        shape, [TurnSize(first + 8, first)], batched=True, trimmable=True, new_prefixes=[prefix]
    )
    assert counted_once < counted_twice

    tight, _ = asyncio.run(go((counted_once + counted_twice) // 2))
    assert [r.token_ids for r in tight] == [r.token_ids for r in free]
    assert tight[1].usage.cached_tokens == prefix


def test_a_turn_over_a_shared_prefix_that_fits_only_whole_runs_whole(tiny_qwen3_path: Path) -> None:
    """A session's second turn, its conversation over its agent's shared prefix: the prefix and the
    turn's own part, each rounded to whole KV steps, need a step more than the same tokens whole, and
    the budget holds them whole. With nothing else in flight the turn is not refused
    (`kv_pressure.py` at 50% refused such turns): its session's cache gives way (spilled, so the prefix
    is no longer in use), the prefix is dropped, and the turn runs whole, with the tokens of an
    unbounded host."""
    from mlx_subagents.host.kv.kv_pool import KV_STEP

    async def go(budget: int | None, filler: int) -> tuple[list[Any], KVShape, int]:
        async with MlxModelHost(str(tiny_qwen3_path)) as host:
            await host.set_kv_budget(None)
            session, talk = host.session("s"), [SYSTEM, {"role": "user", "content": "Task 1: find the module."}]
            first = await session.generate(list(talk), GenerateArgs(max_tokens=8))
            await host.set_kv_budget(budget)  # for the second turn
            talk += [{"role": "assistant", "content": first.text}]
            talk += [{"role": "user", "content": "Now this: " + " ".join(f"w{i}" for i in range(filler))}]
            second = await session.generate(talk, GenerateArgs(max_tokens=8))
            prefixes = host._scheduler.prefixes
            return [first, second], host.kv_shape, max(map(len, prefixes._caches), default=0)

    def needs(shape: KVShape, prompt: int, prefix: int) -> tuple[int, int]:
        """What the second turn needs over the prefix (held exactly, in the entry) and whole."""
        over = prefix * shape.per_token + admission_bytes(
            shape, [TurnSize(prompt + 8, prompt, prefix, "p")], batched=True, trimmable=True
        )
        return over, admission_bytes(shape, [TurnSize(prompt + 8, prompt)], batched=True, trimmable=True)

    for filler in range(0, KV_STEP, 8):  # a length where the two roundings cost a step
        free, shape, prefix = asyncio.run(go(None, filler))
        over, whole = needs(shape, free[1].usage.prompt_tokens, prefix)
        if over > whole:
            break
    assert prefix >= MIN_SHARED_TOKENS and free[1].usage.cached_tokens > prefix and over > whole
    tight, _, held = asyncio.run(go(whole, filler))
    assert [r.token_ids for r in tight] == [r.token_ids for r in free]
    assert held == 0  # the prefix gave way


def test_an_evicted_cache_is_freed_however_long_its_turn_lives(tiny_qwen3_path: Path) -> None:
    """A session's idle cache, once evicted, is gone from memory at once: neither the finished turn that
    filled it nor the mlx thread's last job (which made that turn) still holds it. Both did: until the
    next job came, its bytes stayed in memory uncounted, and its layers kept its agent's shared prefix in
    use, so admission could not drop that prefix and refused a turn that fits (`kv_pressure.py --kv-bits`
    refused three of four sessions in some runs)."""
    import gc
    import weakref

    from mlx_subagents.host.mlx.turn import Turn

    async def go() -> tuple[list[weakref.ref[Any]], int, int, list[Turn]]:
        async with MlxModelHost(str(tiny_qwen3_path), kv_budget=0, drop_below_tokens=10**6) as host:
            task = [SYSTEM, {"role": "user", "content": "Task 1: find the module."}]
            await host.session("s").generate(task, GenerateArgs(max_tokens=8))  # the mlx thread's last job
            pool, prefixes = host._scheduler.pool, host._scheduler.prefixes
            # The reply is delivered inside the step that ends the turn, and the scheduler has no work
            # before that step returns: ask the mlx thread itself, between its steps, until it is idle.
            while await host._mlx.run(host._mlx._busy):
                pass
            state = pool.idle("s")
            assert state is not None and state.prompt_cache is not None and len(prefixes) == 1
            layers = [weakref.ref(c) for c in state.prompt_cache]
            assert pool.release()  # dropped (no spill below a million tokens): what admission's last resort does
            for _ in range(300):  # the mlx thread's step may still be unwinding (its frames hold the turn)
                gc.collect()
                live = [t for t in gc.get_objects() if isinstance(t, Turn)]
                if not live:
                    break
                live = []
                await asyncio.sleep(0.01)
            else:
                live = [t for t in gc.get_objects() if isinstance(t, Turn)]
            return layers, prefixes.drop_oldest(), state.kv_bytes, live

    layers, freed, kv_bytes, live = asyncio.run(go())
    assert len(layers) == 2 and [ref() for ref in layers] == [None, None]  # the tiny model's two layers
    assert freed > 0 and kv_bytes == 0  # nothing starts from the prefix now: dropping it frees its bytes
    assert live == []


@pytest.mark.parametrize("prefix_kept", [True, False])
@pytest.mark.parametrize("kind", ["dense", "8-bit", "hybrid"])
def test_a_spilled_session_comes_back_over_its_agents_prefix_while_it_is_held(
    request: pytest.FixtureRequest, kind: str, prefix_kept: bool
) -> None:
    """A session's cache over its agent's shared prefix, spilled to disk, comes back over that prefix,
    holding only its tail again (it came back whole: the prefix's bytes a second time in memory, for
    every restored session), and admission counts it so. If the prefix was dropped while it was on
    disk, it comes back whole. Either way its next reply is the one of a host that never evicted it.
    Quantized caches come back over it quantized; a hybrid model's attention layers come back over it
    and its recurrent state as it was."""
    if kind == "8-bit":
        path, options = request.getfixturevalue("quantizable")("qwen3"), {"kv_bits": 8}
    else:
        path, options = request.getfixturevalue("tiny_qwen35_path" if kind == "hybrid" else "tiny_qwen3_path"), {}

    async def go(evict: bool) -> tuple[list[Any], tuple[int, int], bool, int, int]:
        async with MlxModelHost(str(path), kv_budget=0, drop_below_tokens=1, **options) as host:
            scheduler = host._scheduler
            pool, prefixes = scheduler.pool, scheduler.prefixes
            talk = [SYSTEM, {"role": "user", "content": "Task 1: find the module."}]
            first = await host.session("a").generate(list(talk), GenerateArgs(max_tokens=8))
            await host.session("b").generate(
                [SYSTEM, {"role": "user", "content": "Task 2."}], GenerateArgs(max_tokens=8)
            )
            (entry,) = prefixes._caches.values()
            _, shared = shared_prefix_of(entry)

            def spill() -> tuple[int, int]:
                state = pool.idle("a")
                assert state is not None and shared_prefix_of(state.prompt_cache)[1] is shared
                pool.evict(state)
                if not prefix_kept:  # b lets go of it too, then it goes
                    pool.evict(pool.idle("b"))
                    assert prefixes.drop_oldest() > 0
                turn = Turn("a", state, Request([], None, 8, 0.0), threading.Event())
                turn.ids, turn.max_tokens = state.token_ids + [0] * 10, 8  # a turn going on from its spill
                whole = TurnSize(turn.final_length, len(turn.ids))
                return scheduler.admission.estimate([turn]), admission_bytes(
                    host.kv_shape, [whole], batched=True, trimmable=host.kv_trimmable
                )

            counted = await host._mlx.run(spill) if evict else (0, 0)
            talk += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
            second = await host.session("a").generate(talk, GenerateArgs(max_tokens=8))
            state = pool.idle("a")
            assert state is not None
            return (
                [first, second],
                counted,
                shared_prefix_of(state.prompt_cache)[1] is shared,
                pool.counters.restores,
                state.kv_bytes,
            )

    free, _, _, _, free_bytes = asyncio.run(go(evict=False))
    replies, counted, over, restores, held = asyncio.run(go(evict=True))
    assert [r.token_ids for r in replies] == [r.token_ids for r in free]
    assert restores == 1 and over is prefix_kept
    # Over the prefix, it holds its tail in the buffers it had (as if it never left); whole, the prefix too.
    assert held == free_bytes if prefix_kept else held > free_bytes
    over_prefix, whole = counted
    assert (over_prefix < whole) is prefix_kept and over_prefix <= whole


@pytest.mark.parametrize("kind", [BatchKVCache, BatchPrefixedKVCache])
def test_rows_without_a_prefix_batch_as_mlx_lm_batches_them(tiny_qwen3: Any, kind: type) -> None:
    """Without a shared prefix a prefixed batch is mlx-lm's batch: the same logits either class."""
    model, _ = tiny_qwen3
    rows = [[PrefixedKVCache() for _ in model.layers] for _ in TAILS]
    for cache in rows:
        model(mx.array([PREFIX]), cache=cache)
    reference = [plain(model) for _ in TAILS]
    assert same(batch_logits(model, rows, BatchPrefixedKVCache), batch_logits(model, reference, kind))
