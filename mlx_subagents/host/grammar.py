"""Tool-call grammars: a reply that starts a call ends as a well-formed call to a known tool.

One logits processor per request, free until the model writes the call-start marker
(outside a thought), and from there constrained by an llguidance matcher to a JSON call
`{"name": <one of the session's tools>, "arguments": <valid against that tool's schema>}`
and the end marker; then free again, so several calls stay possible. The grammar is the
Hermes `<tool_call>` format (what the tiny model's and Qwen's templates write, and what a
prompted model is taught); a model whose native format is another gets no grammar.

llguidance's matcher lives on the host, so the processor reads each new token there (one
sync per token; its mlx bitmask kernel is Metal-only, so the mask is applied with ordinary
mlx ops). The llguidance tokenizer (about a second to build on a real vocabulary) and each
tool set's compiled matcher are cached per host; a request gets a copy of the matcher.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .protocol import ToolSchema

if TYPE_CHECKING:  # imported where they run: importing the host stays quick
    import mlx.core as mx

log = logging.getLogger(__name__)


def call_schema(tools: list[ToolSchema], loose: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The JSON schema of one call body: any of the tools, each by its name and with its parameters
    (any object for the tools named in `loose`). Each tool's `$defs` move to the root, renamed
    per tool, since `$ref` pointers resolve from there."""
    variants, defs = [], {}
    for i, tool in enumerate(tools):
        function = tool.get("function", tool)
        parameters = dict(function.get("parameters") or {"type": "object"})
        if function["name"] in loose:
            parameters = {"type": "object"}
        for key in ("$defs", "definitions"):
            for name, schema in (parameters.pop(key, None) or {}).items():
                defs[f"t{i}_{name}"] = _renamed(schema, i)
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, "arguments": _renamed(parameters, i)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    # Separators as `json.dumps` writes them (and so the templates): flexible whitespace would let
    # a small model pad a call with blanks until its token limit.
    guidance = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return {"anyOf": variants, **({"$defs": defs} if defs else {}), "x-guidance": guidance}


def _renamed(schema: Any, i: int) -> Any:
    """`schema` with its local `$ref`s pointing at tool `i`'s definitions at the root."""
    if isinstance(schema, list):
        return [_renamed(s, i) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _renamed(v, i) for k, v in schema.items()}
    ref = out.get("$ref")
    for prefix in ("#/$defs/", "#/definitions/"):
        if isinstance(ref, str) and ref.startswith(prefix):
            out["$ref"] = f"#/$defs/t{i}_{ref[len(prefix) :]}"
    return out


def call_lark(tools: list[ToolSchema], end: str, loose: frozenset[str] = frozenset()) -> str:
    """The grammar of what follows the call-start marker: the body, then the end marker."""
    close = end if end.startswith("<") else json.dumps(end)  # a special token is named as itself in lark
    return f'start: "\\n"? body "\\n"? {close}\nbody: %json {json.dumps(call_schema(tools, loose))}\n'


class Grammars:
    """The host's grammar cache: llguidance's view of the tokenizer and a matcher per tool set.

    Args:
        tokenizer: mlx-lm's `TokenizerWrapper` (the fast tokenizer is its `_tokenizer`).
        start, end: the call markers of the Hermes format.
    """

    def __init__(self, tokenizer: Any, start: str, end: str) -> None:
        self._tokenizer = tokenizer
        self.start, self.end = start, end
        self._ll: Any = None
        self._matchers: dict[str, Any] = {}
        self.start_ids = tuple(tokenizer.encode(start, add_special_tokens=False))
        self.think = (
            (tuple(tokenizer.think_start_tokens), tuple(tokenizer.think_end_tokens))
            if getattr(tokenizer, "has_thinking", False)
            else None
        )

    def matcher(self, tools: list[ToolSchema]) -> Any | None:
        """A fresh matcher for a call to one of `tools`. A tool whose schema llguidance cannot express
        gets one warning and any object as its arguments (its name stays constrained); None where
        even that fails, and the calls are decoded freely."""
        import llguidance
        import llguidance.hf

        key = json.dumps(tools, sort_keys=True)
        if key not in self._matchers:
            if self._ll is None:
                self._ll = llguidance.hf.from_tokenizer(getattr(self._tokenizer, "_tokenizer", self._tokenizer))
            loose = frozenset(t.get("function", t)["name"] for t in tools if self._compile([t]).is_error())
            for name in sorted(loose):
                log.warning("calls to %s are decoded without a grammar: its schema cannot be expressed", name)
            matcher = self._compile(tools, loose)
            self._matchers[key] = None if matcher.is_error() else matcher
        proto = self._matchers[key]
        return proto.deep_copy() if proto is not None else None

    def _compile(self, tools: list[ToolSchema], loose: frozenset[str] = frozenset()) -> Any:
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_lark(call_lark(tools, self.end, loose))
        return llguidance.LLMatcher(self._ll, grammar, log_level=0)

    def processor(self, tools: list[ToolSchema] | None, opened: bool) -> CallGrammar | None:
        """The processor for one request offering `tools`; None with no tools or no expressible grammar.

        `opened`: the prompt ended inside a thought."""
        if not tools or not self.start_ids:
            return None
        matcher = self.matcher(tools)
        if matcher is None:
            return None
        return CallGrammar(matcher, self._ll.vocab_size, self.start_ids, self.think, opened)


