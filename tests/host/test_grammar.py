"""Tool-call grammars on the tiny random model, through the real mlx-lm path: a call the model starts
ends as a well-formed call to one of its tools, with arguments that tool's schema accepts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema
import mlx.core as mx
import pytest

from mlx_subagents.errors import SubagentError
from mlx_subagents.host import GenerateArgs, MlxModelHost
from mlx_subagents.host.protocol import ToolCall
from mlx_subagents.testing import ForcedPrefix as Prefix
from mlx_subagents.testing import ForcedScripts, make_tiny_model, tool_call_text
from tests.host.test_mlx_host import TASK

READ = {
    "type": "function",
    "function": {
        "name": "read",
        "description": "Read a file.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string", "enum": ["src/app.py", "README.md"]}},
            "required": ["path"],
            "additionalProperties": False,
        },
    },
}
FIND = {
    "type": "function",
    "function": {
        "name": "find",
        "description": "Find files.",
        "parameters": {
            "type": "object",
            "properties": {
                "kind": {"$ref": "#/$defs/kind"},
                "deep": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
            },
            "required": ["kind", "deep"],
            "additionalProperties": False,
            "$defs": {"kind": {"enum": ["file", "dir"]}},
        },
    },
}
TOOLS = [READ, FIND]
LIST = {
    "type": "function",
    "function": {
        "name": "list",
        "description": "List a folder.",
        "parameters": {
            "type": "object",
            "properties": {"kind": {"$ref": "#/$defs/kind"}, "depth": {"type": "integer", "minimum": 0, "maximum": 3}},
            "required": ["kind", "depth"],
            "$defs": {"kind": {"enum": ["file", "dir"]}},
        },
    },
}


def reply_with(path: Path, factory: Any, grammar: bool, tools: list[Any] = TOOLS) -> Any:
    async def go() -> Any:
        async with MlxModelHost(str(path), processor_factory=factory) as host:
            return await host.session("a").generate(TASK, GenerateArgs(max_tokens=48, grammar=grammar), tools=tools)

    return asyncio.run(go())


@pytest.fixture(scope="module")
def prompted_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with SmolLM2's ChatML, which drops tools: the prompted mode, taught Hermes calls."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-prompted"), template="no_tools")


@pytest.mark.parametrize("mode", ["native", "prompted"])
def test_noise_after_a_forced_call_start_becomes_a_valid_call_to_a_known_tool(
    tiny_qwen3_path: Path, tiny_qwen3: Any, prompted_path: Path, mode: str
) -> None:
    start = tiny_qwen3[1].encode("Looking.<tool_call>", add_special_tokens=False)
    path = tiny_qwen3_path if mode == "native" else prompted_path

    def factory(name: str, ids: Any) -> list[Any]:
        return [Prefix(start)]

    free = reply_with(path, factory, grammar=False)
    assert free.tool_calls == [] and len(free.malformed_tool_calls) == 1  # noise: no call survives
    constrained = reply_with(path, factory, grammar=True)
    assert constrained.malformed_tool_calls == []
    assert constrained.tool_calls == [ToolCall("read", {"path": "README.md"}, "call_0")]
    jsonschema.validate(constrained.tool_calls[0].arguments, READ["function"]["parameters"])


def test_forced_valid_and_malformed_calls_decode_the_same_with_the_grammar_on_and_off(
    tiny_qwen3_path: Path, tiny_qwen3: Any
) -> None:
    good = "Reading." + tool_call_text("read", {"path": "README.md"})
    bad = '<tool_call>\n{"name": "rea'  # forced past the grammar: it lets go, the call is reported as written
    replies = {}
    for grammar in (False, True):
        scripts = ForcedScripts(tiny_qwen3[1], {"a": [good, bad]})
        replies[grammar] = [reply_with(tiny_qwen3_path, scripts, grammar) for _ in range(2)]
    assert [r.raw_text for r in replies[True]] == [r.raw_text for r in replies[False]] == [good, bad]
    assert [len(r.malformed_tool_calls) for r in replies[True]] == [0, 1]


def test_an_inexpressible_schema_warns_once_and_the_run_goes_on(
    tiny_qwen3_path: Path, tiny_qwen3: Any, caplog: Any
) -> None:
    odd = {"type": "function", "function": {"name": "odd", "parameters": {"$ref": "#/nowhere"}}}
    scripts = ForcedScripts(tiny_qwen3[1], {"a": [tool_call_text("read", {"path": "src/app.py"})]})
    reply = reply_with(tiny_qwen3_path, scripts, grammar=True, tools=[READ, odd])
    assert [c.name for c in reply.tool_calls] == ["read"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "mlx_subagents.host.calls.grammar"]
    assert warnings == ["calls to odd are decoded without a grammar: its schema cannot be expressed"]


def test_grammar_off_in_the_agent_file_is_honoured_and_the_run_option_wins(tmp_path: Path) -> None:
    from mlx_subagents.agents.discovery import AgentCatalog
    from mlx_subagents.agents.spec import parse_agent_file
    from mlx_subagents.errors import AgentFileError
    from mlx_subagents.runs.options import RunOptions
    from mlx_subagents.runs.prepare import Preparer

    def agent(value: str) -> Path:
        path = tmp_path / f"g{len(list(tmp_path.iterdir()))}.md"
        path.write_text(f"---\nname: g\ndescription: Tests.\ngrammar: {value}\n---\n\nBody.\n", encoding="utf-8")
        return path

    off, on = parse_agent_file(agent("off"), "project"), parse_agent_file(agent("on"), "project")
    assert (off.grammar, on.grammar) == (False, True)
    with pytest.raises(AgentFileError) as bad:
        parse_agent_file(agent("maybe"), "project")
    assert str(bad.value).endswith("field 'grammar' must be on or off, got 'maybe'; e.g. grammar: off")

    def limits(options: RunOptions) -> bool:
        return Preparer(options, AgentCatalog()).limits(off).grammar

    assert [limits(RunOptions()), limits(RunOptions(grammar=True)), limits(RunOptions(grammar=False))] == [
        False,
        True,
        False,
    ]


class InFlight:
    """The token still being computed: compared on the device only; `.item()` (a host sync) is counted."""

    def __init__(self, value: int, reads: list[int]) -> None:
        self.value, self.reads = value, reads

    def __eq__(self, other: object) -> Any:  # type: ignore[override]
        return mx.array(self.value) == other

    def item(self) -> int:
        self.reads.append(self.value)
        return self.value


class Context:
    """A decode path's context: the prompt and the tokens the host has read, then the one in flight."""

    def __init__(self, prompt: int, known: list[int], flight: InFlight | None) -> None:
        self.prompt, self.known, self.flight = prompt, known, flight

    def __len__(self) -> int:
        return self.prompt + len(self.known) + (self.flight is not None)

    def __getitem__(self, i: int) -> Any:
        assert i == -1 and self.flight is not None, "only the token in flight may be read from the context"
        return self.flight


