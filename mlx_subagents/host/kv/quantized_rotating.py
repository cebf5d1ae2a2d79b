"""Quantized sliding-window KV caches that batch: mlx-lm's `RotatingKVCache` and
`BatchRotatingKVCache` with keys and values kept as `quantize` triples (see `quantized_cache.py`).

Each class subclasses mlx-lm's own and overrides only what touches the stored tensors (update,
trim, temporal order, rows, padding, extract, merge), applying the same steps to the packed
integers, the scales and the biases; the window arithmetic, the masks and trimming are mlx-lm's.
mlx-lm itself has no quantized sliding window (`RotatingKVCache.to_quantized` is not implemented).
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models import cache as mlx_cache

from .quantized_cache import Parts, check_setting, empty_parts, join_rows, parts_map, parts_nbytes, write_tokens


def _concat(*tensors: Parts) -> Parts:
    import mlx.core as mx

    return parts_map(lambda *xs: mx.concatenate(list(xs), axis=2), *tensors)


def _tokens(t: Parts, start: int | None = None, stop: int | None = None) -> Parts:
    return parts_map(lambda x: x[..., start:stop, :], t)


def _grow(cache: Any, keys: Parts, values: Parts, prev: int) -> None:
    """mlx-lm's growth of a window not yet at its size, by a step (or what is left of the window) of zeros."""
    if cache.keys is None or (prev >= cache.keys[0].shape[2] and cache.keys[0].shape[2] < cache.max_size):
        size = min(cache.step, cache.max_size - prev)
        new_k, new_v = empty_parts(keys, keys[0].shape[0], size), empty_parts(values, keys[0].shape[0], size)
        if cache.keys is None:
            cache.keys, cache.values = new_k, new_v
        else:
            cache.keys, cache.values = _concat(cache.keys, new_k), _concat(cache.values, new_v)
        cache._idx = prev


class _QuantizedWindow:
    """What both window classes do alike: quantize what comes in, hand back (and count) what they hold."""

    keys: Parts | None
    values: Parts | None
    group_size: int
    bits: int

    def _held(self) -> int:
        raise NotImplementedError

    def _update_in_place(self, keys: Parts, values: Parts) -> tuple[Parts, Parts]:
        raise NotImplementedError

    def _update_concat(self, keys: Parts, values: Parts) -> tuple[Parts, Parts]:
        raise NotImplementedError

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Parts, Parts]:
        import mlx.core as mx

        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        return self._update_in_place(qk, qv) if keys.shape[2] == 1 else self._update_concat(qk, qv)

    def keys_and_values(self) -> tuple[Parts, Parts]:
        assert self.keys is not None and self.values is not None
        n = self._held()
        if n < self.keys[0].shape[2]:
            return _tokens(self.keys, None, n), _tokens(self.values, None, n)
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return parts_nbytes(self.keys, self.values)


