"""A client's schemas (the endpoints' requests, `client_schemas`) on the tiny model, through the real
mlx-lm path: a grammar the host cannot hold within the tighter limits of a request's is refused before
the turn is admitted, naming its part; an agent's own schema keeps llguidance's defaults; and a grammar
that fails mid-reply ends its turn, and only its turn, with its error, never unconstrained."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.errors import GrammarError
from mlx_subagents.host import GenerateArgs, MlxModelHost
from mlx_subagents.testing import ForcedPrefix as Prefix
from tests.host.test_mlx_host import TASK

SIMPLER = "send a simpler schema (smaller counted repetitions in patterns, fewer alternatives or values, less nesting)"
# Built lazily by llguidance's lexer, where a mask first reaches it: 1.6 s of a mask step at its defaults.
HOSTILE = {"type": "string", "pattern": "^a{1000000}$"}
VALUES = [f"value-{i}" for i in range(5000)]


def obj(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def test_a_clients_schema_past_the_request_limits_is_refused_before_its_turn_and_an_agents_is_held(
    tiny_qwen3_path: Path,
) -> None:
    """The answer's schema, a tool's parameters (walked along the call's structure to the pattern) and an
    enum of 5,000 values, each refused in one line naming its part, with nothing prefilled; the same enum
    in an agent's own answer schema is held by the grammar at llguidance's defaults."""
    tool = {"type": "function", "function": {"name": "f", "parameters": obj(v=HOSTILE)}}
    asked = [
        ({"answer_schema": HOSTILE}, None),
        ({"tool_choice": "required"}, [tool]),
        ({"answer_schema": obj(v={"enum": VALUES})}, None),
    ]

    async def go() -> tuple[list[GrammarError], int, Any]:
        async with MlxModelHost(str(tiny_qwen3_path)) as host:
            session, refused = host.session("client"), []
            for args, tools in asked:
                with pytest.raises(GrammarError) as error:
                    await session.generate(TASK, GenerateArgs(max_tokens=8, client_schemas=True, **args), tools=tools)
                refused.append(error.value)
            own = GenerateArgs(max_tokens=40, answer_schema=obj(v={"enum": VALUES}))
            return refused, session.held_tokens, await host.session("agent").generate(TASK, own)

    refused, held, agents = asyncio.run(go())
    expressions = "lexer error: too many expressions constructed"
    assert [(str(e), e.part, e.tool) for e in refused] == [
        (f"the answer cannot be held to this schema by the grammar ({expressions}); {SIMPLER}", "answer", None),
        (f"calls to 'f' cannot be held to its parameters by the grammar ({expressions}); {SIMPLER}", "tool", "f"),
        (
            "the answer cannot be held to this schema by the grammar (failed to compile JSON schema: initial lexer "
            f"configuration (grammar) too big (limit for this grammar: 50000)); {SIMPLER}",
            "answer",
            None,
        ),
    ]
    assert held == 0  # refused before admission: nothing prefilled, nothing held
    assert agents.constrained == "answer" and json.loads(agents.text)["v"] in VALUES


def test_a_grammar_that_fails_mid_reply_ends_only_its_turn_with_its_error(
    tiny_qwen3_path: Path, tiny_qwen3: Any
) -> None:
    """The pattern comes after a free string, past where the check walks: the reply is forced into it, and
    the grammar fails on a token it allowed. That turn ends with the grammar's error (not as free text that
    looks like a valid answer), in the batch and alone; the turn decoding beside it ends as it does alone;
    and the same schemas asked again are refused before their turn."""

    def held(count: int) -> GenerateArgs:
        late = obj(a={"type": "string"}, b={"type": "string", "pattern": f"^((a{{100}}){{100}}){{{count}}}$"})
        return GenerateArgs(max_tokens=24, answer_schema=late, client_schemas=True)

    start = tiny_qwen3[1].encode('{"a": "x", "b": "aaaa', add_special_tokens=False)

    async def go() -> tuple[list[Any], Any, list[GrammarError]]:
        factory = lambda name, ids: [Prefix(start)] if name.startswith("held") else []  # noqa: E731
        async with MlxModelHost(str(tiny_qwen3_path), processor_factory=factory) as host:
            free = GenerateArgs(max_tokens=24)
            batched = host.session("held").generate(TASK, held(100)), host.session("free").generate(TASK, free)
            together = list(await asyncio.gather(*batched, return_exceptions=True))
            alone, failed = await host.session("free-alone").generate(TASK, free), []
            for name, count in (("held-alone", 99), ("held-again", 100)):
                with pytest.raises(GrammarError) as error:
                    await host.session(name).generate(TASK, held(count))
                failed.append(error.value)
            return together, alone, failed

    (batched, beside), alone, [single, again] = asyncio.run(go())
    expressions = "lexer error: too many expressions constructed"
    message = f"the grammar holding the reply to the answer's schema failed at its token 7 ({expressions}); {SIMPLER}"
    assert isinstance(batched, GrammarError) and (str(batched), batched.part, batched.tool) == (message, "answer", None)
    assert str(single) == message
    assert (beside.text, beside.usage.generated_tokens) == (alone.text, 24)
    assert str(again) == f"the answer cannot be held to this schema by the grammar ({expressions}); {SIMPLER}"


def test_the_compiled_grammars_kept_are_bounded(tiny_qwen3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client may send a new schema with every request: the host keeps the grammars it used last, up to
    `MAX_COMPILED`, and compiles an older one again when it comes back."""
    from mlx_subagents.host.calls import grammar

    monkeypatch.setattr(grammar, "MAX_COMPILED", 3)
    grammars = grammar.Grammars(tiny_qwen3[1], "json", "<tool_call>", "</tool_call>")
    schemas = [obj(**{f"k{i}": {"type": "integer"}}) for i in range(5)]
    for schema in schemas:
        grammars.check(None, schema, False)
    assert len(grammars._compiled) == 3
    assert grammars.processor(None, schemas[0], False, client=True) is not None  # compiled again
    assert len(grammars._compiled) == 3


def test_a_clients_tool_with_a_keyword_llguidance_does_not_implement_is_loosened_as_an_agents(
    tiny_qwen3: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """`uniqueItems` (common in MCP tools' schemas) is no keyword of llguidance's: a client's tool with it
    has any object as its arguments, with the agents' one warning, and the request goes on (OpenAI's
    non-strict tools take any schema); an answer's schema with it is refused, as a strict one is."""
    from mlx_subagents.host.calls.grammar import Grammars

    tags = obj(tags={"type": "array", "items": {"type": "string"}, "uniqueItems": True})
    tool = {"type": "function", "function": {"name": "tag", "parameters": tags}}
    grammars = Grammars(tiny_qwen3[1], "json", "<tool_call>", "</tool_call>")
    grammars.check([tool], None, True)
    held = grammars.processor([tool], None, False, require_call=True, client=True)
    assert held is not None and held.parts == {"calls": ("tool", "tag"), "answer": ("tool", "tag")}
    warnings = [r.getMessage() for r in caplog.records if r.name == "mlx_subagents.host.calls.grammar"]
    assert warnings == ["calls to tag are decoded without a grammar: its schema cannot be expressed"]
    with pytest.raises(GrammarError) as refused:
        grammars.check(None, tags, False)
    assert str(refused.value) == (
        "the answer cannot be held to this schema by the grammar (failed to compile JSON schema: Unimplemented keys: "
        '["uniqueItems"]); send it without those keys'
    )