def drive(processor: Any, ids: Sequence[int], vocab: int, seed: int = 0, steps: int = 96) -> list[int]:
    """Decode like a pipelined path, on random logits: forced `ids` first, then the argmax of noise
    under the processor; returns the tokens. Reads of the in-flight token are in `processor.reads`."""
    rng, tokens, reads = mx.random.key(seed), [], []
    processor.known, processor.reads = tokens, reads
    for step in range(steps):
        flight = InFlight(tokens[-1], reads) if tokens else None
        known = tokens[:-1] if tokens else []
        processor.known = known
        logits = mx.random.normal((1, vocab), key=mx.random.split(rng, steps)[step])
        out = processor(Context(10, known, flight), logits)
        token = ids[step] if step < len(ids) else int(mx.argmax(out, axis=-1).item())
        if token in processor.eos:
            break
        tokens.append(token)
    return tokens


def test_free_text_reads_no_token_in_flight_and_a_call_reads_each_of_its_own(tiny_qwen3: Any) -> None:
    from mlx_subagents.host.calls.grammar import Grammars

    tokenizer = tiny_qwen3[1]
    grammars = Grammars(tokenizer, "json", "<tool_call>", "</tool_call>")
    text = tokenizer.encode("Let me look at the files first, then answer.", add_special_tokens=False)
    start = tokenizer.encode("<tool_call>", add_special_tokens=False)
    processor = grammars.processor([READ], None, False)
    tokens = drive(processor, [*text, *start], len(tokenizer.vocab))
    written = tokenizer.decode(tokens)
    assert written.startswith("Let me look at the files first, then answer.<tool_call>")
    call = written.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0]
    assert json.loads(call) == {"name": "read", "arguments": {"path": json.loads(call)["arguments"]["path"]}}
    # The free text, and the marker, were never read on the host; each token of the call was.
    n_free = len(text) + len(start)
    assert processor.reads == tokens[n_free : len(processor.reads) + n_free] and processor.reads
    assert processor.engaged == "calls"


