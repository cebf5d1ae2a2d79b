"""Forced decoding: make a random model say a script through the real inference path.

A logits processor masks every logit but the script's next token, so prefill, KV caches,
batching, EOS handling and tool-call parsing all run for real while the output is exact.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from mlx_subagents.host.calls.formats.hermes import hermes_call

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
    (`generate_step`: the prompt it was given; `BatchGenerator`: `all_tokens` + prompt), so each
    later call shows one new token (several are taken in order). Both sample one step ahead and
    ask once more after EOS: answering EOS again is harmless. When a processor after this one made
    the model emit another token than the script's (the host closing a thought at its budget), the
    script resumes after that token's next occurrence in it.

    The position in the script lives on the device and a call only builds a graph, never evaluates:
    reading the new tokens on the host would wait for the step in flight and undo the pipelining of
    mlx-lm (and of the host), which build step n+1 while step n computes.
    """

    def __init__(self, token_ids: Sequence[int], eos_token_id: int) -> None:
        self.token_ids = [int(t) for t in token_ids]
        self.eos_token_id = int(eos_token_id)
        self._seen: int | None = None  # tokens seen: the prompt at the first call, then one more per call
        self._device: _DeviceScript | None = None  # made at the first call, on the thread that decodes
        self._pos: mx.array | None = None  # the position in the script, on the device

    def __call__(self, tokens: mx.array | Sequence[int], logits: mx.array) -> mx.array:
        n = len(tokens)  # a shape: no evaluation
        if self._seen is None:
            self._seen = n
            self._device = _DeviceScript.make(self.token_ids, self.eos_token_id, logits.shape[-1])
            self._pos = mx.array(0, dtype=mx.uint32)
        if n < self._seen:
            raise RuntimeError("a ForcedProcessor serves one request; make a fresh one per request")
        device, pos = self._device, self._pos
        assert device is not None and pos is not None  # both made at the first call
        if n > self._seen and self.token_ids:  # with no script every position forces EOS
            new = tokens[self._seen : n]
            new = new if isinstance(new, mx.array) else mx.array(list(new), dtype=mx.uint32)
            for i in range(n - self._seen):
                pos = script_position(device.ids, device.index, pos, new[i : i + 1])
            self._pos = pos
        self._seen = n
        return only(logits, device.vocab == device.script[pos])

    def __repr__(self) -> str:
        return f"ForcedProcessor({len(self.token_ids)} tokens, eos={self.eos_token_id})"


def only(logits: mx.array, keep: mx.array) -> mx.array:
    """`logits` at minus infinity but where `keep`, which holds at least the lowest finite logit: the
    forced token wins even over a mask before it (the grammar's, first of a turn's processors, which
    then lets go at it). Its value still comes from `logits`, so the forward pass stays in the graph."""
    lowest = mx.array(mx.finfo(logits.dtype).min, dtype=logits.dtype)
    return mx.where(keep, mx.maximum(logits, lowest), mx.array(-mx.inf, dtype=logits.dtype))


@dataclass(frozen=True)
class _DeviceScript:
    """A script on the device, in the dtype of mlx-lm's tokens."""

    script: mx.array  # the ids then EOS: what each position forces
    ids: mx.array  # the ids alone, where the emitted tokens are looked up
    index: mx.array  # the ids' indices
    vocab: mx.array  # every token id of the vocabulary, for the mask

    @classmethod
    def make(cls, token_ids: list[int], eos_token_id: int, vocab_size: int) -> _DeviceScript:
        script = mx.array([*token_ids, eos_token_id], dtype=mx.uint32)
        index = mx.arange(len(token_ids), dtype=mx.uint32)
        return cls(script, script[:-1], index, mx.arange(vocab_size, dtype=mx.uint32))


def script_position(ids: mx.array, index: mx.array, pos: mx.array, emitted: mx.array) -> mx.array:
    """The position in the script `ids` (`index`: their indices) after `emitted` was said at `pos`,
    as a graph: one on, or one past `emitted`'s next occurrence at or after `pos` when there is one
    (`argmax` gives the first; 0, below `pos`, when there is none); at most `len(ids)`, where the
    script is said and every later position forces EOS. A handful of small ops, no evaluation.
    """
    found = mx.argmax((ids == emitted) & (index >= pos))
    return mx.minimum(mx.maximum(found, pos) + 1, ids.size)


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


class ForcedPrefix:
    """Forces `ids` right after the prompt, then lets the model (and the processors after it) decide:
    a random model's tool call, started at the marker. One instance serves one request; it reads
    only shapes, never the device."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids, self._first = list(ids), None

    def __call__(self, tokens: mx.array | Sequence[int], logits: mx.array) -> mx.array:
        self._first = len(tokens) if self._first is None else self._first
        at = len(tokens) - self._first
        if at >= len(self.ids):
            return logits
        return only(logits, mx.arange(logits.shape[-1]) == self.ids[at])


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
