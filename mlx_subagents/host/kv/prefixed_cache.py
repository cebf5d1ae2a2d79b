"""KV caches over a shared prefix: the keys and values of a prefix many sessions start with are held
once in memory, not once per session.

Sessions of one agent start with the same system prompt and tools (about a thousand tokens for a
scout), and a call's forks with their parent's whole conversation. A session that starts from a
shared prefix (`prefix_cache.SharedPrefixes`) keeps, per attention layer, a reference to the prefix's
keys and values (`SharedPrefix`, never written) and its own tail after them. Attention reads the two
joined, as one array: the values and their order are the ones a single buffer would hold, so the
tokens are the same; the join costs a copy of the prefix per layer and step, freed at once (a few
percent of a decode step), where a private copy would cost the prefix's bytes per session for as
long as the session lives.

Two mixins make that split: `OverPrefix` on a single-sequence cache (`PrefixedKVCache` here, over
mlx-lm's `KVCache`; `quantized_cache.QuantizedKVCache` at 8 and 4 bits) and `OverPrefixBatch` on a
batch (`BatchPrefixedKVCache`, `quantized_cache.BatchQuantizedKVCache`). Without a prefix each is its
base class (the same code and arrays), which is what every attention layer of this host's caches is
(`kv_bits.KVSetting`). A batch whose rows all start from one shared prefix keeps the rows' tails as
its buffer (left-padded as there), joins the prefix in front of every row at each step, and masks
each row's padding between the two. Rows of different prefixes (another agent's session, a restored
one) make the batch hold every row whole, as mlx-lm's batch does (`_unshare`); a prefixed row leaves
the batch with its own tail and the shared prefix. Sliding-window layers are not shared: each session
keeps its own copy.

A tensor here is one array (16 bits) or a quantized triple (packed values, scales, biases), each
moved alike along the token axis (`_each`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from mlx_lm.models import cache as mlx_cache

Tensor = Any  # an mx.array, or a tuple of them (a quantized tensor's parts)

# A tail over a shared prefix grows its buffer in steps of this many tokens (mlx-lm's caches: 256). A
# tail is often short (a task, a reply, a tool result) and growing it copies only the tail, not the
# prefix: smaller steps cost little and hold less (a SmolLM2 session's 54-token tail: 2.9 MB, not 11.8).
TAIL_STEP = 64
# A prefix shorter than this is copied into each session instead: it saves little memory, while the
# join costs a few ops per layer and step whatever the prefix's length (a cost a small model notices).
MIN_SHARED_TOKENS = 256


def _each(fn: Callable[..., Any], *tensors: Tensor) -> Tensor:
    """`fn` on each part of the tensors alike (zipped), as one tensor again."""
    if isinstance(tensors[0], (tuple, list)):  # a file read back gives the parts as a list
        return tuple(fn(*parts) for parts in zip(*tensors, strict=True))
    return fn(*tensors)


def _parts(tensor: Tensor) -> tuple[Any, ...]:
    return tuple(tensor) if isinstance(tensor, (tuple, list)) else (tensor,)


def _nbytes(tensor: Tensor | None) -> int:
    return 0 if tensor is None else sum(p.nbytes for p in _parts(tensor))


class SharedPrefix:
    """One prefix's keys and values, per attention layer `(keys, values)` of shape (1, KV heads, tokens,
    ...) (None for other layers), exactly as long as the prefix and never written; held by
    `SharedPrefixes` and by every cache (or batch) that starts from it (`users`)."""

    def __init__(self, layers: Sequence[tuple[Tensor, Tensor] | None], length: int) -> None:
        self.layers, self.length = list(layers), length
        self.users: weakref.WeakSet[Any] = weakref.WeakSet()

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(k) + _nbytes(v) for kv in self.layers if kv is not None for k, v in [kv])


class _Sharing:
    """What a cache (single or batch) that may start from a shared prefix knows of it."""

    shared: SharedPrefix | None = None
    layer = 0
    offset: Any

    def share(self, shared: SharedPrefix, layer: int) -> None:
        """Start from layer `layer` of `shared` (the cache holds nothing yet but what follows it); its own
        buffer then grows in steps of `TAIL_STEP`."""
        self.shared, self.layer = shared, layer
        shared.users.add(self)
        self.offset = self.offset + shared.length
        self.step = TAIL_STEP

    def _unlink(self) -> None:
        if self.shared is not None:
            self.shared.users.discard(self)
        self.shared, self.layer = None, 0

    @property
    def prefix(self) -> tuple[Tensor, Tensor] | None:
        """The shared prefix's keys and values for this layer (None: the cache holds it all itself)."""
        return None if self.shared is None else self.shared.layers[self.layer]

    @property
    def n_prefix(self) -> int:
        return 0 if self.shared is None else self.shared.length