class QuantizedRotatingKVCache(_QuantizedWindow, mlx_cache.RotatingKVCache):
    """A single sequence's sliding window of quantized keys and values (`keep` tokens stay at the front)."""

    def __init__(self, max_size: int, keep: int = 0, group_size: int = 64, bits: int = 8) -> None:
        super().__init__(max_size, keep)
        self.group_size, self.bits = group_size, bits

    def _trim(self, trim_size: int, v: Parts, append: Parts | None = None) -> Parts:
        kept = (_tokens(v, None, self.keep), _tokens(v, trim_size + self.keep)) if trim_size > 0 else (v,)
        return _concat(*kept, *((append,) if append is not None else ()))

    def _temporal_order(self, v: Parts) -> Parts:
        if self._idx == v[0].shape[2]:
            return v
        if self._idx < self.offset:
            return _concat(_tokens(v, None, self.keep), _tokens(v, self._idx), _tokens(v, self.keep, self._idx))
        return _tokens(v, None, self._idx)

    def _update_concat(self, keys: Parts, values: Parts) -> tuple[Parts, Parts]:
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys, self.values = self._temporal_order(self.keys), self._temporal_order(self.values)
            self._idx = self.keys[0].shape[2]
            # As mlx-lm: up to max_size + S - 1 tokens, so that every new token sees max_size of context.
            trim_size = self._idx - self.max_size + 1
            self.keys, self.values = self._trim(trim_size, self.keys, keys), self._trim(trim_size, self.values, values)
        self.offset += keys[0].shape[2]
        self._idx = self.keys[0].shape[2]
        return self.keys, self.values

    def _update_in_place(self, keys: Parts, values: Parts) -> tuple[Parts, Parts]:
        S = keys[0].shape[2]
        _grow(self, keys, values, self.offset)
        trim_size = self.keys[0].shape[2] - self.max_size
        if trim_size > 0:
            self.keys, self.values = self._trim(trim_size, self.keys), self._trim(trim_size, self.values)
            self._idx = self.max_size
        if self._idx == self.max_size:  # rotate
            self._idx = self.keep
        write_tokens((self.keys, self.values), (keys, values), self._idx, self._idx + S)
        self.offset += S
        self._idx += S
        return self.keys_and_values()

    def _held(self) -> int:
        return int(self.offset)

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.keep, self.max_size, self._idx, self.group_size, self.bits

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.keep, self.max_size, self._idx, self.group_size, self.bits = v

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedRotatingKVCache:
        return BatchQuantizedRotatingKVCache.merge(caches)


