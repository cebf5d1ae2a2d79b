"""Model hosts: the real `MlxModelHost`, `EngineHost` (an OpenAI-compatible engine) and the
`ScriptedHost` replay backend, chosen by kind (`HOST_CLASSES`) and each built from `HostSettings`."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Protocol

from .kv_bits import DEFAULT_KV_BITS, KV_BITS
from .mlx_host import MlxModelHost, MlxSession, SharedKVBudget, parse_bytes
from .prefill import DEFAULT_PREFILL_SLICE, PrefillSlice, parse_prefill_slice
from .protocol import GenerateArgs, HostSession, MalformedToolCall, ModelHost, ProcessorFactory, Reply, ToolCall, Usage
from .scripted import SCRIPTED_PREFIX

__all__ = [
    "DEFAULT_PREFILL_SLICE",
    "DEFAULT_KV_BITS",
    "HOST_CLASSES",
    "KV_BITS",
    "GenerateArgs",
    "HostSession",
    "HostSettings",
    "MalformedToolCall",
    "MlxModelHost",
    "MlxSession",
    "ModelHost",
    "PrefillSlice",
    "Reply",
    "SharedKVBudget",
    "ToolCall",
    "Usage",
    "host_class",
    "host_kind",
    "make_host",
    "parse_bytes",
    "parse_prefill_slice",
]

# Each kind of host and where its class is, imported when first used (`openai` is slow to import).
HOST_CLASSES: dict[str, str] = {
    "mlx": "mlx_subagents.host.mlx_host.MlxModelHost",
    "engine": "mlx_subagents.host.engine_host.EngineHost",
    "scripted": "mlx_subagents.host.scripted.ScriptedHost",
}


@dataclass(frozen=True)
class HostSettings:
    """What a host is built from besides its model: a run's options in the host layer's words (the
    runner makes it, `RunOptions.host_settings`). Each host class takes what it uses (`from_settings`).

    Args:
        engine: an OpenAI-compatible engine's base URL: the model is that engine's model id.
        api_key: the engine's API key.
        start_timeout: seconds an engine's start-up probe waits at most (None: its default).
        context_window: the window per session (None: the model's).
        batching: decode the sessions in one batch (mlx).
        kv_budget: bytes for every KV cache, or a `SharedKVBudget` several resident models split (mlx).
        prefix_cache: bytes of disk for shared prefixes kept across processes (mlx; 0: off).
        prefill_slice: how a prompt is prefilled while others decode: `auto`, tokens per slice, or
            `off` (mlx; see `host/prefill.py`).
        processor_factory: logits processors for every request (mlx; the test kit's forced scripts).
        kv_bits: 16 (not quantized), 8 or 4 bits per KV value, for every session of the host (mlx).
    """

    engine: str | None = None
    api_key: str | None = field(default=None, repr=False)
    start_timeout: float | None = None
    context_window: int | None = None
    batching: bool = True
    kv_budget: int | str | SharedKVBudget | None = None
    prefix_cache: int | None = None
    prefill_slice: PrefillSlice = DEFAULT_PREFILL_SLICE
    processor_factory: ProcessorFactory | None = None
    kv_bits: int = DEFAULT_KV_BITS


class HostClass(Protocol):
    """What every class in `HOST_CLASSES` has: a way to be built from a model and the settings."""

    def from_settings(self, model: str, settings: HostSettings) -> ModelHost: ...


def host_kind(model: str, engine: str | None = None) -> str:
    """The kind of host a model runs on: an engine's when one is named, the replay host for
    `scripted:FILE`, else the resident mlx model."""
    if engine is not None:
        return "engine"
    return "scripted" if model.startswith(SCRIPTED_PREFIX) else "mlx"


def host_class(kind: str) -> HostClass:
    """The host class of a kind; an unknown kind raises, listing the kinds there are."""
    if kind not in HOST_CLASSES:
        raise ValueError(f"unknown host kind {kind!r}; the kinds: {', '.join(HOST_CLASSES)}")
    module, _, name = HOST_CLASSES[kind].rpartition(".")
    return getattr(importlib.import_module(module), name)


def make_host(model: str, settings: HostSettings | None = None) -> ModelHost:
    """The host for `model`, of the kind it runs on (`host_kind`), built from `settings`."""
    settings = settings or HostSettings()
    return host_class(host_kind(model, settings.engine)).from_settings(model, settings)
