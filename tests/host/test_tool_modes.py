"""Tool modes on the tiny model's template variants, through the real mlx-lm path with forced decoding.

`tools`: Qwen-style template that renders tools (native). `no_tools`: SmolLM2's ChatML, which drops
them (prompted). `strict`: Gemma-style, no system role and strict alternation (prompted, normalised).
`none`: no chat template (refused at load).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.agents.session import AgentSession, workspace_for
from mlx_subagents.agents.spec import AgentSpec
from mlx_subagents.cli.doctor import run_doctor
from mlx_subagents.errors import ChatTemplateError
from mlx_subagents.host import GenerateArgs, MlxModelHost
from mlx_subagents.host.calls.chat_format import prompted_tools, read_chat_format
from mlx_subagents.host.calls.prompt import encode, render
from mlx_subagents.host.calls.templates import TemplateTraits, normalise
from mlx_subagents.host.protocol import ToolCall
from mlx_subagents.testing import ForcedScripts, make_tiny_model, tool_call_text
from tests.helpers import texts
from tests.host.test_mlx_host import LS_SCHEMA, TASK

SYSTEM = TASK[0]["content"]
LS_RESULT = {"role": "tool", "tool_call_id": "call_0", "name": "ls", "content": "src/\nREADME.md"}
STRICT = TemplateTraits(system=False, tool_role=False, alternating=True, tools=False, tool_calls=False)


@pytest.fixture(scope="module")
def template_paths(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_path: Path) -> dict[str, Path]:
    paths = {"tools": tiny_qwen3_path}
    for template in ("coder", "no_tools", "strict", "none"):
        paths[template] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{template}"), template=template)
    return paths


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_the_host_decides_the_tool_mode_by_probing_the_template(template_paths: dict[str, Path]) -> None:
    async def probe(path: Path) -> tuple[str, TemplateTraits]:
        async with MlxModelHost(str(path)) as host:
            return host.tool_mode, host.chat.traits

    assert run(probe(template_paths["tools"])) == ("native", TemplateTraits())
    assert run(probe(template_paths["coder"])) == ("native", TemplateTraits())
    assert run(probe(template_paths["no_tools"])) == (
        "prompted",
        TemplateTraits(system=True, tool_role=True, alternating=False, tools=False, tool_calls=False),
    )
    assert run(probe(template_paths["strict"])) == ("prompted", STRICT)
    # Without the weights, from the tokenizer files alone (what a model list needs).
    assert {t: read_chat_format(template_paths[t]).tool_mode for t in ("tools", "no_tools", "strict")} == {
        "tools": "native",
        "no_tools": "prompted",
        "strict": "prompted",
    }
    lines: list[str] = []
    assert run(run_doctor(str(template_paths["no_tools"]), None, lines.append))
    assert (
        "tools     prompted: the template drops tools; their list and a <tool_call> format go in the system prompt"
        in lines
    )


def test_a_model_without_a_chat_template_is_refused_in_one_line(template_paths: dict[str, Path], run_cli: Any) -> None:
    path = template_paths["none"]
    host = MlxModelHost(str(path))
    with pytest.raises(ChatTemplateError) as error:
        run(host.start())
    assert not host._mlx._thread.is_alive()  # the mlx thread it started is stopped, not left behind
    assert str(error.value) == (
        f"model {path} has no chat template (no chat_template in tokenizer_config.json or chat_template.jinja); "
        "use an instruct/chat version of the model"
    )
    assert run_cli("run", "scout", "look", "--model", str(path), "-C", str(path)) == (2, "", f"error: {error.value}\n")


@pytest.mark.parametrize("template", ["no_tools", "strict"])
def test_prompted_call_is_parsed_streamed_without_markup_and_turn_two_reuses_the_prefix(
    template: str, template_paths: dict[str, Path], tiny_qwen3: Any
) -> None:
    path = template_paths[template]
    call = tool_call_text("ls", {"path": "."})
    scripts = ForcedScripts(tiny_qwen3[1], {"a": [f"Let me look.\n{call}", "It is parsed in src/config.py."]})
    seen: list[str] = []

    async def go() -> tuple[Any, Any, str, int, int]:
        async with MlxModelHost(str(path), processor_factory=scripts) as host:
            session = host.session("a")
            first = await session.generate(
                TASK, GenerateArgs(max_tokens=64, on_event=texts(seen.append)), tools=[LS_SCHEMA]
            )
            messages = [*TASK, first.to_message(), LS_RESULT]
            second = await session.generate(messages, GenerateArgs(max_tokens=64), tools=[LS_SCHEMA])
            other = [TASK[0], {"role": "user", "content": "Task: list the tests."}]
            shared = (
                await host.session("b").generate(other, GenerateArgs(max_tokens=2), tools=[LS_SCHEMA])
            ).usage.cached_tokens
            shown, tools = host.chat.present(messages, [LS_SCHEMA])
            prompt = render(host.tokenizer, shown, tools, generation_prompt=True)
            system = encode(host.tokenizer, render(host.tokenizer, shown[:1], None, generation_prompt=False))
            return first, second, prompt, await host.count_tokens(messages, [LS_SCHEMA]), shared - len(system)

    first, second, prompt, fresh, unshared = run(go())
    assert first.tool_calls == [ToolCall("ls", {"path": "."}, "call_0")]
    assert first.text == "Let me look." and first.malformed_tool_calls == []
    assert "".join(seen) == "Let me look.\n"
    assert second.text == "It is parsed in src/config.py." and second.tool_calls == []
    # The tool list and our call format are in the rendered prompt, once; the earlier call and its
    # result are written back as the model saw them.
    assert prompt.count(prompted_tools([LS_SCHEMA])) == 1
    assert f"Let me look.\n{call}<|im_end|>" in prompt
    assert "<tool_response>\nsrc/\nREADME.md\n</tool_response>" in prompt
    if template == "strict":
        assert prompt.startswith(f"<|im_start|>user\n{SYSTEM}\n\n# Tools\n")
        assert "<|im_start|>system" not in prompt and "<|im_start|>model\nLet me look." in prompt
    else:  # another session of the agent starts from the shared system prompt, tool list included
        assert unshared == 0
    # Turn 2 reuses everything turn 1 held and prefills only what is new.
    held = first.usage.prompt_tokens + first.usage.generated_tokens
    assert second.usage.cached_tokens == held
    assert second.usage.prefilled_tokens == second.usage.prompt_tokens - held > 0
    assert second.usage.prompt_tokens == fresh


@pytest.mark.parametrize("template", ["no_tools", "strict"])
def test_prompted_agent_runs_the_forced_call_and_completes(
    template: str, template_paths: dict[str, Path], tiny_qwen3: Any, tmp_path: Path
) -> None:
    (tmp_path / "config.py").write_text("CONFIG = {}\n")
    spec = AgentSpec(
        name="scout", description="finds", tools=("ls",), system_prompt=SYSTEM, source="builtin", path=tmp_path
    )
    answer = "The config is in config.py."
    bad = '<tool_call>\n{"name": "ls", "arguments": </tool_call>'
    scripts = ForcedScripts(tiny_qwen3[1], {"scout": [bad, tool_call_text("ls", {"path": "."}), answer]})

    async def go() -> Any:
        async with MlxModelHost(str(template_paths[template]), processor_factory=scripts) as host:
            session = AgentSession(spec, host, workspace_for(tmp_path))
            return await session.run("where is the config?"), session.messages

    result, messages = run(go())
    assert (result.status, result.output, result.tool_mode) == ("completed", answer, "prompted")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert messages[3]["content"] == (
        "Error: your tool call could not be parsed (JSONDecodeError: Expecting value: line 1 column 28 (char 27)). "
        "Write each call exactly in this format, with the tool's own name and arguments:\n"
        '<tool_call>\n{"name": "tool_name", "arguments": {"argument": "value"}}\n</tool_call>'
    )
    assert "config.py" in messages[5]["content"]
    assert "<tool_call>" not in messages[0]["content"]  # the session's own prompt names no format


def test_native_mode_streams_only_visible_text(tiny_qwen3_path: Path, tiny_qwen3: Any) -> None:
    call = tool_call_text("ls", {"path": "src"})
    scripts = ForcedScripts(tiny_qwen3[1], {"a": [f"Looking.{call} Then <tool"]})
    seen: list[str] = []

    async def go() -> Any:
        async with MlxModelHost(str(tiny_qwen3_path), processor_factory=scripts) as host:
            assert host.tool_mode == "native"
            return await host.session("a").generate(
                TASK, GenerateArgs(max_tokens=64, on_event=texts(seen.append)), tools=[LS_SCHEMA]
            )

    reply = run(go())
    assert "".join(seen) == "Looking. Then <tool"  # a held-back partial marker is text after all
    assert reply.text == "Looking. Then <tool" and reply.tool_calls == [ToolCall("ls", {"path": "src"}, "call_0")]


def test_native_xml_calls_use_the_models_own_parser_and_fix(template_paths: dict[str, Path], tiny_qwen3: Any) -> None:
    """Qwen3-Coder-style XML calls: mlx-lm's `qwen3_coder` parser reads them, the markup never streams,
    and a malformed call's fix is written in XML, as the template writes calls."""
    xml = "<tool_call>\n<function=ls>\n<parameter=path>\nsrc\n</parameter>\n</function>\n</tool_call>"
    unclosed = "<tool_call>\n<function=ls>\n"
    scripts = ForcedScripts(tiny_qwen3[1], {"a": [f"Looking.\n{xml}", unclosed, "Done."]})
    seen: list[str] = []

    async def go() -> list[Any]:
        async with MlxModelHost(str(template_paths["coder"]), processor_factory=scripts) as host:
            session = host.session("a")
            first = await session.generate(
                TASK, GenerateArgs(max_tokens=64, on_event=texts(seen.append)), tools=[LS_SCHEMA]
            )
            messages = [*TASK, first.to_message(), LS_RESULT]
            second = await session.generate(messages, GenerateArgs(max_tokens=64), tools=[LS_SCHEMA])
            third = await session.generate(messages, GenerateArgs(max_tokens=64), tools=[LS_SCHEMA])
            return [first, second, third]

    first, second, third = run(go())
    assert first.tool_calls == [ToolCall("ls", {"path": "src"}, "call_0")] and first.text == "Looking."
    assert "".join(seen) == "Looking.\n"
    assert second.malformed_tool_calls[0].error == (
        "Error: your tool call could not be parsed (the call has no closing </tool_call>). "
        "Write each call exactly in this format, with the tool's own name and arguments:\n"
        "<tool_call>\n<function=tool_name>\n<parameter=argument>\nvalue\n</parameter>\n</function>\n</tool_call>"
    )
    # The template re-renders the XML call as generated: turn 2 reused all that turn 1 held.
    assert second.usage.cached_tokens == first.usage.prompt_tokens + first.usage.generated_tokens
    assert third.text == "Done." and third.tool_calls == []


