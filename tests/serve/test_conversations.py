"""Which session a chat request goes on in, in process on a scripted host: a conversation goes on across
the two APIs under a name that fits both."""

from __future__ import annotations

import asyncio
from typing import Any

from mlx_subagents.host.scripted import ScriptedHost
from mlx_subagents.runs.hosts import SessionNames
from mlx_subagents.serve.anthropic_api import parse_messages
from mlx_subagents.serve.chat_turn import Finished, start_turn
from mlx_subagents.serve.conversations import Conversations
from mlx_subagents.serve.openai_api import parse_chat


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
