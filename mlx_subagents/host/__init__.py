"""Model hosts: the real `MlxModelHost` (`mlx/`), `EngineHost` (`engine/`: an OpenAI-compatible engine)
and the `ScriptedHost` replay backend, chosen by kind (`HOST_CLASSES`) and each built from `HostSettings`
(`settings.py`). The rooms, each importing only the ones below it: `scripted` > `engine` | `mlx` >
`calls` | `kv` > `settings` > `protocol` (host/AGENTS.md)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .kv.budget import SharedKVBudget, parse_bytes
from .protocol import GenerateArgs, HostSession, MalformedToolCall, ModelHost, ProcessorFactory, Reply, ToolCall, Usage
from .scripted import SCRIPTED_PREFIX
from .settings import (
    DEFAULT_DRAFT,
    DEFAULT_KV_BITS,
    DEFAULT_PREFILL_SLICE,
    KV_BITS,
    HostClass,
    HostSettings,
    PrefillSlice,
    drafts_said,
    parse_draft,
    parse_prefill_slice,
)

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_PREFILL_SLICE",
    "DEFAULT_KV_BITS",
    "HOST_CLASSES",
    "HostClass",
    "KV_BITS",
    "GenerateArgs",
    "HostSession",
    "HostSettings",
    "MalformedToolCall",
    "MlxModelHost",
    "MlxSession",
    "ModelHost",
    "PrefillSlice",
    "ProcessorFactory",
    "Reply",
    "SharedKVBudget",
    "ToolCall",
    "Usage",
    "host_class",
    "host_kind",
    "make_host",
    "parse_bytes",
    "drafts_said",
    "parse_draft",
    "parse_prefill_slice",
]

if TYPE_CHECKING:
    from .mlx.mlx_host import MlxModelHost
    from .mlx.mlx_session import MlxSession

# The mlx room's names, imported at first use: mlx-lm (and transformers under it) take seconds of a CPU
# to import, which a process that runs a scripted or engine model, or only parses a size, never needs.
_MLX_NAMES = {"MlxModelHost", "MlxSession"}


def __getattr__(name: str) -> Any:
    if name in _MLX_NAMES:
        return getattr(importlib.import_module(".mlx.mlx_host", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Each kind of host and where its class is, imported when first used (`openai` is slow to import).
HOST_CLASSES: dict[str, str] = {
    "mlx": "mlx_subagents.host.mlx.mlx_host.MlxModelHost",
    "engine": "mlx_subagents.host.engine.engine_host.EngineHost",
    "scripted": "mlx_subagents.host.scripted.ScriptedHost",
}


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
