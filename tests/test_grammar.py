"""Tool-call grammars on the tiny random model, through the real mlx-lm path: a call the model starts
ends as a well-formed call to one of its tools, with arguments that tool's schema accepts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from test_mlx_host import TASK

from mlx_subagents.host import GenerateArgs, MlxModelHost
from mlx_subagents.host.protocol import ToolCall
from mlx_subagents.testing import ForcedPrefix as Prefix
from mlx_subagents.testing import ForcedScripts, make_tiny_model, tool_call_text

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
    warnings = [r.getMessage() for r in caplog.records if r.name == "mlx_subagents.host.grammar"]
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
