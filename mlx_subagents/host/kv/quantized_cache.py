"""Quantized KV caches that batch: mlx-lm's `QuantizedKVCache` with the batch protocol its `KVCache`
has, so that 8- and 4-bit caches join `BatchGenerator`'s continuous batch.

A layer's keys and values are kept as mlx's `quantize` per group gives them: a triple (packed
integers, scales, biases) per tensor, each of shape (batch, KV heads, tokens, ...). Every operation
on the token axis (slice, pad, roll, concatenate, take rows) is applied to the three parts alike, so
the batch classes below are mlx-lm's `BatchKVCache` with that one change; they inherit its masks,
left padding, `prepare` and trimming unchanged. A model's attention takes mlx-lm's quantized
scaled-dot-product path because the cache has `bits` (`mlx_lm.models.base`).

`quantized_rotating.py` does the same for sliding-window layers; `kv_bits.py` decides per model
whether (and in which groups) its caches quantize, and makes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mlx_lm.models import cache as mlx_cache

from .prefixed_cache import OverPrefix, OverPrefixBatch

# A quantized tensor: (packed uint32, scales, biases), as `mx.quantize` returns it.
Parts = tuple[Any, ...]


def parts_map(fn: Callable[..., Any], *tensors: Sequence[Any]) -> Parts:
    """`fn` applied to the packed integers, the scales and the biases alike (zipped across `tensors`)."""
    return tuple(fn(*parts) for parts in zip(*tensors, strict=True))


def empty_parts(like: Sequence[Any], batch: int, tokens: int) -> Parts:
    """Zeros shaped as `like`'s parts but for `batch` rows and `tokens` tokens (zeros dequantize to 0)."""
    import mlx.core as mx

    return tuple(mx.zeros((batch, p.shape[1], tokens, p.shape[3]), p.dtype) for p in like)


