"""Token counts without a tokenizer: the estimate the scripted and engine hosts count with."""

from __future__ import annotations

import json
from typing import Any

from ..protocol import Message, ToolSchema

# What BPE tokenizers give on English and code, roughly.
CHARS_PER_TOKEN = 4


def approx_tokens(messages: list[Message], tools: list[ToolSchema] | None = None) -> int:
    """Approximate token count: `len(text) // CHARS_PER_TOKEN + 1` per rendered message (and for the tools).

    A message is rendered as compact, key-sorted JSON, so equal messages always count the same;
    the `+ 1` stands for the per-message template overhead.
    """
    total = sum(_estimate(m) for m in messages)
    if tools:
        total += _estimate(tools)
    return total


def _estimate(value: Any) -> int:
    rendered = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return len(rendered) // CHARS_PER_TOKEN + 1
