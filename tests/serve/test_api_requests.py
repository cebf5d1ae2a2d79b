"""What a chat request asks that this server does not do is refused in one line naming the field, in
process (the SDKs' view of the same errors is in test_endpoints.py's bad requests): a client that sent
it would otherwise get another answer than it asked for (a penalty not applied, a prefill answered as a
new message), and not know it. And what a request bounds is bounded: max_tokens, a thought included."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.errors import GrammarError
from mlx_subagents.host.mlx.mlx_host import MlxModelHost
from mlx_subagents.runs.hosts import SessionNames
from mlx_subagents.serve.anthropic_api import count_tokens_request, parse_messages
from mlx_subagents.serve.api_errors import ApiError
from mlx_subagents.serve.chat_turn import Finished, schema_refusal, start_turn
from mlx_subagents.serve.conversations import Conversations
from mlx_subagents.serve.openai_api import parse_chat

USER = [{"role": "user", "content": "hi"}]
PREFILL = (
    "the conversation ends with an assistant message, which this server does not continue (a prefill); "
    "end it with a user message or a tool result"
)
THINK_END = 1544  # the tiny thinking model's `</think>`
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"n": 2}, "n: 2 answers to one request are not made here; send 1 or leave n out"),
        ({"logprobs": True}, "logprobs: logprobs are not returned by this server; leave logprobs out"),
        ({"top_logprobs": 3}, "top_logprobs: logprobs are not returned by this server; leave it out"),
        ({"presence_penalty": 0.5}, "presence_penalty: not applied by this server; send 0 or leave it out"),
        ({"frequency_penalty": -1}, "frequency_penalty: not applied by this server; send 0 or leave it out"),
        ({"logit_bias": {"50256": -100}}, "logit_bias: not applied by this server; leave it out"),
        (
            {"modalities": ["text", "audio"]},
            "modalities: only text answers are made by this server; send ['text'] or leave modalities out",
        ),
        ({"audio": {"voice": "alloy"}}, "audio: audio answers are not made by this server; leave audio out"),
        (
            {"web_search_options": {}},
            "web_search_options: web search is a server tool, which this server does not run; leave it out",
        ),
        (
            {"functions": [{"name": "f", "parameters": {"type": "object"}}]},
            "functions: the legacy functions are not read here; send them as tools",
        ),
        ({"function_call": "auto"}, "function_call: the legacy function_call is not read here; send it as tool_choice"),
    ],
)
def test_a_chat_request_asking_what_is_not_served_is_refused_naming_the_field(
    extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ApiError) as refused:
        parse_chat({"model": "m", "messages": USER, **extra})
    assert (refused.value.status, refused.value.message, refused.value.param) == (400, message, next(iter(extra)))


def test_a_chat_request_with_the_neutral_values_of_what_is_not_served_is_answered() -> None:
    """What clients send by default (no penalty, one answer, text) changes nothing and is taken."""
    neutral = {"n": 1, "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}}
    shape = parse_chat({"model": "m", "messages": USER, "modalities": ["text"], "store": False, **neutral})
    assert shape.turn.messages == USER


def test_a_conversation_ending_with_the_assistants_message_is_refused_in_either_api() -> None:
    prefilled = [*USER, {"role": "assistant", "content": "Sure,"}]
    with pytest.raises(ApiError) as refused:
        parse_chat({"model": "m", "messages": prefilled})
    assert (refused.value.message, refused.value.param) == (f"messages[1]: {PREFILL}", "messages[1]")
    with pytest.raises(ApiError, match=r"^messages\[1\]: the conversation ends with an assistant message"):
        parse_messages({"model": "m", "max_tokens": 8, "messages": prefilled})
    # Counting its tokens is not answering it.
    assert count_tokens_request({"model": "m", "messages": prefilled}).messages[-1]["content"] == "Sure,"


def test_an_anthropic_structured_output_is_the_answers_schema_and_mcp_servers_are_refused() -> None:
    body = {"model": "m", "max_tokens": 8, "messages": USER}
    fmt = {"type": "json_schema", "schema": SCHEMA}
    assert parse_messages({**body, "output_config": {"format": fmt, "effort": "high"}}).turn.answer_schema == SCHEMA
    assert parse_messages({**body, "output_format": fmt}).turn.answer_schema == SCHEMA  # the beta's name
    assert parse_messages({**body, "output_config": {"effort": "low"}}).turn.answer_schema is None
    with pytest.raises(ApiError, match=r"^output_config\.format\.schema: .*; send a valid JSON schema$"):
        parse_messages({**body, "output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}})
    with pytest.raises(ApiError) as refused:
        parse_messages({**body, "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]})
    assert (
        refused.value.message == "mcp_servers: this server connects to no MCP server; leave it out and send their tools"
    )


@pytest.mark.parametrize(
    ("api", "body"),
    [
        ("openai", {"max_tokens": 20, "reasoning_effort": "low"}),
        ("anthropic", {"max_tokens": 20, "thinking": {"type": "enabled", "budget_tokens": 1024}}),
    ],
)
def test_a_thinking_models_thought_counts_in_the_requests_max_tokens(
    api: str, body: dict[str, Any], tiny_thinking_path: Path
) -> None:
    """Both APIs bound every generated token by max_tokens, the thought's included (OpenAI's
    max_completion_tokens counts reasoning tokens; Anthropic's budget_tokens is under max_tokens): a
    client that asked for 20 got the budget's 1,024 thought tokens and 20 more. The tiny thinking model
    thinks greedily until its budget, which is cut to leave the end marker and one token of answer."""
    parse = parse_chat if api == "openai" else parse_messages
    turn = parse({"model": str(tiny_thinking_path), "messages": USER, **body}).turn

    async def go() -> Finished:
        async with MlxModelHost(str(tiny_thinking_path)) as host:
            run = await start_turn(host, turn, Conversations(SessionNames()), api, "c1")
            while not isinstance(event := await run.next(), Finished):
                pass
            return event

    reply = asyncio.run(go()).reply
    assert reply.usage.generated_tokens == len(reply.token_ids) == 20
    assert reply.token_ids[18] == THINK_END and reply.token_ids.count(THINK_END) == 1 and reply.reasoning


def tool(name: str, api: str) -> dict[str, Any]:
    schema = {"type": "object", "properties": {"v": {"type": "string"}}}
    if api == "openai":
        return {"type": "function", "function": {"name": name, "parameters": schema}}
    return {"name": name, "input_schema": schema}


@pytest.mark.parametrize(
    ("api", "extra", "part", "field"),
    [
        ("openai", {"tools": [tool("f", "openai"), tool("g", "openai")]}, "tool", "tools[1].function.parameters"),
        ("openai", {"tools": [tool("f", "openai"), tool("g", "openai")]}, "tools", "tools"),
        (
            "openai",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
            "answer",
            "response_format.json_schema.schema",
        ),
        ("anthropic", {"tools": [tool("f", "anthropic"), tool("g", "anthropic")]}, "tool", "tools[1].input_schema"),
        (
            "anthropic",
            {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
            "answer",
            "output_config.format.schema",
        ),
        ("anthropic", {"output_format": {"type": "json_schema", "schema": SCHEMA}}, "answer", "output_format.schema"),
    ],
)
def test_the_grammars_refusal_of_a_schema_names_the_field_it_came_in(
    api: str, extra: dict[str, Any], part: str, field: str
) -> None:
    """The host says which schema its grammar cannot hold (the answer's, a tool's by name, the tools
    together); the client is told where its request has it, in its API's words."""
    parse = parse_chat if api == "openai" else parse_messages
    turn = parse({"model": "m", "max_tokens": 8, "messages": USER, **extra}).turn
    refused = schema_refusal(turn, GrammarError("why", part, "g" if part == "tool" else None))
    assert (refused.status, refused.message, refused.param) == (400, f"{field}: why", field)
