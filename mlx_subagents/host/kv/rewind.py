"""Rewinding a drafted forward: the positions of rejected draft tokens taken back off a session's cache,
leaving it as a cache that decoded only the accepted tokens would be, bytes included.

A verifying forward writes the token before the draft and every drafted token; the verdict keeps a
prefix of them. What is taken back, per cache kind (`kinds.py`'s table):

- dense layers (mlx-lm's `KVCache`, a tail over a shared prefix, quantized or not): mlx-lm's own
  `trim` (and `OverPrefix.trim`), which moves the offset back;
- sliding-window layers (quantized or not): the forward wrote its tokens in temporal order at the end
  of the buffer (mlx-lm's concatenating update), so the rejected ones are cut off its end. mlx-lm's
  `trim` refuses a window that has wrapped, since a single step overwrites the oldest token in place;
  after a forward of several tokens nothing was overwritten yet;
- recurrent layers (a hybrid model's `ArraysCache`): no rewind. Their state is a running sum with no
  positions to take back, so such a session does not draft (`refusal`).

Rows of a batch (`rewind_rows`) each take back their own number of positions. mlx-lm's batch caches
hold their rows right-aligned at one index, each after its own left padding, so a row's rejected
positions come off as mlx-lm takes a shorter prompt's right padding off after a ragged prefill: the
positions every row rejected are trimmed, then each row is rolled right by the rest of its own, which
become left padding (masked), and the padding all rows share is cut off the front. Only the dense
kinds do this (`rows_refusal`): a sliding window's rows share one ring, and a recurrent state holds
no positions.

Each buffer of a single sequence is then brought to the size that single steps would have left (`Mark`
holds the sizes before the forward). A forward of several tokens grows a buffer from its offset, not from its end,
and by as many steps as the draft needs, so without this a session that drafted would hold other
bytes than one that did not, and the KV pool's figures, which count whole steps, would drift.
Resizing copies the buffer, which happens only when a draft crossed the end of a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .kinds import CacheKind, cache_kinds, kind_of


@dataclass(frozen=True)
class Mark:
    """The room each layer's buffers had before a drafted forward (its length in tokens, 0 for none)."""

    rooms: tuple[int, ...]


def refusal(cache: Sequence[Any]) -> str | None:
    """Why a session on `cache` cannot draft (one line), or None when every layer rewinds."""
    for layer in cache:
        kind = kind_of(layer)
        if kind is None:
            return f"drafts off: a {type(layer).__name__} layer is no cache kind this host can rewind"
        if not kind.rewinds:
            return "drafts off: a recurrent layer's state cannot be rewound past a rejected draft"
    return None


def rows_refusal(cache: Sequence[Any]) -> str | None:
    """Why the rows of a batch on `cache` (its batch layers) cannot draft (one line), or None when every
    layer takes back each row's own positions."""
    kinds = {kind.batch: kind for kind in cache_kinds().values()}
    for layer in cache:
        kind = kinds.get(type(layer))
        if kind is None or not kind.rewinds:
            return f"drafts off in the batch: a {type(layer).__name__} layer's rows cannot be rewound one by one"
        if kind.window:
            return "drafts off in the batch: a sliding window's rows share one ring, no row can be rewound alone"
    return None


def rewind_rows(cache: Sequence[Any], rejected: Sequence[int]) -> None:
    """Take the last `rejected[i]` positions written back off row i of every batch layer of `cache`,
    as though the row had been fed only the positions it kept (`rows_refusal` must be None)."""
    from mlx_lm.models.cache import BatchKVCache

    least = min(rejected)
    extra = [r - least for r in rejected]
    for layer in cache:
        if least:  # mlx-lm's own trim: a prefixed batch's `trim` would copy the prefix into every row
            BatchKVCache.trim(layer, least)
        if any(extra):
            layer.prepare(right_padding=extra)
            layer.finalize()
    shared = min(cache[0].left_padding.tolist()) if any(extra) and cache else 0
    if shared > 0:  # every row padded in front: cut it, as mlx-lm's `filter` does
        for layer in cache:
            packed = isinstance(layer.keys, (tuple, list))
            layer.keys, layer.values = (
                tuple(x[..., shared:, :] for x in t) if packed else t[..., shared:, :]
                for t in (layer.keys, layer.values)
            )
            layer._idx -= shared
            layer.left_padding -= shared


def mark(cache: Sequence[Any]) -> Mark:
    """The buffers' room now, before a drafted forward writes into `cache`."""
    return Mark(tuple(_room(layer) for layer in cache))


def rewind(cache: Sequence[Any], n: int, before: Mark) -> None:
    """Take the last `n` positions written back off every layer of `cache` (n may be 0), and give each
    buffer the room single steps from `before` would have left it."""
    for layer, room in zip(cache, before.rooms, strict=True):
        kind = kind_of(layer)
        assert kind is not None and kind.rewinds, refusal([layer])
        if kind.window:
            _cut_window(layer, kind, n)
        elif n:
            layer.trim(n)
        _settle(layer, kind, room)


def _room(layer: Any) -> int:
    keys = layer.keys
    if keys is None:
        return 0
    return int((keys[0] if isinstance(keys, (tuple, list)) else keys).shape[2])


def _held(layer: Any) -> int:
    """The tokens the layer's own buffer holds (a tail over a shared prefix counts without it)."""
    return int(layer.offset) - int(getattr(layer, "n_prefix", 0))


def _resize(kind: CacheKind, tensor: Any, tokens: int) -> Any:
    """`tensor` (an array, or a quantized triple) cut or padded with zeros to `tokens` tokens."""
    import mlx.core as mx

    def one(x: Any) -> Any:
        have = x.shape[2]
        if have >= tokens:
            return mx.contiguous(x[..., :tokens, :])
        return mx.concatenate([x, mx.zeros((*x.shape[:2], tokens - have, x.shape[3]), x.dtype)], axis=2)

    return tuple(one(p) for p in tensor) if kind.packed else one(tensor)


def _cut_window(layer: Any, kind: CacheKind, n: int) -> None:
    """A window after a forward of several tokens is in temporal order with `_idx` at its end: the last
    `n` are cut off (a single-token forward leaves nothing to cut)."""
    if n:
        keep = layer._idx - n
        layer.keys, layer.values = _resize(kind, layer.keys, keep), _resize(kind, layer.values, keep)
        layer.offset -= n
        layer._idx = keep


def _settle(layer: Any, kind: CacheKind, room: int) -> None:
    """The buffer at the room single steps would have given it from `room`."""
    now = _room(layer)
    if layer.keys is None or room == 0:
        return  # a first forward allocates as a prompt does, drafted or not
    if kind.window and layer._idx != now:
        return  # a single step's window, in its ring order: nothing a draft wrote
    held = _held(layer)
    if kind.window and held >= layer.max_size:
        if now > layer.max_size:  # wrapped: a single step keeps the window's size, the oldest dropped
            layer.keys = layer._trim(now - layer.max_size, layer.keys)
            layer.values = layer._trim(now - layer.max_size, layer.values)
        layer._idx = layer.max_size
        return
    step = min(layer.step, layer.max_size - room) if kind.window else layer.step
    target = room if held <= room else room + step
    if now != target:
        layer.keys, layer.values = _resize(kind, layer.keys, target), _resize(kind, layer.values, target)