class CallGrammar:
    """Constrains each call of one reply to its grammar; serves one request (like every processor).

    Both decode paths pass the context plus the tokens generated so far, so the first call
    sees the prompt and each later call one new token (several are taken in order). A token
    the grammar rejects (another processor forced it) ends the constraint for this reply:
    the call is parsed, and reported, as written.
    """

    def __init__(
        self,
        matcher: Any,
        vocab_size: int,
        start_ids: Sequence[int],
        think: tuple[tuple[int, ...], tuple[int, ...]] | None,
        opened: bool,
    ) -> None:
        self._proto = matcher
        self.vocab_size = vocab_size
        self._matcher: Any = None  # a copy of the prototype while a call is being written
        self.start_ids = tuple(start_ids)
        self.think = think
        self.thinking = opened and think is not None
        self.n_constrained = 0  # calls constrained so far
        self.broken = False
        self._recent: list[int] = []
        self._seen: int | None = None

    def __call__(self, tokens: mx.array | Sequence[int], logits: mx.array) -> mx.array:
        n = len(tokens)
        if self._seen is None:
            self._seen = n
        if n > self._seen:
            new = tokens[self._seen : n]
            for token in new.tolist() if hasattr(new, "tolist") else list(new):
                self._feed(int(token))
            self._seen = n
        if self._matcher is None or self.broken:
            return logits
        return self._mask(logits)

    def _feed(self, token: int) -> None:
        if self.broken:
            return
        if self._matcher is not None:
            if not self._matcher.consume_token(token):
                self.broken, self._matcher = True, None
            elif self._matcher.is_stopped():
                self._matcher = None  # the call is closed: free again
            return
        self._recent = [*self._recent, token][-16:]
        if self.think is not None:
            start, end = self.think
            if self.thinking and _ends_with(self._recent, end):
                self.thinking = False
            elif not self.thinking and _ends_with(self._recent, start):
                self.thinking = True
        if not self.thinking and _ends_with(self._recent, self.start_ids):
            self._matcher = self._proto.deep_copy()
            self.n_constrained += 1

    def _mask(self, logits: mx.array) -> mx.array:
        import llguidance.numpy as llnp
        import mlx.core as mx
        import numpy as np

        vocab = logits.shape[-1]
        bitmask = llnp.allocate_token_bitmask(1, self.vocab_size)
        llnp.fill_next_token_bitmask(self._matcher, bitmask)
        allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        if allowed.size < vocab:  # padding rows of the embedding are never tokens
            allowed = np.concatenate([allowed, np.zeros(vocab - allowed.size, dtype=bool)])
        masked = mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))
        # Where an earlier processor left only tokens the grammar rejects (forcing a script), theirs
        # win: the reply goes on as forced and the grammar lets go at that token. On the device: no sync.
        return mx.where(mx.any(masked > -mx.inf), masked, logits)


def _ends_with(ids: list[int], marker: tuple[int, ...]) -> bool:
    return bool(marker) and tuple(ids[-len(marker) :]) == marker
