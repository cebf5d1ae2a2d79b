"""Which session a chat request goes on in, and what its model is sent, in process on a scripted host:
a conversation goes on across the two APIs under a name that fits both, and a client's failed tool
result reaches the model as the agents' own failed results do."""

from __future__ import annotations

import asyncio
from typing import Any

from mlx_subagents.host.engine.estimate import approx_tokens
from mlx_subagents.host.protocol import Message, TextDelta
from mlx_subagents.host.scripted import ScriptedHost
from mlx_subagents.runs.hosts import SessionNames
from mlx_subagents.serve.anthropic_api import parse_messages
from mlx_subagents.serve.chat_turn import Finished, start_turn
from mlx_subagents.serve.conversations import Conversations
from mlx_subagents.serve.openai_api import parse_chat

WEATHER = {"name": "get_weather", "description": "w", "input_schema": {"type": "object"}}


def answer(host: ScriptedHost, conversations: Conversations, api: str, client: str, body: dict[str, Any]) -> str:
    """The reply's text to one request of `api` from `client`, as the endpoints run it."""
    turn = (parse_chat if api == "openai" else parse_messages)({"model": "m", "max_tokens": 64, **body}).turn

    async def go() -> Finished:
        run = await start_turn(host, turn, conversations, api, client)
        while not isinstance(event := await run.next(), Finished):
            pass
        return event

    return asyncio.run(go()).reply.text


def test_a_conversation_goes_on_over_the_other_api_and_status_names_it_for_neither() -> None:
    """An Anthropic request that goes on from an OpenAI one goes on in its session; `--status` showed it as
    `openai#1` under the Anthropic client. Named for neither API, it says the API of its last request."""
    host = ScriptedHost.from_replies(["Hello.", "More."])
    conversations = Conversations(SessionNames())
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert answer(host, conversations, "openai", "c1", {"messages": first}) == "Hello."
    more = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "and?"},
    ]
    assert answer(host, conversations, "anthropic", "c2", {"system": "Be brief.", "messages": more}) == "More."
    [summary] = conversations.summaries()
    assert {k: summary[k] for k in ("client", "session", "api", "turns")} == {
        "client": "c2",
        "session": "conversation#1",
        "api": "anthropic",
        "turns": 2,
    }
    assert list(host.history) == ["conversation#1"]  # one host session: the first turn's KV went on


def test_a_failed_tool_result_reaches_the_model_as_an_error() -> None:
    """An Anthropic `tool_result` with `is_error` was sent to the model as if the call had answered; now it
    reads `Error: ...`, as an agent's failed call does (an MCP tool's error the same), prefixed only when it
    does not open with "Error" itself."""
    host = ScriptedHost.from_replies(["Sorry."])
    call = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "X"}}
    messages = [
        {"role": "user", "content": "weather in X?"},
        {"role": "assistant", "content": [call]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "city not found", "is_error": True},
                {"type": "tool_result", "tool_use_id": "t1", "content": [], "is_error": True},
                {"type": "tool_result", "tool_use_id": "t1", "content": "12 C", "is_error": False},
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": "Error: File does not exist.",
                    "is_error": True,
                },
            ],
        },
    ]
    answer(host, Conversations(SessionNames()), "anthropic", "c1", {"messages": messages, "tools": [WEATHER]})
    [[*_, sent]] = host.history.values()
    results: list[Message] = [m for m in sent if m["role"] == "tool"]
    assert [m["content"] for m in results] == [
        "Error: city not found",
        "Error: the tool failed",
        "12 C",
        "Error: File does not exist.",  # as Claude Code's failed calls read: not "Error: Error: ..."
    ]


def test_a_running_turn_counts_its_tokens_as_they_stream() -> None:
    """`--status` showed a conversation's first turn as "0 generated" however long it had run; it counts the
    reply's tokens as they stream, then the turn's as it ends."""
    host = ScriptedHost.from_replies([{"content": "a long answer that goes on", "stall": 30}, "Done."])
    conversations = Conversations(SessionNames())
    turn = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).turn

    async def go() -> list[tuple[str, int]]:
        run = await start_turn(host, turn, conversations, "openai", "c1")
        while not isinstance(await run.next(), TextDelta):  # it streams, then stalls
            pass
        await asyncio.sleep(0)
        [running] = conversations.summaries()
        run.cancel()  # as when its client goes away: the turn ends, cut where it was
        while (cut := conversations.summaries()[0])["status"] == "running":
            await asyncio.sleep(0)
        return [(s["status"], s["generated_tokens"]) for s in (running, cut)]

    streamed = approx_tokens([{"role": "assistant", "content": "a long answer that goes on"}])
    assert asyncio.run(go()) == [("running", streamed), ("idle", streamed)]
