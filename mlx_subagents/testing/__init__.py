"""Test kit: tiny random local models and forced decoding through the real mlx-lm path."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlx_subagents.testing.forced import (
    ForcedPrefix,
    ForcedProcessor,
    ForcedScripts,
    LogitsProcessor,
    Script,
    make_forced_processor,
    tool_call_text,
)

if TYPE_CHECKING:
    from mlx_subagents.testing.tiny_model import ARCHS, EOS_TOKEN, TEMPLATES, make_tiny_model

_TINY_MODEL_NAMES = frozenset({"ARCHS", "EOS_TOKEN", "TEMPLATES", "make_tiny_model"})


def __getattr__(name: str) -> Any:
    """Import `tiny_model` on first use, so `python -m mlx_subagents.testing.tiny_model` does
    not find its own module already imported (runpy warns about that)."""
    if name in _TINY_MODEL_NAMES:
        from mlx_subagents.testing import tiny_model

        return getattr(tiny_model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ARCHS",
    "EOS_TOKEN",
    "ForcedPrefix",
    "ForcedProcessor",
    "ForcedScripts",
    "LogitsProcessor",
    "Script",
    "TEMPLATES",
    "make_forced_processor",
    "make_tiny_model",
    "tool_call_text",
]
