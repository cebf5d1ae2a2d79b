"""The cache kinds: what the host knows of each layer cache class, said once, on one table.

mlx-lm keeps a cache's own facts on its class (`nbytes`, `state`, `meta_state`); what this host adds
about a class is here, and every place that asks reads the row of the layer's exact class (a subclass
is another kind: it may store, grow or batch differently). A class with no row is none of these: it
cannot be measured off its layers (the host probes it), stored as a prefix, quantized, or taken out of
a batch.

A new kind of layer cache is one row (`cache_kinds`), proven side by side with mlx-lm's own class in
`tests/host/test_quantized_cache.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

from .prefixed_cache import BatchPrefixedKVCache, PrefixedKVCache
from .quantized_cache import BatchQuantizedKVCache, QuantizedKVCache
from .quantized_rotating import BatchQuantizedRotatingKVCache, QuantizedRotatingKVCache

# A layer under `--kv-bits` 8 or 4: (the layer, bits, group size) -> its quantized empty cache.
Quantize = Callable[[Any, int, int], Any]


@dataclass(frozen=True)
class CacheKind:
    """One layer cache class and what the host does with it.

    Args:
        cls: the single-sequence class.
        batch: its batch class (what its `merge` makes). A row taken out of it (`extract`) continues
            token-identically (tested), so a sequence may leave the batch for the single path.
        size: how its bytes are read: "tokens" (keys and values over the tokens their buffers hold
            room for), "fixed" (a recurrent state that does not grow).
        quantize: its empty form under `--kv-bits` 8 or 4 (a recurrent state stays as it is).
        window: a sliding window: its size and what it keeps are part of its stored kind.
        packed: its keys and values are quantized triples (packed values, scales, biases).
        rewinds: the positions a drafted forward wrote can be taken back off it (`rewind.py`); a
            recurrent state cannot: it holds no positions, only their sum.
    """

    cls: type
    batch: type
    size: Literal["tokens", "fixed"]
    quantize: Quantize
    window: bool = False
    packed: bool = False
    rewinds: bool = True

    @property
    def name(self) -> str:
        return self.cls.__name__

    def stored_as(self, layer: Any) -> str:
        """The layer as the prefix store's key names it: its class, a window's size and keep, a
        quantized layer's bits and group size (a file is only ever loaded at the setting it holds)."""
        window = f":{layer.max_size}:{layer.keep}" if self.window else ""
        bits = f":{layer.bits}b{layer.group_size}" if self.packed else ""
        return self.name + window + bits

    @property
    def dense(self) -> bool:
        """Whether it holds every token's keys and values (it grows by tokens, and is no window)."""
        return self.size == "tokens" and not self.window

    def grows(self, layer: Any) -> bool:
        """Whether its buffer holds room past its tokens (in steps): a dense layer always, a window
        until it first wraps. Stored, it is cut to its tokens."""
        return self.dense or (self.window and layer._idx == layer.offset)

    def per_token(self, layer: Any) -> int:
        """Its bytes per token: its bytes over the tokens its buffers hold room for (a window counted
        as if unbounded)."""
        keys = layer.keys[0] if self.packed else layer.keys
        return int(layer.nbytes // keys.shape[2])


def _dense(layer: Any, bits: int, group_size: int) -> Any:
    return QuantizedKVCache(group_size=group_size, bits=bits)


def _window(layer: Any, bits: int, group_size: int) -> Any:
    return QuantizedRotatingKVCache(layer.max_size, layer.keep, group_size=group_size, bits=bits)


def _kept(layer: Any, bits: int, group_size: int) -> Any:
    return layer


@cache
def cache_kinds() -> dict[type, CacheKind]:
    """Every kind the host knows, by its single-sequence class."""
    kinds = [
        CacheKind(KVCache, BatchKVCache, "tokens", _dense),
        CacheKind(PrefixedKVCache, BatchPrefixedKVCache, "tokens", _dense),
        CacheKind(RotatingKVCache, BatchRotatingKVCache, "tokens", _window, window=True),
        CacheKind(ArraysCache, ArraysCache, "fixed", _kept, rewinds=False),
        CacheKind(QuantizedKVCache, BatchQuantizedKVCache, "tokens", _dense, packed=True),
        CacheKind(QuantizedRotatingKVCache, BatchQuantizedRotatingKVCache, "tokens", _window, window=True, packed=True),
    ]
    return {kind.cls: kind for kind in kinds}


def kind_of(layer: Any) -> CacheKind | None:
    """The row of `layer`'s exact class; None for a class the host does not know."""
    return cache_kinds().get(type(layer))


def extractable(batch_layer: Any) -> bool:
    """Whether a batch's layer is one a row can be taken out of, token-identically."""
    return any(type(batch_layer) is kind.batch for kind in cache_kinds().values())
