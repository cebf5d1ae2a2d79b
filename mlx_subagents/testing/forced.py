"""Forced decoding: make a random model say a script through the real inference path.

A logits processor masks every logit but the script's next token, so prefill, KV caches,
batching, EOS handling and tool-call parsing all run for real while the output is exact.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import mlx.core as mx

from mlx_subagents.host.toolcalls import hermes_call

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
Script = str | Sequence[int]


class ScriptTokenizer(Protocol):
    """What forcing needs from a tokenizer (an mlx-lm TokenizerWrapper or an HF tokenizer)."""

    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class ForcedProcessor:
    """Forces `token_ids` one per step after the prompt, then EOS for as long as it is asked.

    The prompt length is taken from the first call, so one instance serves one request. Both
    paths pass a 1-D `mx.array` holding the context plus the tokens generated so far
    (`generate_step`: the prompt it was given; `BatchGenerator`: `all_tokens` + prompt), so the
    position in the script is the growth since that first call. Both sample one step ahead and
    ask once more after EOS: answering EOS again is harmless.
    """

    def __init__(self, token_ids: Sequence[int], eos_token_id: int) -> None:
        self.token_ids = [int(t) for t in token_ids]
        self.eos_token_id = int(eos_token_id)
        self._prompt_len: int | None = None

    def __call__(self, tokens: mx.array | Sequence[int], logits: mx.array) -> mx.array:
        n = len(tokens)
        if self._prompt_len is None:
            self._prompt_len = n
        step = n - self._prompt_len
        if step < 0:
            raise RuntimeError("a ForcedProcessor serves one request; make a fresh one per request")
        target = self.token_ids[step] if step < len(self.token_ids) else self.eos_token_id
        keep = mx.arange(logits.shape[-1]) == target
        return mx.where(keep, logits, mx.array(-mx.inf, dtype=logits.dtype))

    def __repr__(self) -> str:
        return f"ForcedProcessor({len(self.token_ids)} tokens, eos={self.eos_token_id})"


def make_forced_processor(tokenizer: ScriptTokenizer, script: Script) -> ForcedProcessor:
    """A fresh processor forcing `script` (text, or token ids) and then the tokenizer's EOS.

    Creates no mlx arrays until called, so it can be built on any thread.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has no eos_token_id to end the forced script with")
    if isinstance(script, str):
        token_ids = tokenizer.encode(script, add_special_tokens=False)
    else:
        token_ids = list(script)
    return ForcedProcessor(token_ids, tokenizer.eos_token_id)


class ForcedScripts:
    """Per-request processor factory: each request of a session forces that session's next script.

    Call signature `(session_name, prompt_ids) -> list[processor]`; a session with no script
    left gets `[]` (the model then samples freely).
    """

    def __init__(self, tokenizer: ScriptTokenizer, scripts: Mapping[str, Sequence[Script]]) -> None:
        self._tokenizer = tokenizer
        self._queues = {name: deque(items) for name, items in scripts.items()}
        self._lock = threading.Lock()

    def __call__(self, session_name: str, prompt_ids: Sequence[int]) -> list[LogitsProcessor]:
        with self._lock:
            queue = self._queues.get(session_name)
            if not queue:
                return []
            script = queue.popleft()
        return [make_forced_processor(self._tokenizer, script)]

    def remaining(self, session_name: str) -> int:
        """Scripts not yet used by `session_name`."""
        with self._lock:
            return len(self._queues.get(session_name, ()))


def tool_call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """The exact text of one call as the tiny model's tools template renders it, which is also the
    Hermes format a prompted model is taught.

    transformers' `tojson` is `json.dumps(..., ensure_ascii=False)` with default separators, so
    re-rendering a forced call through the template reproduces the same text and tokens.
    """
    return hermes_call(name, arguments)
