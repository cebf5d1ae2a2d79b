"""A cache's state handed from the mlx thread to another thread: views there, the one copy there after.

The prefix store's writer must not make a decode step wait on a copy: the mlx thread hands it evaluated
views of the cache's buffers, cut to its tokens (`held`: nothing copied), and the writer makes them
contiguous (`copied`: the one copy). mlx writes in place only into a buffer no other array holds: while
a view holds it, the session's next write copies it first, so a view keeps what it saw.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .kinds import CacheKind

# What a cache holds, as the mlx thread hands it to the writer: each layer's kind and its state, as views.
Held = list[tuple["CacheKind", list[Any]]]


def _upto(tensor: Any, n: int) -> Any:
    """`tensor` cut to its first `n` tokens (quantized: packed values, scales and biases each cut alike)."""
    import mlx.core as mx

    return tensor[..., :n, :] if isinstance(tensor, mx.array) else tuple(p[..., :n, :] for p in tensor)


def _contiguous(values: list[Any]) -> list[Any]:
    import mlx.core as mx

    return [mx.contiguous(v) if isinstance(v, mx.array) else v for v in values]


def held(cache: list[Any]) -> Held:
    """What the cache holds, for the writer thread (mlx thread): each layer's kind and state, its buffers
    cut to their offset, as views of the cache's own buffers, evaluated here (a slice shares its buffer:
    nothing is copied). The session writes its buffers in place after this (mlx-lm's slice assignment),
    but mlx writes in place only into a buffer no other array holds: while a view holds it, the write
    copies it first (the session's, on this thread), so a view keeps what it saw."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map

    from .kinds import kind_of

    def length(tensor: Any) -> int:
        return int((tensor if isinstance(tensor, mx.array) else tensor[0]).shape[2])

    out = []
    for layer in cache:
        # Its own lists: a recurrent layer's state is the list the layer itself goes on writing.
        state = list(tree_map(lambda v: v, list(layer.state)))
        kind = kind_of(layer)
        assert kind is not None  # a stored cache's kinds are known (`cache_kind`)
        # A dense buffer grows in steps past its offset; a sliding window's too until it first wraps.
        if kind.grows(layer) and layer.keys is not None and layer.offset < length(layer.keys):
            state[0], state[1] = _upto(layer.keys, layer.offset), _upto(layer.values, layer.offset)
        out.append((kind, state))
    mx.eval([v for _, v in tree_flatten([state for _, state in out]) if isinstance(v, mx.array)])
    return out


def copied(views: Held) -> list[Any]:
    """The layers `held` gave, holding exactly what they held, contiguous and evaluated (writer thread:
    the one copy a stored prefix costs, made here from arrays the mlx thread evaluated, never from one
    it left pending, which another thread cannot evaluate)."""
    import mlx.core as mx

    out = []
    for kind, state in views:
        state = _contiguous(state)
        if kind.packed:  # its tensors (and a shared prefix's after them) are triples
            state = [tuple(_contiguous(list(v))) if isinstance(v, (tuple, list)) else v for v in state]
        if kind.size == "fixed":  # its state is (the list of recurrent arrays, padding, lengths)
            state[0] = _contiguous(state[0])
        out.append(kind.cls.from_state(state))
    mx.eval([c.state for c in out])
    return out
