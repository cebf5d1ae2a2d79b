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

A client's schemas (the endpoints' requests: `Request.client_schemas`) are held to tighter limits of
llguidance's (`REQUEST_LIMITS`) than the agents' own, and checked before the turn is admitted, off the mlx
thread (`check`): one the grammar cannot hold within them is refused (`GrammarError`), never loosened.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from ...errors import GrammarError
from ...recent import Recent
from ..protocol import ToolSchema
from .call_schema import GUIDANCE, closed, function_of
from .closing import Closers
from .constrainer import SIMPLER, Constrainer, Prototype, guidance_error
from .formats import CallSyntax, Markers, call_syntax

log = logging.getLogger(__name__)
# llguidance's limits for a grammar of a client's schemas, tighter than its defaults (which the agents' own
# grammars keep): a lexeme is built lazily, at the mask step that first reaches it, so a pattern such as
# `^a{1000000}$` cost one mask step 1.6 s of the tiny model's vocabulary, and `^((a{100}){100}){100}$`
# 4.8-7.6 s, at the defaults, before llguidance gave up. `initial_lexer_fuel` bounds the expressions a
# lexeme builds (those steps: 0.1-0.3 s at 50,000; a 42-tool grammar, 17 tools shaped as Claude Code's,
# an enum of 1,000 values compile within it, one of 5,000 does not); the rest bound a mask step's lexer and
# parser work, the lexer's states (1-2 kB each), the grammar's size and one alternation's width.
REQUEST_LIMITS = {
    "initial_lexer_fuel": 50_000,
    "step_lexer_fuel": 50_000,
    "step_max_items": 20_000,
    "max_lexer_states": 50_000,
    "max_grammar_size": 100_000,
    "max_items_in_row": 500,
    "verbose_errors": False,
}
# Compiled grammars a host keeps: a client may send new schemas with every request.
MAX_COMPILED = 256


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
        self._compiled: Recent[str, Prototype | str] = Recent(MAX_COMPILED)  # a grammar, or why it failed
        self._tools: Recent[str, bool] = Recent(MAX_COMPILED)  # per tool: whether its call can be expressed
        self._lock = threading.Lock()  # the caches (`check` runs off the mlx thread); never held while compiling
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
        client: bool = False,
    ) -> Constrainer | None:
        """The processor for one request; None with nothing to constrain (or nothing expressible).

        `opened`: the prompt ended inside a thought; `thinks`: the reply may think (a model that
        does not, though its vocabulary has the markers, gets no thought watched); `require_call`: the
        reply is calls to `tools`, held from its start (after a thought) as an answer would be;
        `client`: the schemas are a client's (`REQUEST_LIMITS`, passed `check`)."""
        tools = tools or None
        answer = None
        if require_call and tools:
            answer = self._prototype("required", tools, None, client)
        elif answer_schema is not None:
            answer = self._prototype("answer", tools, answer_schema, client)
        calls = self._prototype("calls", tools, None, client) if tools and self.start_ids else None
        if answer is None and calls is None:
            return None
        ends = not self.markers.end
        think = self.think if thinks or opened else None
        held = Constrainer(answer, calls, self.start_ids, think, self.eos, opened, ends, self.closers)
        names = [function_of(t)["name"] for t in tools or ()]
        held.parts["calls"] = ("tool", names[0]) if len(names) == 1 else ("tools", None)
        held.parts["answer"] = held.parts["calls"] if answer_schema is None or require_call else ("answer", None)
        return held

    def calls(self, tools: list[ToolSchema]) -> Prototype | None:
        """The compiled grammar of a call to one of `tools` (what `subagent doctor` probes)."""
        return self._prototype("calls", tools, None)

    def check(self, tools: list[ToolSchema] | None, answer_schema: dict[str, Any] | None, require_call: bool) -> None:
        """Build a client's grammars under `REQUEST_LIMITS` before its turn is admitted (off the mlx thread):
        each tool's alone and the answer's alone, so that a refusal names its part, then those `processor`
        uses, each walked along its structure (`Prototype.walked`: a lexeme is built where a mask first
        reaches it, so the schema's first values are built here, not mid-reply). What fails is a
        `GrammarError`; the grammars that pass are cached for `processor`. A tool llguidance cannot express
        at all (a keyword it does not implement) is loosened as an agent's is, OpenAI's non-strict tools'
        way; an answer's schema is refused, as a strict one is."""
        tools = tools or None
        for tool in tools or ():
            name = function_of(tool)["name"]
            self._held("tool", ("calls", [tool], None), f"calls to {name!r} cannot be held to its parameters", name)
        if answer_schema is not None:
            self._held("answer", ("answer", None, answer_schema), "the answer cannot be held to this schema")
        if require_call and tools:
            self._held("tools", ("required", tools, None), "a reply of calls to these tools cannot be held")
        elif answer_schema is not None and tools:
            self._held("answer", ("answer", tools, answer_schema), "an answer or calls to these tools cannot be held")
        if tools and self.start_ids:
            self._held("tools", ("calls", tools, None), "calls to these tools together cannot be held")

    def _held(self, part: str, grammar: tuple[str, Any, Any], what: str, tool: str | None = None) -> None:
        built = self._built(*grammar, client=True)
        reason = built if isinstance(built, str) else built.walked(self._guidance())
        if reason:
            fix = "send it without those keys" if "Unimplemented keys" in reason else SIMPLER
            raise GrammarError(f"{what} by the grammar ({reason}); {fix}", part, tool)

    def _prototype(
        self, mode: str, tools: list[ToolSchema] | None, schema: dict[str, Any] | None, client: bool = False
    ) -> Prototype | None:
        """The compiled matcher of one grammar (None: it failed). A tool of the agents' own whose schema
        llguidance cannot express gets one warning and any object as its arguments (its name stays
        constrained); an answer schema it cannot express, one warning and a free answer."""
        built = self._built(mode, tools, schema, client=client)
        return None if isinstance(built, str) else built

    def _built(
        self, mode: str, tools: list[ToolSchema] | None, schema: dict[str, Any] | None, *, client: bool
    ) -> Prototype | str:
        """One grammar compiled once (the `MAX_COMPILED` used last kept), or why llguidance refused it."""
        key = json.dumps([mode, tools, schema, client], sort_keys=True)
        with self._lock:
            known = self._compiled.get(key)
        if known is not None:
            return known
        ll = self._guidance()
        # A client's grammar is tried whole first: which tools cannot be expressed at all is asked (a compile
        # of each) only when it fails (an agent's tools are asked at once, each once).
        matcher = None if not client else self._compile_mode(mode, tools, schema, frozenset(), client)
        if matcher is None or matcher.is_error():
            loose = frozenset(function_of(t)["name"] for t in tools or () if not self._expressible(t))
            if matcher is None or loose:
                matcher = self._compile_mode(mode, tools, schema, loose, client)
        built = (
            guidance_error(matcher.get_error()) if matcher.is_error() else Prototype(matcher, ll.vocab_size, self.eos)
        )
        if isinstance(built, str) and mode in ("answer", "required") and not client:
            log.warning("the answer is decoded without a grammar: its schema cannot be expressed")
        with self._lock:
            self._compiled.put(key, built)
        return built

    def _compile_mode(
        self,
        mode: str,
        tools: list[ToolSchema] | None,
        schema: dict[str, Any] | None,
        loose: frozenset[str],
        client: bool,
    ) -> Any:
        if mode in ("answer", "required"):
            return self._compile(answer_lark(self.syntax, self.markers, schema, tools, loose), client)
        return self._compile(call_lark(self.syntax, self.markers, tools or [], loose), client)

    def _guidance(self) -> Any:
        """llguidance's view of the tokenizer, made at the first grammar."""
        import llguidance.hf

        if self._ll is None:
            hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
            self._ll = llguidance.hf.from_tokenizer(hf)
        return self._ll

    def _expressible(self, tool: ToolSchema) -> bool:
        """Whether llguidance can express `tool`'s call, tried once per tool (its one warning if not),
        whichever grammars the tool is then part of."""
        key = json.dumps(tool, sort_keys=True)
        with self._lock:
            known = self._tools.get(key)
        if known is not None:
            return known
        expressible = not self._compile(call_lark(self.syntax, self.markers, [tool])).is_error()
        if not expressible:
            name = function_of(tool)["name"]
            log.warning("calls to %s are decoded without a grammar: its schema cannot be expressed", name)
        with self._lock:
            self._tools.put(key, expressible)
        return expressible

    def _compile(self, lark: str, client: bool = False) -> Any:
        import llguidance

        limits = llguidance.LLParserLimits(**REQUEST_LIMITS) if client else None
        return llguidance.LLMatcher(
            self._guidance(), llguidance.LLMatcher.grammar_from_lark(lark), log_level=0, limits=limits
        )