class OverPrefix(_Sharing):
    """A single-sequence cache (the class after this one in the bases) optionally over layer `layer` of a
    `SharedPrefix`: `offset` counts the prefix (positions and masks are those of the whole sequence),
    `keys` and `values` hold the tail, written by the base class's own `update_and_fetch`."""

    _writing = False  # inside the base class's write, which counts the tail only
    offset: int
    keys: Tensor | None
    values: Tensor | None

    def started_over(self, shared: SharedPrefix, layer: int) -> Any:
        """A new cache of this kind (its quantization too) holding nothing but layer `layer` of `shared`."""
        clone = type(self).__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.keys = clone.values = None
        clone.offset, clone.shared = 0, None
        clone.share(shared, layer)
        return clone

    def going_on_as(self, whole: Any) -> Any:
        """A new cache of this kind over this one's shared prefix (it holds nothing after it), holding what
        `whole` holds after the prefix: `whole` holds the same tokens, and more, itself (a spill read back)
        or over a shorter shared prefix (an idle session whose conversation another starts with). The
        tail is copied into a buffer of whole steps, as if it had been written here, so `whole`'s buffers
        go with it."""
        import copy

        import mlx.core as mx

        n, m, clone = self.n_prefix, whole.n_prefix, copy.deepcopy(self)
        held = whole.offset - n
        room = -(-held // clone.step) * clone.step - held

        def tail(x: Any) -> Any:
            part = x[..., n - m : whole.offset - m, :]
            return mx.concatenate([part, mx.zeros((*part.shape[:2], room, part.shape[3]), part.dtype)], axis=2)

        if held > 0:
            clone.keys, clone.values = (_each(tail, t) for t in (whole.keys, whole.values))
        clone.offset = whole.offset
        return clone

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Tensor, Tensor]:
        """The base class's: the new tokens written after the tail, then the whole sequence, the shared
        prefix joined in front."""
        if self.shared is None:
            return super().update_and_fetch(keys, values)  # type: ignore[misc,no-any-return]
        n = self.n_prefix
        self.offset -= n  # the base class writes at the tail's own positions
        self._writing = True
        try:
            super().update_and_fetch(keys, values)  # type: ignore[misc]
        finally:
            self.offset += n
            self._writing = False
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Tensor, Tensor]:
        if self.shared is None or self._writing:
            return super().keys_and_values()  # type: ignore[misc,no-any-return]
        held = self.offset - self.n_prefix
        if self.keys is None or held == 0:
            return self.prefix  # type: ignore[return-value]
        tail = (_each(lambda x: x[..., :held, :], t) for t in (self.keys, self.values))
        return _joined(self.prefix, *tail)  # type: ignore[arg-type]

    @property
    def state(self) -> tuple[Any, ...]:
        """The base class's state, then the shared prefix's keys and values (a file of it holds the whole
        sequence; `from_state` makes that a cache of its own)."""
        base = super().state  # type: ignore[misc]
        return base if self.shared is None else (*base, *self.prefix)  # type: ignore[misc]

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        """A state as `state` gives it; with a prefix's keys and values, the cache holds the whole sequence
        itself (one copy, made here)."""
        import mlx.core as mx

        self.shared, self.layer = None, 0
        if len(v) != self._base_state_length + 2:
            super(OverPrefix, type(self)).state.fset(self, v)  # type: ignore[misc,attr-defined]
            return
        *base, pk, pv = v
        super(OverPrefix, type(self)).state.fset(self, tuple(base))  # type: ignore[misc,attr-defined]
        held = self.offset - _tokens(pk)
        if self.keys is None or held == 0:
            self.keys, self.values = pk, pv
        else:

            def join(p: Any, t: Any) -> Any:
                return mx.concatenate([p, t[..., :held, :]], axis=2)

            self.keys, self.values = _each(join, pk, self.keys), _each(join, pv, self.values)

    _base_state_length = 3

    def size(self) -> int:
        return int(self.offset)

    def empty(self) -> bool:
        return self.keys is None and self.shared is None

    def trim(self, n: int) -> int:
        """Trim as the base class does; into the shared prefix, the cache first holds what is left of the
        prefix itself (a view of it: its first write copies)."""
        n = min(self.offset, n)
        if self.shared is not None and n > self.offset - self.n_prefix:
            keep = self.offset - n
            self.keys, self.values = (_each(lambda x: x[..., :keep, :], t) for t in self.prefix)  # type: ignore[union-attr]
            self._unlink()
            self.offset = keep
            return n
        self.offset -= n
        return n

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> Any:
        raise TypeError("this host's KV caches are quantized as they are made (--kv-bits), not after")

    def frozen(self) -> tuple[Tensor, Tensor]:
        """The whole sequence's keys and values, exactly as long as it and contiguous (a new shared prefix's):
        this layer's prefix itself when the cache holds nothing after it."""
        import mlx.core as mx

        if self.shared is not None and self.offset == self.n_prefix:
            return self.prefix  # type: ignore[return-value]
        keys, values = self.keys_and_values()
        return _each(mx.contiguous, keys), _each(mx.contiguous, values)

    @property
    def nbytes(self) -> int:
        """The cache's own bytes (its shared prefix is counted once, where it is kept)."""
        return _nbytes(self.keys) + _nbytes(self.values)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A copy of its own tail over the same shared prefix: new arrays over the same buffers (`_views`),
        each copied at its first write."""
        clone = type(self).__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.keys, clone.values = _views(self.keys), _views(self.values)
        if self.shared is not None:
            self.shared.users.add(clone)
        return clone


class PrefixedKVCache(OverPrefix, mlx_cache.KVCache):
    """mlx-lm's `KVCache`, optionally over a shared prefix (`OverPrefix`)."""

    def __init__(self, shared: SharedPrefix | None = None, layer: int = 0) -> None:
        mlx_cache.KVCache.__init__(self)
        if shared is not None:
            self.share(shared, layer)

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchPrefixedKVCache:
        return BatchPrefixedKVCache.merge(caches)