@pytest.mark.parametrize(
    ("kind", "start", "end", "parse", "names"),
    [
        ("json", "<tool_call>", "</tool_call>", "json_tools", ["find"]),  # `$ref`, `anyOf`, an enum
        # mlx-lm's XML parser reads an `anyOf` value as text: no `find` there
        ("xml", "<tool_call>", "</tool_call>", "qwen3_coder", ["read", "list"]),
        ("mistral", "[TOOL_CALLS]", "", "mistral", ["read", "list", "find"]),
    ],
)
def test_noise_becomes_a_valid_call_in_each_format(
    tiny_qwen3: Any, kind: str, start: str, end: str, parse: str, names: list[str]
) -> None:
    import importlib

    from mlx_subagents.host.calls.grammar import Grammars

    tokenizer = tiny_qwen3[1]
    parser = importlib.import_module(f"mlx_lm.tool_parsers.{parse}").parse_tool_call
    grammars = Grammars(tokenizer, kind, start, end)  # type: ignore[arg-type]
    every = {"read": READ, "list": LIST, "find": FIND}
    tools = [every[name] for name in names]
    for seed in range(3):
        processor = grammars.processor(tools, None, False)
        marker = tokenizer.encode(start, add_special_tokens=False)
        written = tokenizer.decode(drive(processor, marker, len(tokenizer.vocab), seed=seed, steps=160))
        body = written.split(start, 1)[1]
        body = body.split(end, 1)[0] if end else body
        parsed = parser(body, tools)
        call = parsed[0] if isinstance(parsed, list) else parsed
        schema = every[call["name"]]["function"]["parameters"]
        jsonschema.validate(call["arguments"], schema)


# A call to `read`, one whose path is not in its enum, one to a tool the grammar was not given.
GRAMMAR_CASES = [("read", {"path": "README.md"}), ("read", {"path": "setup.py"}), ("find", {"path": "README.md"})]


def accepts(prototype: Any, tokenizer: Any, text: str) -> bool:
    """Whether a compiled grammar accepts `text` token by token, and ends there."""
    matcher = prototype.copy()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def test_each_call_format_is_found_by_its_module_and_round_trips_a_call(tiny_qwen3: Any) -> None:
    """A new call format is one module in `host/calls/formats/`: found there by name, its markers mlx-lm's, a
    call written in it accepted by its own grammar and read back by mlx-lm's parser of it."""
    import importlib

    from mlx_subagents.host.calls.formats import call_syntax, call_syntaxes, kind_of
    from mlx_subagents.host.calls.grammar import Grammars
    from mlx_subagents.host.calls.toolcalls import EXAMPLE_CALL

    tokenizer = tiny_qwen3[1]
    assert list(call_syntaxes()) == ["json", "mistral", "xml"]
    assert [s.parser for s in call_syntaxes().values()] == ["json_tools", "mistral", "qwen3_coder"]
    for name, syntax in call_syntaxes().items():
        assert call_syntax(name) is syntax
        module = importlib.import_module(f"mlx_lm.tool_parsers.{syntax.parser}")
        assert (syntax.start, syntax.end) == (module.tool_call_start, module.tool_call_end)
        assert kind_of(module.parse_tool_call) == name
        assert syntax.parse_tool_call() is module.parse_tool_call
        read = {"name": "read", "arguments": {"path": "README.md"}}
        for text, tools, call in [
            (syntax.write("read", read["arguments"]), [READ], read),
            (syntax.example, None, EXAMPLE_CALL),
        ]:
            assert text.startswith(syntax.start) and text.endswith(syntax.end)
            inner = text[len(syntax.start) : len(text) - len(syntax.end)]
            assert module.parse_tool_call(inner, tools) == call
        prototype = Grammars(tokenizer, name, syntax.start, syntax.end).calls([READ])
        assert prototype is not None
        after_start = [syntax.write(*call).removeprefix(syntax.start) for call in GRAMMAR_CASES]
        assert [accepts(prototype, tokenizer, body) for body in after_start] == [True, False, False]
    assert kind_of(importlib.import_module("mlx_lm.tool_parsers.pythonic").parse_tool_call) is None
    with pytest.raises(ValueError) as info:
        call_syntax("pythonic")
    assert str(info.value) == "unknown call format 'pythonic'; the formats: json, mistral, xml"