# Mistral's way, with this kit's tokens: tools before the last user message, `[TOOL_CALLS]` JSON calls
# with no end marker, and a raise on any call id that is not 9 alphanumeric characters.
MISTRAL_TEMPLATE = """
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}{% if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {{- '[SYSTEM_PROMPT]' + message.content + '[/SYSTEM_PROMPT]' }}
    {%- elif message.role == 'user' %}
        {%- if tools and loop.index0 == ns.last_user %}
            {{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {{- '[INST]' + message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' %}
        {{- message.content or '' }}
        {%- if message.tool_calls %}
            {{- '[TOOL_CALLS][' }}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.id is not defined or tool_call.id | length != 9 %}
                    {{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
                {%- endif %}
                {{- {'name': tool_call.function.name, 'arguments': tool_call.function.arguments} | tojson }}
            {%- endfor %}
            {{- ']' }}
        {%- endif %}
        {{- eos_token }}
    {%- elif message.role == 'tool' %}
        {{- '[TOOL_RESULTS]' + ({'content': message.content, 'call_id': message.tool_call_id} | tojson) + '[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""


def test_native_mistral_calls_with_the_ids_its_template_demands(tmp_path: Path, tiny_qwen3: Any) -> None:
    path = make_tiny_model(tmp_path / "mistral")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": MISTRAL_TEMPLATE.strip()}))
    calls = '[TOOL_CALLS][{"name": "ls", "arguments": {"path": "."}}]'
    scripts = ForcedScripts(tiny_qwen3[1], {"a": [f"Looking.{calls}", "It is parsed in src/config.py."]})
    seen: list[str] = []

    async def go() -> tuple[Any, Any, Any]:
        async with MlxModelHost(str(path), processor_factory=scripts) as host:
            session = host.session("a")
            first = await session.generate(
                TASK, GenerateArgs(max_tokens=64, on_event=texts(seen.append)), tools=[LS_SCHEMA]
            )
            second = await session.generate(
                [*TASK, first.to_message(), LS_RESULT], GenerateArgs(max_tokens=64), tools=[LS_SCHEMA]
            )
            return host.chat, first, second

    chat, first, second = run(go())
    assert (chat.tool_mode, chat.calls.start, chat.calls.end) == ("native", "[TOOL_CALLS]", "")
    assert chat.traits == TemplateTraits(short_call_ids=True)
    assert chat.calls.example == '[TOOL_CALLS][{"name": "tool_name", "arguments": {"argument": "value"}}]'
    assert first.tool_calls == [ToolCall("ls", {"path": "."}, "call_0")]
    assert first.text == "Looking." and "".join(seen) == "Looking."
    # The call ids reach the template as 9 characters (no exception), and the prefix is reused.
    assert second.text == "It is parsed in src/config.py."
    assert second.usage.cached_tokens == first.usage.prompt_tokens + first.usage.generated_tokens


def test_normalise_for_a_strict_template_without_system_or_tool_role() -> None:
    call = {"id": "call_0", "type": "function", "function": {"name": "ls", "arguments": {"path": "."}}}
    messages = [
        *TASK,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "a.py"},
        {"role": "tool", "tool_call_id": "call_1", "content": "b.py"},
        {"role": "user", "content": "Also check tests."},
    ]
    assert normalise(messages, STRICT, tool_results_as_user=False) == [
        {"role": "user", "content": f"{SYSTEM}\n\nTask: where is the config parsed?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {
            "role": "user",
            "content": "<tool_response>\na.py\n</tool_response>\n\n<tool_response>\nb.py\n</tool_response>\n\n"
            "Also check tests.",
        },
    ]
    # A template that accepts everything gets the conversation unchanged.
    assert normalise(messages, TemplateTraits(), tool_results_as_user=False) == messages
