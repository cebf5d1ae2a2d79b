"""The admission estimate, the window it implies, and the shared-prefix cache, without a model."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlx_subagents.host.kv.kv_pool import KV_STEP, KVShape, TurnSize, admission_bytes, tokens_that_fit
from mlx_subagents.host.kv.prefix_cache import SharedPrefixes

T = TurnSize


def test_admission_counts_whole_steps_batch_padding_snapshots_and_new_prefixes() -> None:
    shape = KVShape(fixed=100, per_token=10)
    step = 10 * KV_STEP
    # 300 + 256 slack -> 3 steps; 600 + 256 -> 4 steps.
    assert admission_bytes(shape, [T(300, 200)], batched=True, trimmable=True) == 100 + 3 * step
    assert admission_bytes(shape, [T(300, 200), T(600, 500)], batched=False, trimmable=True) == 200 + 7 * step
    assert admission_bytes(shape, [T(300, 200), T(600, 500)], batched=True, trimmable=True) == 2 * (100 + 4 * step)
    # A hybrid session also holds a snapshot of its prompt, a copy of its cache as allocated, up to a step
    # past the prompt (200 + 256 -> 2 steps, 500 + 256 -> 3 steps).
    assert admission_bytes(shape, [T(300, 200), T(600, 500)], batched=False, trimmable=False) == 400 + 12 * step
    assert admission_bytes(shape, [T(300, 200)], batched=True, trimmable=True, new_prefixes=[40]) == 200 + 4 * step
    assert admission_bytes(shape, [], batched=True, trimmable=True, new_prefixes=[40]) == 0
    # Turns that start from a shared prefix (counted once, with the entries) hold only what follows it:
    # 300 - 200 + 256 -> 2 steps, 600 - 200 + 256 -> 3 steps; batched over one prefix, both padded to 3.
    shared = T(300, 250, 200, "p"), T(600, 550, 200, "p")
    assert admission_bytes(shape, shared, batched=False, trimmable=True) == 200 + 5 * step
    assert admission_bytes(shape, shared, batched=True, trimmable=True) == 2 * (100 + 3 * step)
    # ... a snapshot too (250 - 200 + 256 -> 2 steps, 550 - 200 + 256 -> 3 steps). Rows of two prefixes
    # batch whole.
    assert admission_bytes(shape, shared, batched=False, trimmable=False) == 400 + 10 * step
    mixed = T(300, 250, 200, "p"), T(600, 550, 200, "q")
    assert admission_bytes(shape, mixed, batched=True, trimmable=True) == 2 * (100 + 4 * step)


@pytest.mark.parametrize("trimmable", [True, False])
@pytest.mark.parametrize("shape", [KVShape(0, 4096), KVShape(123_456, 1000), KVShape(5, 1)])
@pytest.mark.parametrize("budget", [0, 10**6, 37 * 2**20, 3 * 10**9])
def test_tokens_that_fit_is_the_longest_window_the_estimate_admits(
    trimmable: bool, shape: KVShape, budget: int
) -> None:
    window = tokens_that_fit(shape, budget, trimmable)

    def needs(n: int) -> int:
        return admission_bytes(shape, [T(n, n)], batched=False, trimmable=trimmable)

    assert window % KV_STEP == 0
    assert window == 0 or needs(window) <= budget
    assert needs(window + KV_STEP) > budget


def cache_holding(n: int, value: float) -> list[KVCache]:
    cache = KVCache()
    cache.update_and_fetch(mx.full((1, 1, n, 4), value), mx.full((1, 1, n, 4), value))
    return [cache]


def test_shared_prefixes_hand_out_private_copies_of_the_longest_use() -> None:
    prefixes = SharedPrefixes(max_entries=2)
    original = cache_holding(3, 1.0)
    prefixes.add([1, 2, 3], original)
    original[0].update_and_fetch(mx.zeros((1, 1, 1, 4)), mx.zeros((1, 1, 1, 4)))  # the stored copy is unaffected
    assert [1, 2, 3] in prefixes and [1, 2] not in prefixes
    assert prefixes.start([1, 2, 3]) is None  # only a strict prefix: one token must be left to feed
    assert prefixes.start([9, 2, 3, 4]) is None
    got = prefixes.start([1, 2, 3, 4])
    assert got is not None and got[1] == 3 and got[0][0].offset == 3
    got[0][0].update_and_fetch(mx.zeros((1, 1, 1, 4)), mx.zeros((1, 1, 1, 4)))
    again = prefixes.start([1, 2, 3, 7])
    assert again is not None and again[0][0].offset == 3  # the entry itself never grows
    assert prefixes.hits == 2
    one = prefixes.nbytes()
    assert one == again[0][0].nbytes > 0

    prefixes.add([5, 6], cache_holding(2, 2.0))
    prefixes.start([1, 2, 3, 4])  # [1, 2, 3] is now the most recently used
    prefixes.add([7, 8], cache_holding(2, 3.0))  # past max_entries: the least recently used goes
    assert [5, 6] not in prefixes and [1, 2, 3] in prefixes and len(prefixes) == 2
    assert prefixes.drop_oldest() == one and [1, 2, 3] not in prefixes
    assert prefixes.drop_oldest() > 0 and prefixes.drop_oldest() == 0 and len(prefixes) == 0


@pytest.mark.slow
@pytest.mark.parametrize("arch_fixture", ["tiny_qwen3_path", "tiny_qwen35_path"])
def test_the_kv_shape_read_off_the_cache_types_is_what_caches_really_hold(
    arch_fixture: str, request: pytest.FixtureRequest
) -> None:
    """Start-up reads the shape from one token; it equals measuring real caches at two lengths."""
    import asyncio

    from mlx_lm.models.cache import make_prompt_cache

    from mlx_subagents.host import MlxModelHost
    from mlx_subagents.host.kv.kv_pool import cache_nbytes
    from mlx_subagents.host.mlx.kv_size import probe_shape

    path = request.getfixturevalue(arch_fixture)

    async def go() -> tuple[KVShape, KVShape, list[tuple[int, int]]]:
        async with MlxModelHost(str(path)) as host:

            def held(n: int) -> tuple[int, int]:
                cache = make_prompt_cache(host._model)
                host._model(mx.array([[1] * n]), cache=cache)
                mx.eval([c.state for c in cache])
                return cache_nbytes(cache), host.kv_shape.bytes_for(n)

            probed = await host._mlx.run(lambda: probe_shape(host._model, host.kv_setting))
            return host.kv_shape, probed, [await host._mlx.run(lambda n=n: held(n)) for n in (1, 256, 300, 700)]

    shape, probed, sizes = asyncio.run(go())
    assert shape == probed and shape.per_token > 0
    assert (shape.fixed > 0) == (arch_fixture == "tiny_qwen35_path")  # gated-delta layers: recurrent state
    assert all(real == estimated for real, estimated in sizes)