ANSWER = {
    "type": "object",
    "properties": {"verdict": {"enum": ["ok", "bad"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["verdict", "score"],
    "additionalProperties": False,
}


def test_an_answer_held_to_its_schema_parses_where_noise_does_not(tiny_qwen3_path: Path) -> None:
    async def go(grammar: bool) -> Any:
        async with MlxModelHost(str(tiny_qwen3_path)) as host:
            args = GenerateArgs(max_tokens=40, grammar=grammar, answer_schema=ANSWER)
            return await host.session("a").generate(TASK, args)

    free, held = asyncio.run(go(False)), asyncio.run(go(True))
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free.text), ANSWER)
    jsonschema.validate(json.loads(held.text), ANSWER)
    assert (free.constrained, held.constrained, held.finish_reason) == (None, "answer", "stop")


def test_a_required_or_named_tool_choice_makes_the_reply_a_valid_call(tiny_qwen3_path: Path) -> None:
    """`tool_choice`: the free reply of the random model calls nothing; `required` holds it to calls to its
    tools, a tool's name to calls to that tool, each with arguments its schema accepts, and none cut at
    the limit (the random model calls on until it ends the reply)."""

    async def go() -> list[Any]:
        async with MlxModelHost(str(tiny_qwen3_path)) as host:
            replies = []
            for i, (choice, limit) in enumerate((("auto", 48), ("required", 48), ("find", 48), ("required", 100))):
                args = GenerateArgs(max_tokens=limit, tool_choice=choice)
                replies.append(await host.session(f"s{i}").generate(TASK, args, tools=TOOLS))
            with pytest.raises(SubagentError, match="tool_choice names 'write', which is not one of the tools"):
                await host.session("bad").generate(TASK, GenerateArgs(tool_choice="write"), tools=TOOLS)
            return replies

    free, required, named, longer = asyncio.run(go())
    assert free.tool_calls == [] and free.constrained is None
    for reply, names in ((required, {"read", "find"}), (named, {"find"}), (longer, {"read", "find"})):
        assert reply.tool_calls and reply.constrained == "calls" and reply.malformed_tool_calls == []
        assert reply.finish_reason == "stop"
        for call in reply.tool_calls:
            assert call.name in names
            schema = next(t for t in TOOLS if t["function"]["name"] == call.name)["function"]["parameters"]
            jsonschema.validate(call.arguments, schema)
    assert {c.name for c in named.tool_calls} == {"find"}


def test_top_p_top_k_and_a_seed_sample_as_mlx_lm_does(tiny_qwen3_path: Path) -> None:
    """A seeded reply at temperature 1 is the same twice and differs from another seed's; top_p near 0
    and top_k 1 keep only the likeliest token: the greedy reply."""

    async def go() -> list[tuple[int, ...]]:
        async with MlxModelHost(str(tiny_qwen3_path)) as host:
            out = []
            for i, args in enumerate(
                (
                    GenerateArgs(max_tokens=24, temperature=1.0, seed=7),
                    GenerateArgs(max_tokens=24, temperature=1.0, seed=7),
                    GenerateArgs(max_tokens=24, temperature=1.0, seed=8),
                    GenerateArgs(max_tokens=24, temperature=1.0, top_p=1e-9),
                    GenerateArgs(max_tokens=24, temperature=1.0, top_k=1, seed=7),
                    GenerateArgs(max_tokens=24),
                    # Any integer seeds (mlx's generator takes 64 bits): one past them is the same seed again.
                    GenerateArgs(max_tokens=24, temperature=1.0, seed=7 + 2**64),
                    GenerateArgs(max_tokens=24, temperature=1.0, seed=-1),
                    GenerateArgs(max_tokens=24, temperature=1.0, seed=2**64 - 1),
                    # A top_k over the vocabulary keeps every token.
                    GenerateArgs(max_tokens=24, temperature=1.0, top_k=10**9, seed=7),
                )
            ):
                out.append((await host.session(f"s{i}").generate(TASK, args)).token_ids)
            return out

    seven, again, eight, nucleus, top_one, greedy, wrapped, minus_one, last, every = asyncio.run(go())
    assert seven == again and seven != eight
    assert nucleus == greedy and top_one == greedy
    assert wrapped == seven and minus_one == last and every == seven


def test_batched_rows_each_keep_their_own_tools(
    tiny_qwen3_path: Path, tiny_qwen3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two rows of one batch, each held to its own tools: each grammar is its row's processor for the
    row's first step only; in the batch's steps after it the rows are masked together (`MaskBatch`).
    Unsliced, both enter the batch in one step (sliced, their prompts, longer than a group's rows, are
    prefilled one after the other, the first decoding meanwhile on its own)."""
    from mlx_subagents.host.calls.constrainer import Constrainer

    start = tiny_qwen3[1].encode("<tool_call>", add_special_tokens=False)
    own = {"a": [READ], "b": [FIND]}
    row_calls: dict[int, int] = {}
    own_call = Constrainer.__call__

    def counted(self: Constrainer, tokens: Any, logits: Any) -> Any:
        row_calls[id(self)] = row_calls.get(id(self), 0) + 1
        return own_call(self, tokens, logits)

    monkeypatch.setattr(Constrainer, "__call__", counted)

    async def go() -> Any:
        def factory(name: str, ids: Any) -> list[Any]:
            return [Prefix(start)]

        async with MlxModelHost(str(tiny_qwen3_path), processor_factory=factory, prefill_slice="off") as host:
            sessions = {name: host.session(name) for name in own}
            replies = await asyncio.gather(
                *(s.generate(TASK, GenerateArgs(max_tokens=64), tools=own[n]) for n, s in sessions.items())
            )
            return replies, host._scheduler.decode.most_decoding

    replies, together = asyncio.run(go())
    assert together == 2  # one batch
    for tools, reply in zip(own.values(), replies, strict=True):
        assert [c.name for c in reply.tool_calls] == [tools[0]["function"]["name"]], reply.raw_text
        jsonschema.validate(reply.tool_calls[0].arguments, tools[0]["function"]["parameters"])
    assert sorted(row_calls.values()) == [1, 1]  # then masked with the batch's other rows, 10+ tokens each
    assert min(len(r.token_ids) for r in replies) > 10


@pytest.mark.slow
def test_a_thought_stays_free_and_the_answer_after_it_is_held(tiny_thinking_path: Path) -> None:
    async def go(grammar: bool) -> Any:
        async with MlxModelHost(str(tiny_thinking_path)) as host:
            args = GenerateArgs(max_tokens=40, grammar=grammar, answer_schema=ANSWER, thinking=12)
            return await host.session("a").generate(TASK, args)

    free, held = asyncio.run(go(False)), asyncio.run(go(True))
    assert held.reasoning == free.reasoning and held.reasoning  # the thought is the same noise both ways
    assert held.constrained == "answer" and free.constrained is None
    jsonschema.validate(json.loads(held.text), ANSWER)


@pytest.mark.slow
def test_the_cli_holds_an_answer_to_its_schema_and_says_so(tmp_path: Path, tiny_qwen3_path: Path, run_cli: Any) -> None:
    from tests.helpers import write_agent

    write_agent(tmp_path, "judge", tools="[]", front="max_turns: 3\n")
    schema = tmp_path / "answer.json"
    schema.write_text(json.dumps(ANSWER))
    common = (
        "run",
        "judge",
        "judge it",
        "-m",
        str(tiny_qwen3_path),
        "-C",
        str(tmp_path),
        "--yes",
        "--schema",
        str(schema),
    )
    code, out, err = run_cli(*common, "--json")
    assert code == 0, err
    result = json.loads(out)
    jsonschema.validate(result["parsed"], ANSWER)
    assert (result["usage"]["turns"], result["usage"]["constrained_answers"]) == (1, 1)  # no retry needed
    code, out, err = run_cli(*common, "--events")
    [message] = [json.loads(line) for line in out.splitlines() if '"kind": "message"' in line]
    assert message["data"]["constrained"] is True and json.loads(message["data"]["text"]) == result["parsed"]
    code, out, err = run_cli(*common, "--json", "--grammar", "off")
    free = json.loads(out)  # noise: not JSON (or cut at its reply limit)
    assert (code, free["status"], free["parsed"], free["usage"]["constrained_answers"]) == (1, "failed", None, 0)


NOTE = {
    "type": "function",
    "function": {
        "name": "note",
        "description": "Write a note.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["text", "tags"],
            "additionalProperties": False,
        },
    },
}


async def open_note(path: Path, room: int, grammar: bool = True) -> tuple[Any, int]:
    """A reply forced to open `note`'s string argument, then `room` tokens of the random model, which
    never closes it by itself: (the reply, the forced opening's length)."""
    async with MlxModelHost(str(path)) as host:
        opening = '<tool_call>\n{"name": "note", "arguments": {"text": "'
        start = host.tokenizer.encode(opening, add_special_tokens=False)
        host._scheduler.decode.processor_factory = lambda name, ids: [Prefix(start)]
        args = GenerateArgs(max_tokens=len(start) + room, grammar=grammar)
        return await host.session("a").generate(TASK, args, tools=[NOTE]), len(start)


@pytest.mark.parametrize("template", ["tools", "no_tools"])
def test_a_call_still_open_near_its_limit_is_closed_valid(template: str, tmp_path_factory: Any) -> None:
    """The call is forced to open a string and the random model writes noise into it, which it never
    closes by itself: near the reply's limit the grammar steers it to close, a required list included,
    and the reply ends as a valid call within its limit (native Hermes with a special end marker, and
    prompted, where the end marker is text). With the grammar off the same start is cut."""
    path = make_tiny_model(tmp_path_factory.mktemp(f"tiny-close-{template}"), template=template)
    for room in (12, 20, 40):  # the way to close takes 11 tokens here: `", "tags": [""]}}` and the end
        reply, n_start = asyncio.run(open_note(path, room))
        assert [c.name for c in reply.tool_calls] == ["note"], reply.raw_text
        jsonschema.validate(reply.tool_calls[0].arguments, NOTE["function"]["parameters"])
        assert reply.usage.generated_tokens <= n_start + room and reply.constrained == "calls"
    cut, _ = asyncio.run(open_note(path, 14, grammar=False))
    assert cut.tool_calls == [] and cut.finish_reason == "length"


def test_a_way_to_close_found_before_is_checked_not_searched_again(
    tmp_path_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside the closing window the model writes on into its string; the way to close found at the
    window's start still closes after each of those tokens, so it is checked (one copy of the matcher)
    instead of searched for again, and the search runs again only once the way no longer fits the
    tokens left. The reply is token for token the one a search at every check gives."""
    from mlx_subagents.host.calls import constrainer

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-close-again"), template="tools")
    searches: list[int] = []
    search = constrainer.shortest_close

    def counted(*args: Any) -> Any:
        searches.append(args[-1])  # the tokens left
        return search(*args)

    monkeypatch.setattr(constrainer, "shortest_close", counted)
    checked, _ = asyncio.run(open_note(path, 40))
    checked_searches, searches[:] = list(searches), []
    monkeypatch.setattr(constrainer, "still_closes", lambda matcher, way: False)  # search at every check
    searched, _ = asyncio.run(open_note(path, 40))
    assert [c.name for c in checked.tool_calls] == ["note"], checked.raw_text
    assert checked.token_ids == searched.token_ids
    # Searched when the window opens (16 tokens left) and when the way no longer fits (3 left); a
    # search at every check runs at each of the checks the window schedules.
    assert (checked_searches, searches) == ([16, 3], [16, 12, 9, 7, 6, 5, 4, 3])


def test_free_rows_get_their_own_grammars_first_mask_on_the_device(tiny_qwen3: Any) -> None:
    """A free step of a batch: each row whose token in flight is its call's start marker gets its own
    grammar's first mask, the others are left as they are; rows of one grammar (the usual batch: one
    agent's tools) and rows of grammars whose first masks differ (here two call formats) alike."""
    from types import SimpleNamespace

    import numpy as np

    from mlx_subagents.host.calls.grammar import Grammars
    from mlx_subagents.host.mlx.masks import MaskBatch

    tokenizer = tiny_qwen3[1]
    vocab = len(tokenizer.vocab)
    json_calls, xml_calls = (Grammars(tokenizer, kind, "<tool_call>", "</tool_call>") for kind in ("json", "xml"))
    first = {g: g.calls([READ]).first_row(vocab) for g in (json_calls, xml_calls)}
    assert not np.array_equal(first[json_calls], first[xml_calls]) and not first[json_calls].all()
    (marker,) = tokenizer.encode("<tool_call>", add_special_tokens=False)
    flight = [marker, marker, tokenizer.encode("Here", add_special_tokens=False)[0], marker]
    for grammars in ([json_calls] * 4, [json_calls, xml_calls, json_calls, None]):
        rows = [(i, g.processor([READ], None, False), None) for i, g in enumerate(grammars) if g is not None]
        generation = SimpleNamespace(_current_tokens=mx.array(flight, dtype=mx.uint32))
        out = MaskBatch(lambda _, rows=rows: rows).apply(
            generation, generation._current_tokens[:, None], mx.zeros((4, 1, vocab))
        )
        got = np.array(out[:, 0, :] > -np.inf)
        for i, (g, token) in enumerate(zip(grammars, flight, strict=True)):
            expected = first[g] if g is not None and token == marker else np.ones(vocab, dtype=bool)
            assert np.array_equal(got[i], expected), (i, g)
        assert not any(r.running for _, r, _ in rows)  # nothing read: free until the host reads the token


def test_batched_masks_equal_each_rows_own(tiny_qwen3: Any) -> None:
    """Three rows of a batch, each held to its own tools (one call the grammar rejects half way, one
    near its limit, closing), their free text of different lengths: masked together in one op
    (`MaskBatch`), each row's logits are, step by step, what it masks on its own, on the device while
    every row is free (its call's marker compared there) and on the host once a matcher runs."""
    from types import SimpleNamespace

    import numpy as np

    from mlx_subagents.host.calls.grammar import Grammars
    from mlx_subagents.host.mlx.masks import MaskBatch

    tokenizer = tiny_qwen3[1]
    vocab = len(tokenizer.vocab)
    grammars = Grammars(tokenizer, "json", "<tool_call>", "</tool_call>")
    calls = [("read", {"path": "README.md"}), ("find", {"kind": "dir", "deep": None}), ("read", {"path": "x"})]
    texts = ["Here.", "Here it is, the list.", "Now."]
    scripts = [tokenizer.encode(t + tool_call_text(*c), add_special_tokens=False) for t, c in zip(texts, calls)]
    tools = [[READ], [READ, FIND], [READ]]
    rows = [grammars.processor(t, None, False) for t in tools]
    alone = [grammars.processor(t, None, False) for t in tools]
    for row in (rows[1], alone[1]):
        row.limit = len(scripts[1]) + 4  # inside the closing window from the start
    failures: list[Exception] = []
    batch = MaskBatch(lambda generation: [(i, r, failures.append) for i, r in enumerate(rows) if i in generation.live])
    compared, on_device = 0, 0
    triggered: list[bool] = []  # per trigger: whether the step was masked on the device
    for k in range(max(map(len, scripts))):
        live = [i for i, s in enumerate(scripts) if k < len(s)]
        flight = [s[k] if k < len(s) else 0 for s in scripts]
        generation = SimpleNamespace(live=live, _current_tokens=mx.array(flight, dtype=mx.uint32))
        for row, script in zip(rows, scripts, strict=True):
            row.known = script[:k]
        device = not any(rows[i].running for i in live)
        on_device += device
        out = batch.apply(generation, generation._current_tokens[:, None], mx.zeros((3, 1, vocab)))
        got = np.array(out[:, 0, :] > -np.inf)
        for i in live:
            ref, script = alone[i], scripts[i]
            ref.known = script[:k]
            ref.catch_up(k + 1)
            armed = ref.armed()
            if ref.running:
                ref.take(script[k])
            if ref.running:
                expected = ref.allowed(vocab)
            elif armed is not None and armed[0] == script[k]:
                expected = armed[1].first_row(vocab)
                triggered.append(device)
            else:
                expected = np.ones(vocab, dtype=bool)
            assert np.array_equal(got[i], expected), (i, k)
            compared += not expected.all()
            assert (rows[i].broken, rows[i].engaged, rows[i].fed) == (ref.broken, ref.engaged, ref.fed)
    assert compared > 40 and sorted(triggered) == [False, True, True] and on_device >= 3 and not failures
    assert [r.broken for r in rows] == [False, False, True]  # `x` is not in read's enum