def freeze(cache: list[Any], length: int) -> list[Any]:
    """An entry of what `cache` holds (exactly `length` tokens): its attention layers over one new
    `SharedPrefix`, the others (sliding windows, recurrent state) copies; all copies below
    `MIN_SHARED_TOKENS` (mlx arrays are values: a copy's buffer is copied at its first write)."""
    import copy

    if length < MIN_SHARED_TOKENS:
        return copy.deepcopy(cache)
    over = [isinstance(c, OverPrefix) for c in cache]
    shared = SharedPrefix([c.frozen() if o else None for c, o in zip(cache, over, strict=True)], length)
    return [c.started_over(shared, i) if o else copy.deepcopy(c) for i, (c, o) in enumerate(zip(cache, over))]


def over_prefix(entry: list[Any], whole: list[Any]) -> list[Any]:
    """`whole` (a cache holding an entry's prefix and more, itself or over a shorter shared prefix: a spill
    read back, an idle session another starts like) over the entry's shared prefix: the layers that start
    from it hold only what follows it, the others are `whole`'s own."""

    def goes_over(e: Any, w: Any) -> bool:
        shared = getattr(e, "shared", None)
        return shared is not None and type(w) is type(e) and w.shared is not shared and w.n_prefix <= e.n_prefix

    return [e.going_on_as(w) if goes_over(e, w) else w for e, w in zip(entry, whole, strict=True)]