def quantized_zeros(shape: tuple[int, int, int], dim: int, dtype: Any, group_size: int, bits: int) -> Parts:
    """The parts of an all-zero quantized tensor of shape `(*shape, dim)`."""
    import mlx.core as mx

    return (
        mx.zeros((*shape, dim * bits // 32), mx.uint32),
        mx.zeros((*shape, dim // group_size), dtype),
        mx.zeros((*shape, dim // group_size), dtype),
    )


def parts_nbytes(*tensors: Sequence[Any] | None) -> int:
    return sum(p.nbytes for t in tensors if t is not None for p in t)


def check_setting(caches: Sequence[Any]) -> tuple[int, int]:
    """The (group size, bits) every cache shares; a batch never mixes settings, nor quantized with
    unquantized caches (one `--kv-bits` per host)."""
    settings = {(getattr(c, "group_size", None), getattr(c, "bits", None)) for c in caches}
    if len(settings) != 1 or None in next(iter(settings)):
        raise ValueError(f"KV caches of different settings cannot share a batch: {sorted(map(str, settings))}")
    return next(iter(settings))  # type: ignore[return-value]


def write_tokens(stored: tuple[Parts, Parts], new: tuple[Parts, Parts], start: int, stop: int) -> None:
    """Put the new keys' and values' parts into the stored ones, at tokens `start:stop`."""
    for old, fresh in zip(stored, new, strict=True):
        for dst, src in zip(old, fresh, strict=True):
            dst[..., start:stop, :] = src


def join_rows(a: Any, b: Any) -> None:
    """`a.extend(b)` for batches of quantized rows, dense or sliding-window, as mlx-lm's `extend` does it:
    both right-justified at the larger index and padded to one buffer length, `b`'s rows after `a`'s."""
    import mlx.core as mx

    check_setting([a, b])
    if a.keys is None and b.keys is None:
        a.left_padding = mx.concatenate([a.left_padding, b.left_padding])
        a.offset = mx.concatenate([a.offset, b.offset])
        return
    max_idx = max(a._idx, b._idx)
    size = max(c.keys[0].shape[2] for c in (a, b) if c.keys is not None)
    like = a if a.keys is not None else b

    def pad(c: Any) -> tuple[Parts, Parts, Any, Any]:
        k, v = c.keys, c.values
        if k is None:
            k, v = empty_parts(like.keys, c.offset.shape[0], 0), empty_parts(like.values, c.offset.shape[0], 0)
        left = max_idx - c._idx
        right = size - k[0].shape[2] - left
        if right < 0:
            k, v = (parts_map(lambda x: x[..., :right, :], t) for t in (k, v))
            right = 0
        if left or right:
            widths = [(0, 0), (0, 0), (left, right), (0, 0)]
            k, v = (parts_map(lambda x: mx.pad(x, widths), t) for t in (k, v))
        return k, v, c.offset, c.left_padding + left

    (k1, v1, o1, l1), (k2, v2, o2, l2) = pad(a), pad(b)
    a.keys = parts_map(lambda x, y: mx.concatenate([x, y]), k1, k2)
    a.values = parts_map(lambda x, y: mx.concatenate([x, y]), v1, v2)
    a.offset, a.left_padding = mx.concatenate([o1, o2]), mx.concatenate([l1, l2])
    a._idx = max_idx


class _QuantizedKVCache(mlx_cache.QuantizedKVCache):
    """mlx-lm's single-sequence quantized cache (same state, same file format), able to join a batch
    (`merge`) as its `KVCache` is."""

    def size(self) -> int:
        return self.offset

    @property
    def nbytes(self) -> int:
        return parts_nbytes(self.keys, self.values)

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)


class _BatchQuantizedKVCache(mlx_cache.BatchKVCache):
    """mlx-lm's `BatchKVCache` holding quantized keys and values (left-padded rows, as there)."""

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8) -> None:
        super().__init__(left_padding)
        self.group_size, self.bits = group_size, bits

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Parts, Parts]:
        import mlx.core as mx

        prev, n = self._idx, keys.shape[2]
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            B, H = keys.shape[:2]
            steps = (self.step + n - 1) // self.step * self.step
            new_k = quantized_zeros((B, H, steps), keys.shape[3], keys.dtype, self.group_size, self.bits)
            new_v = quantized_zeros((B, H, steps), values.shape[3], keys.dtype, self.group_size, self.bits)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys, self.values = (
                        parts_map(lambda x: x[..., :prev, :], t) for t in (self.keys, self.values)
                    )
                self.keys = parts_map(lambda a, b: mx.concatenate([a, b], axis=2), self.keys, new_k)
                self.values = parts_map(lambda a, b: mx.concatenate([a, b], axis=2), self.values, new_v)
            else:
                self.keys, self.values = new_k, new_v
        self.offset = self.offset + n
        self._idx += n
        quantized = (mx.quantize(t, group_size=self.group_size, bits=self.bits) for t in (keys, values))
        write_tokens((self.keys, self.values), tuple(quantized), prev, self._idx)  # type: ignore[arg-type]
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Parts, Parts]:
        return parts_map(lambda x: x[..., : self._idx, :], self.keys), parts_map(
            lambda x: x[..., : self._idx, :], self.values
        )

    def finalize(self) -> None:
        if self._right_padding is not None:
            padding = self._right_padding
            self.keys, self.values = (
                parts_map(lambda x: mlx_cache.dynamic_roll(x, padding[:, None], axis=2), t)
                for t in (self.keys, self.values)
            )
            self.offset = self.offset - padding
            self.left_padding += padding
            self._right_padding = None

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.left_padding, self._idx, self.group_size, self.bits

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx, self.group_size, self.bits = v

    def filter(self, batch_indices: Any) -> None:
        """Keep the rows `batch_indices`, then drop the left padding they all share."""
        if self.keys is not None:
            self.keys, self.values = (parts_map(lambda x: x[batch_indices], t) for t in (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shared = min(self.left_padding.tolist())
        if shared > 0:
            if self.keys is not None:
                self.keys, self.values = (parts_map(lambda x: x[..., shared:, :], t) for t in (self.keys, self.values))
            self._idx -= shared
            self.left_padding -= shared

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Append `other`'s rows (right-justified at the longer one's index, as `BatchKVCache`)."""
        join_rows(self, other)

    def extract(self, idx: int) -> QuantizedKVCache:
        """Row `idx` as a single-sequence cache, its left padding cut off."""
        import mlx.core as mx

        mx.eval(self.left_padding)
        padding = self.left_padding.tolist()[idx]
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        cache.keys, cache.values = (
            parts_map(lambda x: mx.contiguous(x[idx : idx + 1, :, padding : self._idx]), t)
            for t in (self.keys, self.values)
        )
        cache.offset = self._idx - padding
        return cache

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        """One batch of single-sequence caches, left-padded to the longest."""
        group_size, bits = check_setting(caches)
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches), group_size, bits)
        padding = [longest - n for n in lengths]
        like = next(c for c in caches if c.keys is not None)
        keys, values = empty_parts(like.keys, len(caches), longest), empty_parts(like.values, len(caches), longest)
        for i, (p, c) in enumerate(zip(padding, caches, strict=True)):
            if c.keys is None:
                continue
            for stored, own in ((keys, c.keys), (values, c.values)):
                for dst, src in zip(stored, own, strict=True):
                    dst[i : i + 1, :, p : p + c.offset] = src[..., : c.offset, :]
        cache = cls(padding, group_size, bits)
        cache.keys, cache.values = keys, values
        cache.offset += longest
        cache._idx = longest
        return cache

    @property
    def nbytes(self) -> int:
        return parts_nbytes(self.keys, self.values)


class QuantizedKVCache(OverPrefix, _QuantizedKVCache):
    """The host's quantized cache of one sequence, optionally over a shared prefix (`prefixed_cache.py`)."""

    _base_state_length = 5

    def __init__(self, group_size: int = 64, bits: int = 8) -> None:
        _QuantizedKVCache.__init__(self, group_size=group_size, bits=bits)


class BatchQuantizedKVCache(OverPrefixBatch, _BatchQuantizedKVCache):
    """The host's quantized batch cache, its rows optionally over one shared prefix (`prefixed_cache.py`)."""

    single = QuantizedKVCache

    def _empty_single(self) -> Any:
        return QuantizedKVCache(group_size=self.group_size, bits=self.bits)

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        return cls._merged(caches, lambda rows: super(BatchQuantizedKVCache, cls).merge(rows))  # type: ignore[no-any-return]
