"""SchedulerConfig: how the scheduler and its stages run, as the host sets them from its settings."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import DEFAULT_DRAFT, DEFAULT_PREFILL_SLICE, PrefillSlice


@dataclass
class SchedulerConfig:
    reuse: bool = True
    batching: bool = True
    prefill_step_size: int = 512
    share_prefix: bool = True
    context_window: int = 4096
    prefill_slice: PrefillSlice = DEFAULT_PREFILL_SLICE  # tokens per slice, "auto" or "off" (see prefill.py)
    draft: str = DEFAULT_DRAFT  # "auto", "lookup" or "off" (see drafts.py)
