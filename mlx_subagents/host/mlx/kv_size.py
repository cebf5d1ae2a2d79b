"""What a loaded model's KV cache costs, and the window a session gets within the KV budget.

`measure` decides the host's KV setting at load and reads the bytes per token off a fresh cache;
`kv_shapes` reads them at every `--kv-bits` setting for `doctor`; `session_window` caps the model's
window at what the budget holds for the sessions that must fit at once. The first two run on the mlx
thread; nothing here computes a forward (mlx is lazy: shapes only), but the probe of a cache type
whose size cannot be read off its layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import SubagentError
from ..kv.kv_bits import KVSetting, kv_setting, warn_fallback
from ..kv.kv_pool import KV_STEP, KVShape, cache_nbytes, kv_shape_of, tokens_that_fit
from ..kv.prefix_store import cache_kind
from ..protocol import DEFAULT_CONTEXT_WINDOW
from ..settings import KV_BITS


@dataclass(frozen=True)
class Measured:
    """A loaded model's KV cache: the setting it runs at, the kind the prefix store keys it by, its
    bytes per token (and fixed recurrent state), and whether it can be trimmed."""

    setting: KVSetting
    kind: str
    shape: KVShape
    trimmable: bool


def measure(model: Any, bits_requested: int, model_id: str) -> Measured:
    """The KV setting (`kv_setting`: a quantized one is tried on three tokens), KV bytes per token
    (and fixed recurrent state) under it, and whether caches can be trimmed (mlx thread).

    One token through a fresh cache gives every layer its buffers, which is enough to read the
    shape off mlx-lm's standard cache types. The graph is never evaluated: mlx is lazy, and the
    buffers' shapes and dtypes are known before any compute (a forward pass of a 4-bit model
    costs a third of a second on a small CPU). Other cache types are measured at two lengths.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import can_trim_prompt_cache

    setting, problem = kv_setting(model, bits_requested)
    if problem is not None:
        warn_fallback(model_id, bits_requested, problem)
    cache = setting.make_cache(model)
    kind = cache_kind(cache)
    model(mx.array([[0]]), cache=cache)  # lazy: shapes only, nothing computed
    shape = kv_shape_of(cache) or probe_shape(model, setting)
    return Measured(setting, kind, shape, can_trim_prompt_cache(cache))


def probe_shape(model: Any, setting: KVSetting) -> KVShape:
    """Bytes held after 256 and 512 tokens (whole KV steps, so the buffers hold exactly that)."""
    import mlx.core as mx

    cache = setting.make_cache(model)
    sizes = []
    for _ in range(2):
        model(mx.array([[0] * KV_STEP]), cache=cache)
        mx.eval([c.state for c in cache])
        sizes.append(cache_nbytes(cache))
    per_token = (sizes[1] - sizes[0]) // KV_STEP
    return KVShape(fixed=max(0, sizes[0] - per_token * KV_STEP), per_token=per_token)


def kv_shapes(model: Any) -> dict[int, KVShape | str]:
    """The KV bytes a session costs at each `--kv-bits` setting, or why this model cannot take it
    (read off fresh caches, nothing computed; mlx thread)."""
    import mlx.core as mx

    shapes: dict[int, KVShape | str] = {}
    for bits in KV_BITS:
        setting, problem = kv_setting(model, bits, evaluate=False)
        if problem is not None:
            shapes[bits] = problem
            continue
        cache = setting.make_cache(model)
        model(mx.array([[0]]), cache=cache)
        shapes[bits] = kv_shape_of(cache) or "its cache's size cannot be read off its layers"
    return shapes


def session_window(
    shape: KVShape,
    trained: int | None,
    budget: int | None,
    *,
    max_sessions: int,
    trimmable: bool,
    override: int | None,
    model_id: str,
    shared_total: int | None = None,
) -> int:
    """The per-session window: the model's, capped, and what the budget holds for max_sessions.

    Args:
        trained: the model's own window (its config's), if it says.
        override: the window asked for (`--context-window`): refused when it does not fit.
        shared_total: the budget this one is a share of (a `SharedKVBudget`), named in the errors.
    """
    window = min(trained or DEFAULT_CONTEXT_WINDOW, DEFAULT_CONTEXT_WINDOW)
    fits = None
    if budget is not None and shape.per_token:
        fits = tokens_that_fit(shape, budget // max_sessions, trimmable)
    shared = ""
    if shared_total is not None and budget != shared_total:
        shared = f" (its share of {shared_total / 2**20:.0f} MiB across the resident models)"
    if override is not None:
        if fits is not None and override > fits:
            raise SubagentError(
                f"a context window of {override} tokens for {max_sessions} sessions needs "
                f"{max_sessions * shape.bytes_for(override) / 2**30:.2f} GiB of KV cache but "
                f"the budget is {budget / 2**30:.2f} GiB{shared}; lower --context-window or raise --kv-budget"  # type: ignore[operator]
            )
        return override
    if fits is not None and fits < 256:
        raise SubagentError(
            f"the KV budget of {budget / 2**20:.0f} MiB{shared} holds only {max(fits, 0)} tokens per session for "  # type: ignore[operator]
            f"{max_sessions} sessions of {model_id}; raise --kv-budget"
        )
    return min(window, fits) if fits is not None else window
