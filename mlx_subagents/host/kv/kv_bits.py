"""`--kv-bits`: one KV cache setting per host, what each layer's cache becomes under it, whether a
model's attention takes it, and reading quantized caches back from disk.

16 keeps the model's own caches (unquantized, in the model's dtype: 16-bit for real models). 8 and 4
quantize keys and values per group (`quantized_cache.py`, `quantized_rotating.py`): dense layers
become `QuantizedKVCache`, sliding-window layers `QuantizedRotatingKVCache`, and a hybrid model's
recurrent layers (`ArraysCache`) keep their state as it is. A model that cannot take that (a head
width mlx does not quantize, a cache type with no quantized form, an attention mlx-lm routes
elsewhere) runs at 16 bits, with one warning; a host never mixes settings, so a batch never does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..settings import DEFAULT_KV_BITS, check_kv_bits

log = logging.getLogger(__name__)

# mlx-lm's default group first; a head width 64 does not divide takes 32 (mlx also has 128: coarser).
GROUP_SIZES = (64, 32)


@dataclass(frozen=True)
class KVSetting:
    """How a host's KV caches are kept: `bits` per value (16: not quantized) in groups of `group_size`."""

    bits: int = DEFAULT_KV_BITS
    group_size: int = GROUP_SIZES[0]

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    def make_cache(self, model: Any) -> list[Any]:
        """A fresh prompt cache for `model` under this setting: at 16, mlx-lm's `make_prompt_cache` with
        its dense layers able to start from a shared prefix (`prefixed_cache.py`)."""
        from mlx_lm.models.cache import make_prompt_cache

        from .prefixed_cache import shared_layers

        cache = make_prompt_cache(model)
        return [self.layer(c) for c in cache] if self.quantized else shared_layers(cache)

    def layer(self, layer: Any) -> Any:
        """One layer's empty cache under this setting (`kinds.py`: a recurrent state stays as the model
        makes it); TypeError for a kind that has no quantized form."""
        from .kinds import kind_of

        kind = kind_of(layer)
        if kind is None:
            raise TypeError(f"its cache has {type(layer).__name__} layers, which have no quantized form")
        return kind.quantize(layer, self.bits, self.group_size)


def kv_setting(model: Any, bits: int, *, evaluate: bool = True) -> tuple[KVSetting, str | None]:
    """The setting `model`'s host runs at when `bits` is asked for, and why it falls back to 16 (None: it does not).

    The group size is the largest of `GROUP_SIZES` that divides every key and value width. With
    `evaluate`, a prompt of two tokens and one decode step run through a quantized cache, so that an
    attention that does not take one (mlx-lm routes some architectures around its quantized path) is
    found at load, not in a session's turn: three tokens, once per load.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    if check_kv_bits(bits) == 16:
        return KVSetting(), None
    plain = make_prompt_cache(model)
    try:
        [KVSetting(bits).layer(c) for c in plain]
    except TypeError as exc:
        return KVSetting(), str(exc)
    attention = [c for c in plain if type(c) in (KVCache, RotatingKVCache)]
    if not attention:
        return KVSetting(), "it has no attention layers to quantize"
    model(mx.array([[0]]), cache=plain)  # lazy: the buffers' shapes, nothing computed
    widths = sorted({t.shape[-1] for c in attention for t in (c.keys, c.values)})
    group = next((g for g in GROUP_SIZES if all(w % g == 0 for w in widths)), None)
    if group is None:
        shown = "/".join(map(str, widths))
        return KVSetting(), f"its attention heads are {shown} wide and mlx quantizes in groups of 32 or 64"
    setting = KVSetting(bits, group)
    if evaluate:
        try:
            cache = setting.make_cache(model)
            mx.eval(model(mx.array([[0, 0]]), cache=cache), model(mx.array([[0]]), cache=cache))
        except Exception as exc:  # what a model's own attention raises on a quantized cache varies
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return KVSetting(), f"its attention does not take a quantized cache ({reason})"
    return setting, None


def warn_fallback(model_id: str, bits: int, problem: str) -> None:
    """The one warning of a host that asked for `bits` and runs at 16."""
    log.warning(f"--kv-bits {bits}: {model_id}: {problem}; its KV cache stays at 16 bits")


def cache_class(name: str) -> type:
    """A cache class by the name a cache file records: ours, else mlx-lm's."""
    from mlx_lm.models import cache as mlx_cache

    from . import prefixed_cache, quantized_cache, quantized_rotating

    for module in (prefixed_cache, quantized_cache, quantized_rotating):
        if isinstance(found := getattr(module, name, None), type):
            return found
    return getattr(mlx_cache, name)  # type: ignore[no-any-return]


def load_prompt_cache(path: str, return_metadata: bool = False) -> Any:
    """`mlx_lm.models.cache.load_prompt_cache` for files that may hold our quantized layers: the same
    format (`save_prompt_cache` writes both), with the class of each layer found by `cache_class`
    (mlx-lm's looks only among its own)."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    arrays, flat = mx.load(path, return_metadata=True)
    metadata, classes, scalars = tree_unflatten(list(flat.items()))
    for pos, kind in scalars[1:]:
        value = arrays[pos]
        if kind == "scalar":
            arrays[pos] = value.item()
        elif kind == "string":
            arrays[pos] = "".join(chr(i) for i in value.tolist())
        elif kind == "none":
            arrays[pos] = None
        else:
            raise ValueError(f"{path}: unknown scalar kind {kind!r} in a prompt cache file")
    states = tree_unflatten(list(arrays.items()))
    cache = [cache_class(name).from_state(state) for name, state in zip(classes, states, strict=True)]
    return (cache, metadata) if return_metadata else cache
