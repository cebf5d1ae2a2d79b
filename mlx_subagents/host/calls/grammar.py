"""Grammars: a reply that starts a call ends as a well-formed call to a known tool, and an answer
that must follow a schema does.

One logits processor per request (`Constrainer`), built from what the host knows: the model's
call format (its module in `formats/` gives the rules: Hermes `<tool_call>` JSON, which prompted
models are taught too; Qwen3-Coder's `<function=...>` XML; Mistral's `[TOOL_CALLS]`), the session's
tools with their JSON schemas, and the answer's schema (`--schema`, `output_schema`). This module
keeps the two halves apart: `Grammars` compiles each grammar once per host (the cache), and
`Constrainer` (`constrainer.py`) holds one request to a copy of its matcher. Its trigger starts an llguidance matcher:

- calls: the call-start marker, outside a thought. Free text before it stays free; the call then
  names one of the tools, with arguments its schema accepts, and ends; free again after the end
  marker, so several calls stay possible.
- an answer: the reply's start (after the thought, for a thinking model). The reply is then the
  JSON answer, or (with tools) calls and nothing else.

The llguidance tokenizer (about a second to build on a real vocabulary) and each compiled grammar
are cached per host; a request gets a copy of the matcher (`constrainer.py`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ..protocol import ToolSchema
from .call_schema import GUIDANCE, closed, function_of
from .closing import Closers
from .constrainer import Constrainer, Prototype
from .formats import CallSyntax, Markers, call_syntax

log = logging.getLogger(__name__)


def call_lark(
    syntax: CallSyntax, markers: Markers, tools: list[ToolSchema], loose: frozenset[str] = frozenset()
) -> str:
    """The grammar of what follows the call-start marker, in the format's own rules."""
    return "start: body\n" + syntax.body_rules(markers, tools, loose)


def answer_lark(
    syntax: CallSyntax,
    markers: Markers,
    schema: dict[str, Any] | None,
    tools: list[ToolSchema] | None,
    loose: frozenset[str] = frozenset(),
) -> str:
    """The grammar of a whole reply that must be the answer: the JSON answer or, with tools, calls; with
    no schema, calls only (a reply that must call a tool)."""
    answer = "" if schema is None else f"answer: %json {json.dumps({**closed(schema), 'x-guidance': GUIDANCE})}\n"
    if not tools:
        return "start: answer\n" + answer
    calls = f"{markers.start} body" + ("" if not markers.end else f' ("\\n"? {markers.start} body)*')
    start = "calls" if schema is None else "answer | calls"
    return f"start: {start}\ncalls: {calls}\n" + answer + syntax.body_rules(markers, tools, loose)


class Grammars:
    """The host's grammar cache: llguidance's view of the tokenizer and a matcher per grammar.

    Args:
        tokenizer: mlx-lm's `TokenizerWrapper` (the fast tokenizer is its `_tokenizer`).
        kind, start, end: the model's call format (its name in `formats/`) and its markers.
    """

    def __init__(self, tokenizer: Any, kind: str, start: str, end: str) -> None:
        self._tokenizer = tokenizer
        self._ll: Any = None
        self._compiled: dict[str, Prototype | None] = {}
        self._tools: dict[str, bool] = {}  # per tool: whether its call can be expressed (`_expressible`)
        self.syntax = call_syntax(kind)
        self.start_ids = tuple(tokenizer.encode(start, add_special_tokens=False))
        self.markers = Markers(self._term(start), self._term(end) if end else "", self._term)
        self.eos = tuple(tokenizer.eos_token_ids)
        end_ids = tuple(tokenizer.encode(end, add_special_tokens=False)) if end else ()
        self.closers = Closers(tokenizer, self.eos + (end_ids if len(end_ids) == 1 else ()))
        self.think = (
            (tuple(tokenizer.think_start_tokens), tuple(tokenizer.think_end_tokens))
            if getattr(tokenizer, "has_thinking", False)
            else None
        )

    def _term(self, text: str) -> str:
        """`text` as a lark term: a special token as itself (`<[id]>`), other text quoted."""
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
        special = set(getattr(hf, "all_special_ids", ())) | set(getattr(hf, "added_tokens_decoder", {}) or {})
        return f"<[{ids[0]}]>" if len(ids) == 1 and ids[0] in special else json.dumps(text)

    def processor(
        self,
        tools: list[ToolSchema] | None,
        answer_schema: dict[str, Any] | None,
        opened: bool,
        thinks: bool = True,
        *,
        require_call: bool = False,
    ) -> Constrainer | None:
        """The processor for one request; None with nothing to constrain (or nothing expressible).

        `opened`: the prompt ended inside a thought; `thinks`: the reply may think (a model that
        does not, though its vocabulary has the markers, gets no thought watched); `require_call`: the
        reply is calls to `tools`, held from its start (after a thought) as an answer would be."""
        tools = tools or None
        answer = None
        if require_call and tools:
            answer = self._prototype("required", tools, None)
        elif answer_schema is not None:
            answer = self._prototype("answer", tools, answer_schema)
        calls = self._prototype("calls", tools, None) if tools and self.start_ids else None
        if answer is None and calls is None:
            return None
        ends = not self.markers.end
        think = self.think if thinks or opened else None
        return Constrainer(answer, calls, self.start_ids, think, self.eos, opened, ends, self.closers)

    def calls(self, tools: list[ToolSchema]) -> Prototype | None:
        """The compiled grammar of a call to one of `tools` (what `subagent doctor` probes)."""
        return self._prototype("calls", tools, None)

    def _prototype(self, mode: str, tools: list[ToolSchema] | None, schema: dict[str, Any] | None) -> Prototype | None:
        """The compiled matcher of one grammar, compiled once. A tool whose schema llguidance cannot
        express gets one warning and any object as its arguments (its name stays constrained); an
        answer schema it cannot express, one warning and a free answer."""
        import llguidance
        import llguidance.hf

        key = json.dumps([mode, tools, schema], sort_keys=True)
        if key in self._compiled:
            return self._compiled[key]
        if self._ll is None:
            hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
            self._ll = llguidance.hf.from_tokenizer(hf)
        loose = frozenset(function_of(t)["name"] for t in tools or () if not self._expressible(t))
        if mode in ("answer", "required"):
            matcher = self._compile(answer_lark(self.syntax, self.markers, schema, tools, loose))
            if matcher.is_error():
                log.warning("the answer is decoded without a grammar: its schema cannot be expressed")
        else:
            matcher = self._compile(call_lark(self.syntax, self.markers, tools or [], loose))
        self._compiled[key] = None if matcher.is_error() else Prototype(matcher, self._ll.vocab_size, self.eos)
        return self._compiled[key]

    def _expressible(self, tool: ToolSchema) -> bool:
        """Whether llguidance can express `tool`'s call, tried once per tool (its one warning if not),
        whichever grammars the tool is then part of."""
        key = json.dumps(tool, sort_keys=True)
        if key not in self._tools:
            self._tools[key] = not self._compile(call_lark(self.syntax, self.markers, [tool])).is_error()
            if not self._tools[key]:
                name = function_of(tool)["name"]
                log.warning("calls to %s are decoded without a grammar: its schema cannot be expressed", name)
        return self._tools[key]

    def _compile(self, lark: str) -> Any:
        import llguidance

        return llguidance.LLMatcher(self._ll, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