def shared_layers(cache: list[Any]) -> list[Any]:
    """The layers of a fresh cache, each dense `KVCache` as a `PrefixedKVCache` (so that it can start from
    a shared prefix, and batch with those that do); other layers as they are."""
    return [PrefixedKVCache() if type(c) is mlx_cache.KVCache and c.empty() else c for c in cache]


def _views(tensor: Tensor | None) -> Tensor | None:
    """New arrays over the same buffers as `tensor`'s (None: None). The cache writes into its arrays in
    place (`keys[..., i:j, :] = ...`), which a second holder of the same array objects would see; a view
    is copied at its first write instead, and costs nothing until then."""
    return None if tensor is None else _each(lambda x: x[:], tensor)


def _tokens(tensor: Tensor) -> int:
    return int(_parts(tensor)[0].shape[2])


def _joined(prefix: tuple[Tensor, Tensor], keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """The prefix's keys and values before `keys` and `values` (on every row of a batch)."""
    import mlx.core as mx

    def join(p: Any, t: Any) -> Any:
        if p.shape[0] != t.shape[0]:
            p = mx.broadcast_to(p, (t.shape[0], *p.shape[1:]))
        return mx.concatenate([p, t], axis=2)

    pk, pv = prefix
    return _each(join, pk, keys), _each(join, pv, values)


class OverPrefixBatch(_Sharing):
    """A batch cache (the class after this one in the bases) whose rows may all start from one shared
    prefix (`shared`): then `keys` and `values` hold the rows' tails, left-padded as there, and each
    step reads the prefix joined in front of every row. `offset` counts the prefix (positions),
    `_idx` and `left_padding` the tails' buffer. Without a shared prefix it is its base class."""

    single: type[OverPrefix]  # the single-sequence class of its rows
    keys: Tensor | None
    values: Tensor | None
    left_padding: Any
    _idx: int

    def keys_and_values(self) -> tuple[Tensor, Tensor]:
        """The rows' keys and values (what `update_and_fetch` returns): the tails, after the shared prefix."""
        tail = super().keys_and_values()  # type: ignore[misc]
        return tail if self.shared is None else _joined(self.prefix, *tail)  # type: ignore[arg-type,no-any-return]

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        """mlx-lm's causal mask over the whole rows: the prefix seen by every query, each row's padding
        (between the prefix and its tail) by none."""
        if self.shared is None:
            return super().make_mask(N, return_array=return_array, **kwargs)  # type: ignore[misc]
        import mlx.core as mx
        from mlx_lm.models.base import create_causal_mask

        n = self.n_prefix
        mask = create_causal_mask(N, offset=n + self._idx, **kwargs)
        positions = mx.arange(n + self._idx + N)
        padding = (positions >= n) & (positions < n + mx.expand_dims(self.left_padding, 1))
        return mask & ~mx.expand_dims(padding, (1, 2))

    def size(self) -> int:
        return self.n_prefix + int(self._idx)

    def empty(self) -> bool:
        return self.keys is None and self.shared is None

    def trim(self, n: int) -> int:
        self._unshare()
        return super().trim(n)  # type: ignore[misc,no-any-return]

    def extend(self, other: Any) -> None:
        """Append `other`'s rows; rows of another prefix (or none) make both hold their rows whole."""
        if getattr(other, "shared", None) is not self.shared or getattr(other, "layer", 0) != self.layer:
            self._unshare()
            if isinstance(other, OverPrefixBatch):
                other._unshare()
        super().extend(other)  # type: ignore[misc]

    def _unshare(self) -> None:
        """Hold every row whole, as mlx-lm's batch does (left padding, then prefix and tail)."""
        if self.shared is None:
            return
        import mlx.core as mx

        pk, pv = self.prefix  # type: ignore[misc]
        n, rows = self.n_prefix, self.offset.shape[0]
        self._unlink()
        if self.keys is None:  # no tail yet: every row is the prefix
            self.keys, self.values = (
                _each(lambda p: mx.contiguous(mx.broadcast_to(p, (rows, *p.shape[1:]))), t) for t in (pk, pv)
            )
            self.left_padding = mx.zeros_like(self.left_padding)
            self._idx = n
            return
        whole = []
        for prefix, tail in ((pk, self.keys), (pv, self.values)):
            parts = [mx.zeros((rows, p.shape[1], n + self._idx, p.shape[3]), p.dtype) for p in _parts(prefix)]
            for i, pad in enumerate(self.left_padding.tolist()):
                for dst, p, t in zip(parts, _parts(prefix), _parts(tail), strict=True):
                    dst[i : i + 1, :, pad : pad + n] = p
                    dst[i : i + 1, :, pad + n :] = t[i : i + 1, :, pad : self._idx]
            whole.append(tuple(parts) if isinstance(prefix, (tuple, list)) else parts[0])
        self.keys, self.values = whole
        self._idx = n + self._idx

    def extract(self, idx: int) -> Any:
        """Row `idx` as a single-sequence cache: its own tail, over the shared prefix (if any)."""
        cache = self.single.__new__(self.single)
        if self.keys is None:
            base = self._empty_single()
        else:
            base = super().extract(idx)  # type: ignore[misc]
        cache.__dict__.update(base.__dict__)
        if self.shared is not None:
            cache.share(self.shared, self.layer)
        return cache

    def _empty_single(self) -> Any:
        raise NotImplementedError

    @classmethod
    def _merged(cls, caches: list[Any], merge: Callable[[list[Any]], Any]) -> Any:
        """`merge` (the base class's) of the caches: over their shared prefix when they all start from the
        same one (their tails merged), else each read whole."""
        shared, layer = getattr(caches[0], "shared", None), getattr(caches[0], "layer", 0)
        together = shared is not None and all(getattr(c, "shared", None) is shared and c.layer == layer for c in caches)
        batch = merge([_Row(c, whole=not together) for c in caches])
        if together:
            batch.share(shared, layer)
        return batch

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        import copy

        clone = type(self).__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.left_padding, clone.offset = copy.deepcopy(self.left_padding), copy.deepcopy(self.offset)
        clone.keys, clone.values = _views(self.keys), _views(self.values)
        if self.shared is not None:
            self.shared.users.add(clone)
        return clone


class BatchPrefixedKVCache(OverPrefixBatch, mlx_cache.BatchKVCache):
    """mlx-lm's `BatchKVCache`, its rows optionally over one shared prefix (`OverPrefixBatch`)."""

    single = PrefixedKVCache

    def _empty_single(self) -> Any:
        return mlx_cache.KVCache()

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchPrefixedKVCache:
        def merge(rows: list[_Row]) -> BatchPrefixedKVCache:
            if max(r.size() for r in rows) == 0:  # mlx-lm's would make a plain `BatchKVCache`
                return cls([0] * len(rows))
            return super(BatchPrefixedKVCache, cls).merge(rows)  # type: ignore[no-any-return]

        return cls._merged(caches, merge)  # type: ignore[no-any-return]


class _Row:
    """A single cache as the base classes' `merge` reads one: its tail over a shared prefix, or the whole
    sequence (a prefixed one's joined: a copy)."""

    def __init__(self, cache: Any, whole: bool) -> None:
        self.group_size, self.bits = getattr(cache, "group_size", None), getattr(cache, "bits", None)
        n = getattr(cache, "n_prefix", 0)
        if whole and n:
            self.keys, self.values = cache.keys_and_values()
            self.offset = int(cache.offset)
        else:
            self.keys, self.values = cache.keys, cache.values
            self.offset = int(cache.offset) - (0 if whole else n)

    def size(self) -> int:
        return self.offset
