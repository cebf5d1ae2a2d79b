"""What a host is built from besides its model (`HostSettings`), and the values of the settings every
room reads: the KV bits (`--kv-bits`) and the prefill slice (`--prefill-slice`), with their defaults and
parsers. It imports only the seam (`protocol.py`), so every room may import it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..errors import RequestError
from .protocol import ModelHost, ProcessorFactory

KV_BITS = (16, 8, 4)
DEFAULT_KV_BITS = 16

AUTO, OFF = "auto", "off"
DEFAULT_PREFILL_SLICE = AUTO
PrefillSlice = int | str  # a number of tokens, "auto" or "off"

LOOKUP = "lookup"
DRAFTS = (AUTO, OFF, LOOKUP)
DEFAULT_DRAFT = AUTO


def check_kv_bits(bits: object) -> int:
    """`bits` when it is a setting there is (16, 8 or 4); ValueError naming the choices otherwise."""
    if isinstance(bits, bool) or bits not in KV_BITS:
        raise ValueError(f"kv_bits must be 16, 8 or 4, got {bits!r}")
    return int(bits)  # type: ignore[call-overload]


def parse_prefill_slice(value: str | int | None) -> PrefillSlice:
    """`auto`, `off` or a number of tokens per slice (at least 1); None is the default, `auto`."""
    if value is None:
        return DEFAULT_PREFILL_SLICE
    if isinstance(value, int) and not isinstance(value, bool):
        tokens = value
    else:
        text = str(value).strip().lower()
        if text in (AUTO, OFF):
            return text
        try:
            tokens = int(text)
        except ValueError:
            tokens = 0
    if tokens < 1:
        raise RequestError(f"--prefill-slice {value!r} is not auto, off or a number of tokens; use e.g. auto or 64")
    return tokens


def parse_draft(value: str | None) -> str:
    """`auto`, `off` or `lookup` (how a session drafts the tokens it verifies in one forward,
    `host/mlx/drafts.py`); None is the default, `auto`."""
    if value is None:
        return DEFAULT_DRAFT
    text = str(value).strip().lower()
    if text not in DRAFTS:
        raise RequestError(f"--draft {value!r} is not auto, off or lookup; use e.g. auto")
    return text


def drafts_said(mode: str, on: bool, drafted: int, accepted: int) -> str:
    """What drafting did, in words (`doctor`, `serve --status`): its acceptance rate, the share of drafted
    tokens the model kept, each kept one a token for which no forward of its own ran."""
    if not on:
        return f"off (--draft {mode}{': lookup on a GPU only' if mode == 'auto' else ''})"
    if not drafted:
        return f"{mode}, nothing drafted yet"
    return f"{mode}, {accepted:,} of {drafted:,} drafted tokens accepted ({accepted / drafted:.0%})"


class BudgetShare(Protocol):
    """One KV budget several resident models split (the mlx room's `SharedKVBudget`): what was asked for
    (`--kv-budget` in bytes; None: a default from the free memory; 0: unbounded)."""

    request: int | None


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
            `off` (mlx; see `host/mlx/prefill.py`).
        processor_factory: logits processors for every request (mlx; the test kit's forced scripts).
        kv_bits: 16 (not quantized), 8 or 4 bits per KV value, for every session of the host (mlx).
        draft: how a session drafts tokens to verify in one forward: `auto`, `lookup` or `off` (mlx;
            see `host/mlx/drafts.py`).
    """

    engine: str | None = None
    api_key: str | None = field(default=None, repr=False)
    start_timeout: float | None = None
    context_window: int | None = None
    batching: bool = True
    kv_budget: int | str | BudgetShare | None = None
    prefix_cache: int | None = None
    prefill_slice: PrefillSlice = DEFAULT_PREFILL_SLICE
    processor_factory: ProcessorFactory | None = None
    kv_bits: int = DEFAULT_KV_BITS
    draft: str = DEFAULT_DRAFT


class HostClass(Protocol):
    """What every class in `HOST_CLASSES` has: a way to be built from a model and the settings."""

    def from_settings(self, model: str, settings: HostSettings) -> ModelHost: ...