class BatchQuantizedRotatingKVCache(_QuantizedWindow, mlx_cache.BatchRotatingKVCache):
    """mlx-lm's `BatchRotatingKVCache` holding quantized keys and values."""

    def __init__(self, max_size: int, left_padding: list[int], group_size: int = 64, bits: int = 8) -> None:
        super().__init__(max_size, left_padding)
        self.group_size, self.bits = group_size, bits

    def _trim(self, trim_size: int, v: Parts, append: Parts | None = None) -> Parts:
        if trim_size > 0:
            v = _tokens(v, trim_size)
        return _concat(v, append) if append is not None else v

    def _temporal_order(self) -> None:
        import mlx.core as mx

        if self.rotated:
            self.keys, self.values = (
                parts_map(lambda x: mx.roll(x, -self._idx, axis=2), t) for t in (self.keys, self.values)
            )
            self._idx = self.keys[0].shape[2]
            self.rotated = False

    def _roll_rows(self, shifts: Any) -> None:
        """Roll each row right by its shift (right-padded prompts: padding moves to the left)."""
        self.keys, self.values = (
            parts_map(lambda x: mlx_cache.dynamic_roll(x, shifts[:, None], axis=2), t) for t in (self.keys, self.values)
        )
        self.left_padding += shifts
        self.offset = self.offset - shifts

    def _depend(self) -> None:
        """Make sure left_padding and offset are evaluated with the keys (as mlx-lm does)."""
        import mlx.core as mx

        self.keys = tuple(mx.depends(list(self.keys), [self.left_padding, self.offset]))

    def _update_concat(self, keys: Parts, values: Parts) -> tuple[Parts, Parts]:
        import mlx.core as mx

        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self._temporal_order()
            if self.keys[0].shape[2] > self._idx:
                self.keys, self.values = _tokens(self.keys, None, self._idx), _tokens(self.values, None, self._idx)
            if self._lengths is not None:  # right-padded rows must not push valid tokens out
                self._roll_rows(mx.maximum(0, self.offset - self._lengths))
            trim_size = self._idx - self.max_size + 1
            if trim_size > 0:
                self.left_padding -= trim_size
            self.keys, self.values = self._trim(trim_size, self.keys, keys), self._trim(trim_size, self.values, values)
        n = keys[0].shape[2]
        self.offset = self.offset + n
        self._offset += n
        self._idx = self.keys[0].shape[2]
        self._depend()
        return self.keys, self.values

    def _update_in_place(self, keys: Parts, values: Parts) -> tuple[Parts, Parts]:
        if self._lengths is not None:
            raise RuntimeError("finalize() should be called before decoding with BatchQuantizedRotatingKVCache")
        S = keys[0].shape[2]
        _grow(self, keys, values, self._offset)
        trim_size = self.keys[0].shape[2] - self.max_size
        if trim_size > 0:
            self.keys, self.values = self._trim(trim_size, self.keys), self._trim(trim_size, self.values)
            self._idx = self.max_size
            self.left_padding -= trim_size
        if self._idx == self.max_size:
            self.rotated = True
            self._idx = 0
        if self.rotated:
            self.left_padding -= S
        write_tokens((self.keys, self.values), (keys, values), self._idx, self._idx + S)
        self._offset += S
        self.offset = self.offset + S
        self._idx += S
        self._depend()
        return self.keys_and_values()

    def _held(self) -> int:
        return self._offset

    def finalize(self) -> None:
        import mlx.core as mx

        if self._lengths is not None:
            self._roll_rows(mx.maximum(0, self.offset - self._lengths))
            self._lengths = None

    # mlx-lm's state, then the setting
    _STATE = (
        "keys",
        "values",
        "offset",
        "left_padding",
        "max_size",
        "_offset",
        "_idx",
        "rotated",
        "group_size",
        "bits",
    )

    @property
    def state(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._STATE)

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        for name, value in zip(self._STATE, v, strict=True):
            setattr(self, name, value)

    def filter(self, batch_indices: Any) -> None:
        if self.keys is not None:
            self.keys, self.values = (parts_map(lambda x: x[batch_indices], t) for t in (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]

    def extend(self, other: BatchQuantizedRotatingKVCache) -> None:
        """Append `other`'s rows, both in temporal order first when they differ (as mlx-lm's)."""
        if self.keys is not None or other.keys is not None:
            if self.rotated != other.rotated or self._idx != other._idx:
                self._temporal_order()
                other._temporal_order()
            self._offset = max(self._offset, other._offset)
        join_rows(self, other)

    def extract(self, idx: int) -> QuantizedRotatingKVCache:
        """Row `idx` as a single-sequence window, in temporal order, its padding cut off."""
        import mlx.core as mx

        mx.eval(self.left_padding, self.offset)
        cache = QuantizedRotatingKVCache(self.max_size, group_size=self.group_size, bits=self.bits)
        padding = max(0, self.left_padding.tolist()[idx])
        keys, values = (parts_map(lambda x: x[idx : idx + 1], t) for t in (self.keys, self.values))
        end = self._idx
        if self.rotated:
            keys, values = (parts_map(lambda x: mx.roll(x, -self._idx, axis=2), t) for t in (keys, values))
            end = self.max_size
        cache.keys, cache.values = (parts_map(lambda x: mx.contiguous(x[:, :, padding:end]), t) for t in (keys, values))
        cache.offset = self.offset.tolist()[idx]
        cache._idx = cache.keys[0].shape[2]
        return cache

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedRotatingKVCache:
        """One batch of single-sequence windows (of one size), left-padded to the longest."""
        import mlx.core as mx

        if not all(c.max_size == caches[0].max_size for c in caches):
            raise ValueError("BatchQuantizedRotatingKVCache can only merge caches with the same maximum size")
        group_size, bits = check_setting(caches)
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls(caches[0].max_size, [0] * len(caches), group_size, bits)
        padding = [longest - n for n in lengths]
        like = next(c for c in caches if c.keys is not None)
        keys, values = empty_parts(like.keys, len(caches), longest), empty_parts(like.values, len(caches), longest)
        for i, (p, n, c) in enumerate(zip(padding, lengths, caches, strict=True)):
            if c.keys is None:
                continue
            for stored, own in ((keys, c.keys), (values, c.values)):
                for dst, src in zip(stored, c._temporal_order(own), strict=True):
                    dst[i : i + 1, :, p : p + n] = src[..., -n:, :]
        cache = cls(caches[0].max_size, padding, group_size, bits)
        cache.keys, cache.values = keys, values
        cache.offset = mx.array([c.offset for c in caches])
        cache._idx = cache._offset = longest
        return cache
