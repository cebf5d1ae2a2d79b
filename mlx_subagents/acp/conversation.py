"""A conversation as the editor and the agent exchange it: the client's prompt blocks read as the
agent's message, and a saved conversation shown again (`session/load`) as the updates it was."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import acp
from acp.schema import EmbeddedResourceContentBlock, ResourceContentBlock, TextContentBlock, TextResourceContents

from ..errors import RequestError
from ..host.protocol import Message
from .updates import text_content, tool_kind


def prompt_text(blocks: list[Any]) -> str:
    """The message the agent reads: the text, each file the person attached (`@file`: its text, or
    its path to read), in order; a kind of block the agent did not offer is one error line."""
    parts: list[str] = []
    for block in blocks:
        if isinstance(block, TextContentBlock):
            parts.append(block.text)
        elif isinstance(block, ResourceContentBlock):
            parts.append(f"[file: {block.uri}]")
        elif isinstance(block, EmbeddedResourceContentBlock) and isinstance(block.resource, TextResourceContents):
            parts.append(f"[file: {block.resource.uri}]\n{block.resource.text}")
        else:
            kind = getattr(block, "type", type(block).__name__)
            raise RequestError(f"a prompt block of type '{kind}' is not taken here; send text, or a file as text")
    text = "\n\n".join(p for p in parts if p.strip())
    if not text.strip():
        raise RequestError("the prompt holds no text; type what the agent should do")
    return text


def replay(messages: list[Message]) -> Iterator[Any]:
    """The updates that show a saved conversation again: the person's messages, the agent's replies and
    reasoning, each a message with its id, and each tool call with its result (the system prompt is not
    shown)."""
    for n, message in enumerate(messages):
        role, content = message.get("role"), str(message.get("content") or "")
        if role == "user" and content:
            yield with_id(acp.update_user_message_text(content), f"saved-{n}")
        elif role == "assistant":
            if message.get("reasoning_content"):
                yield with_id(acp.update_agent_thought_text(str(message["reasoning_content"])), f"saved-{n}-thought")
            if content:
                yield with_id(acp.update_agent_message_text(content), f"saved-{n}")
            yield from _calls(message, _results(messages, n + 1), n)


def with_id(chunk: Any, message_id: str) -> Any:
    """A saved message's chunk with its id (its place in the conversation: one chunk, one message)."""
    chunk.message_id = message_id
    return chunk


def _results(messages: list[Message], start: int) -> dict[Any, str]:
    """The tool results that follow a reply, by call id (ids repeat from one reply to the next)."""
    found: dict[Any, str] = {}
    for message in messages[start:]:
        if message.get("role") != "tool":
            break
        found[message.get("tool_call_id")] = str(message.get("content") or "")
    return found


def _calls(message: Message, results: dict[Any, str], n: int) -> Iterator[Any]:
    for call in message.get("tool_calls") or []:
        function = call.get("function", {})
        name, call_id = str(function.get("name", "?")), f"saved-{n}-{call.get('id', '')}"
        yield acp.start_tool_call(
            call_id, name, kind=tool_kind(name), status="completed", raw_input=function.get("arguments")
        )
        if (output := results.get(call.get("id"))) is not None:
            yield acp.update_tool_call(call_id, status="completed", content=[text_content(output)])
