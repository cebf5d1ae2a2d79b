"""The table of cache kinds (`host/kv/kinds.py`) says of each layer class what the class itself does: the
batch class its `merge` makes and whose `extract` gives it back, how its bytes grow, how it is stored."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.host.kv.kinds import extractable, kind_of
from mlx_subagents.host.kv.kv_bits import kv_setting
from mlx_subagents.host.kv.kv_pool import KV_STEP, cache_nbytes, kv_shape_of
from mlx_subagents.host.kv.prefix_store import cache_kind


def filled(model: Any, bits: int, n_tokens: int) -> list[Any]:
    """A fresh cache of the model under `bits`, holding `n_tokens` tokens."""
    import mlx.core as mx

    setting, problem = kv_setting(model, bits)
    assert problem is None
    cache = setting.make_cache(model)
    model(mx.array([list(range(1, n_tokens + 1))]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "gemma3_text"])
def test_each_layer_is_a_kind_that_batches_into_its_batch_class_and_back(
    quantizable: Callable[[str], Path], arch: str, bits: int
) -> None:
    import mlx_lm

    model, _ = mlx_lm.load(str(quantizable(arch)))
    cache = filled(model, bits, 5)
    kinds = [kind_of(layer) for layer in cache]
    assert all(kind is not None for kind in kinds)
    for layer, kind in zip(cache, kinds, strict=True):
        batch = type(layer).merge([layer, copy.deepcopy(layer)])
        assert type(batch) is kind.batch and extractable(batch)  # type: ignore[union-attr]
        assert type(batch.extract(1)) is kind.cls  # type: ignore[union-attr]
    stored = cache_kind(cache)
    assert stored is not None and stored.split(",") == [k.stored_as(c) for k, c in zip(kinds, cache, strict=True)]  # type: ignore[union-attr]
    assert (":64:" in stored) == (arch == "gemma3_text") and (f":{bits}b" in stored) == (bits < 16)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_the_shape_read_off_one_token_is_what_a_cache_of_whole_steps_holds(
    quantizable: Callable[[str], Path], arch: str, bits: int
) -> None:
    """Dense and hybrid layers, 16 and 8 bits: the bytes per token and the fixed recurrent state read off a
    one-token cache give the bytes of caches holding one and two whole KV steps."""
    import mlx_lm

    model, _ = mlx_lm.load(str(quantizable(arch)))
    shape = kv_shape_of(filled(model, bits, 1))
    assert shape is not None and shape.per_token > 0 and (shape.fixed > 0) == (arch == "qwen3_5")
    for n in (KV_STEP, 2 * KV_STEP):
        assert cache_nbytes(filled(model, bits, n)) == shape.bytes_for(n)


def test_a_class_off_the_table_is_no_kind() -> None:
    """mlx-lm's `CacheList` (or any subclass of a known class) is none of the kinds: not measured off its
    layers, not stored, not taken out of a batch."""
    from mlx_lm.models.cache import CacheList, KVCache

    class Mine(KVCache):
        pass

    assert kind_of(CacheList(KVCache())) is None and kind_of(Mine()) is None
    assert cache_kind([KVCache(), Mine()]) is None
