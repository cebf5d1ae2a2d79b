"""Anthropic Messages (`POST /v1/messages`, `POST /v1/messages/count_tokens`) in Anthropic's shape.

The request's system prompt, its messages of content blocks (`text`, `tool_use`, `tool_result`,
`thinking`) and its tools become a `ChatTurn` in the host's OpenAI-style messages; the answer is a
`message` of content blocks (`thinking`, `text`, `tool_use`) with its `stop_reason`, or, with `stream`,
the events the API sends (`message_start`, `content_block_start`, `content_block_delta`,
`content_block_stop`, `message_delta`, `message_stop`). Its usage counts the prompt tokens the
session's KV cache already held as `cache_read_input_tokens` and the rest as `input_tokens`, as the
API counts a prompt cache hit, so Claude Code and the `anthropic` SDK show what was reused.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Literal

from pydantic import Field

from ..host.protocol import Message, Reply, Usage
from ..tools.base import failed_result
from .api_errors import ApiError
from .chat_turn import (
    ChatTurn,
    Event,
    Finished,
    Lenient,
    PrefillBegun,
    ReasoningDelta,
    TextDelta,
    answer_schema,
    chosen_tool,
    function_tool,
    named_once,
    refuse_prefill,
    schema_fields,
    stop_sequences,
    validated,
    visible_content,
)


class Block(Lenient):
    """One content block; which fields it has depends on its `type`."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None


class TurnMessage(Lenient):
    role: Literal["user", "assistant", "system"]  # Claude Code sends its reminders as `system` turns
    content: str | list[Block]


class Tool(Lenient):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom", or a server tool's type (refused: nothing here runs them)


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=0)


class OutputFormat(Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Lenient):
    format: OutputFormat | None = None


class MessagesRequest(Lenient):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[TurnMessage] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured outputs beta's name for output_config.format
    mcp_servers: list[dict[str, Any]] | None = None


class CountRequest(MessagesRequest):
    max_tokens: int = 1


def parse_messages(body: dict[str, Any]) -> MessageShape:
    """The request as a turn and the shape of its answer; what is wrong is one `ApiError` naming the field."""
    request = validated(MessagesRequest, body, "Messages API")
    if request.mcp_servers is not None:
        raise ApiError(400, "mcp_servers: this server connects to no MCP server; leave it out and send their tools")
    refuse_prefill(request.messages)
    choice = request.tool_choice
    return MessageShape(_turn(request), single_call=choice is not None and choice.disable_parallel_tool_use)


def count_tokens_request(body: dict[str, Any]) -> ChatTurn:
    """`count_tokens`'s request (a messages request without `max_tokens`) as the turn it would be."""
    return _turn(validated(CountRequest, body, "Messages API"))


def _turn(request: MessagesRequest) -> ChatTurn:
    thinking = request.thinking
    budget = 0 if thinking is None or thinking.type == "disabled" else thinking.budget_tokens or 4096
    tools = named_once([_tool(t, i) for i, t in enumerate(request.tools or [])], "tools[{}].name")
    choice = request.tool_choice
    none = choice is not None and choice.type == "none"
    forced = "auto"
    if choice is not None and choice.type in ("any", "tool"):
        forced = chosen_tool("required" if choice.type == "any" else choice.name or "", tools, "tool_choice")
    return ChatTurn(
        model=request.model,
        messages=anthropic_messages(request),
        tools=None if none else tools or None,
        max_tokens=request.max_tokens,
        temperature=request.temperature if request.temperature is not None else 0.0,
        top_p=request.top_p or 1.0,
        top_k=request.top_k or 0,
        stop=stop_sequences(request.stop_sequences or [], "stop_sequences"),
        thinking=budget,
        answer_schema=_answer_schema(request),
        tool_choice=forced,
        stream=request.stream,
        schema_fields=schema_fields(tools, "tools[{}].input_schema", _answer_field(request)),
    )


def _answer_schema(request: MessagesRequest) -> dict[str, Any] | None:
    """The JSON schema of a structured output (`output_config.format`), held by the grammar."""
    if request.output_config is not None and request.output_config.format is not None:
        return answer_schema(request.output_config.format.schema_, "output_config.format.schema")
    if request.output_format is not None:
        return answer_schema(request.output_format.schema_, "output_format.schema")
    return None


def _answer_field(request: MessagesRequest) -> str:
    """Where the request has its structured output's schema (the beta's name, or output_config's)."""
    given = request.output_config is not None and request.output_config.format is not None
    return "output_format.schema" if request.output_format is not None and not given else "output_config.format.schema"


def _tool(tool: Tool, i: int) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise ApiError(400, f"tools[{i}]: {tool.type!r} is a server tool, which this server does not run; leave it out")
    return function_tool(tool.name, tool.description, tool.input_schema, f"tools[{i}]")


def anthropic_messages(request: MessagesRequest) -> list[Message]:
    """The conversation in the host's OpenAI-style messages: the system prompt first, a user message's
    tool results as `tool` messages, an assistant's `tool_use` blocks as its calls and its thinking as
    its reasoning. A `system` turn among the messages is read as a user's text, as Claude Code sends it
    to an API that refuses the role, so that every chat template takes it."""
    out: list[Message] = []
    if request.system:
        system = request.system if isinstance(request.system, str) else _texts(request.system, "system")
        out.append({"role": "system", "content": system})
    names: dict[str, str] = {}
    for i, m in enumerate(request.messages):
        blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "assistant":
            out.append(_assistant(blocks, f"messages[{i}]", names))
        else:
            out.extend(_user(blocks, f"messages[{i}]", names))
    return out


def _assistant(blocks: list[Block], where: str, names: dict[str, str]) -> Message:
    text, reasoning, calls = [], [], []
    for j, b in enumerate(blocks):
        if b.type == "text":
            text.append(b.text or "")
        elif b.type == "thinking":
            reasoning.append(b.thinking or "")
        elif b.type == "tool_use":
            calls.append(
                {"id": b.id or "", "type": "function", "function": {"name": b.name or "", "arguments": b.input or {}}}
            )
            names[b.id or ""] = b.name or ""
        elif b.type != "redacted_thinking":
            raise ApiError(
                400, f"{where}.content[{j}]: {b.type} blocks are not read by this server; send text and tool_use"
            )
    message: Message = {"role": "assistant", "content": "\n\n".join(text)}
    if reasoning:
        message["reasoning_content"] = "\n\n".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[Block], where: str, names: dict[str, str]) -> list[Message]:
    out: list[Message] = []
    text: list[str] = []
    for j, b in enumerate(blocks):
        if b.type == "text":
            text.append(b.text or "")
        elif b.type == "tool_result":
            content = (
                b.content if isinstance(b.content, str) else _texts(b.content or [], f"{where}.content[{j}].content")
            )
            if b.is_error:  # the model reads a failed call as it reads its agents' own: `Error: ...`
                content = failed_result(content).output
            result: Message = {"role": "tool", "tool_call_id": b.tool_use_id or "", "content": content}
            if b.tool_use_id in names:
                result["name"] = names[b.tool_use_id or ""]
            out.append(result)
        else:
            raise ApiError(
                400, f"{where}.content[{j}]: {b.type} blocks are not read by this server; send text and tool_result"
            )
    if text:
        out.append({"role": "user", "content": "\n\n".join(text)})
    return out


def _texts(blocks: list[Block], where: str) -> str:
    for j, b in enumerate(blocks):
        if b.type != "text":
            raise ApiError(400, f"{where}[{j}]: {b.type} blocks are not read by this server; send text")
    return "\n\n".join(b.text or "" for b in blocks)


STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "cancelled": "end_turn"}


class MessageShape:
    """The answer to one request: a `message`, or its stream of events."""

    def __init__(self, turn: ChatTurn, single_call: bool) -> None:
        self.turn, self.single_call = turn, single_call
        self.id = f"msg_{secrets.token_hex(12)}"
        self._opened = False
        self._block: str | None = None  # the kind of the block open now
        self._index = -1

    def whole(self, finished: Finished) -> dict[str, Any]:
        reply = finished.reply
        content: list[dict[str, Any]] = []
        if reply.reasoning:
            content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
        if text := visible_content(reply):
            content.append({"type": "text", "text": text})
        content.extend(self._calls(reply))
        return {**self._message(finished), "content": content, "usage": usage(reply.usage)}

    def on(self, event: Event) -> list[tuple[str | None, Any]]:
        out = self._open(event)
        if isinstance(event, TextDelta):
            out += self._switch("text") + [self._delta({"type": "text_delta", "text": event.text})]
        elif isinstance(event, ReasoningDelta):
            out += self._switch("thinking") + [self._delta({"type": "thinking_delta", "thinking": event.text})]
        elif isinstance(event, Finished):
            reply = event.reply
            if extra := "\n".join(bad.raw for bad in reply.malformed_tool_calls):
                out += self._switch("text") + [self._delta({"type": "text_delta", "text": extra})]
            out += self._switch(None)
            for call in self._calls(reply):
                self._index += 1
                out.append(
                    (
                        "content_block_start",
                        {"type": "content_block_start", "index": self._index, "content_block": {**call, "input": {}}},
                    )
                )
                out.append(
                    self._delta(
                        {"type": "input_json_delta", "partial_json": json.dumps(call["input"], ensure_ascii=False)}
                    )
                )
                out.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
            head = self._message(event)
            delta = {"stop_reason": head["stop_reason"], "stop_sequence": head["stop_sequence"]}
            out.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": usage(reply.usage)}))
        return out

    def end(self) -> list[tuple[str | None, Any]]:
        return [("message_stop", {"type": "message_stop"})]

    def error(self, error: ApiError) -> list[tuple[str | None, Any]]:
        return [("error", error.body("anthropic"))]

    def _open(self, event: Event) -> list[tuple[str | None, Any]]:
        """`message_start` before the first event (its usage the prompt's, once admitted)."""
        if self._opened:
            return []
        self._opened = True
        started = event if isinstance(event, PrefillBegun) else None
        prompt = Usage(started.tokens + started.cached, started.cached) if started else Usage()
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.turn.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": usage(prompt)}  # fmt: skip
        return [("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})]

    def _switch(self, kind: str | None) -> list[tuple[str | None, Any]]:
        """Close the open block unless it is of `kind`; open one of `kind` (None: close only)."""
        if self._block == kind:
            return []
        out: list[tuple[str | None, Any]] = []
        if self._block == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        if self._block is not None:
            out.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
        self._block = kind
        if kind is not None:
            self._index += 1
            block = (
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
            out.append(
                ("content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block})
            )
        return out

    def _delta(self, delta: dict[str, Any]) -> tuple[str | None, Any]:
        return ("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})

    def _message(self, finished: Finished) -> dict[str, Any]:
        reply = finished.reply
        if finished.stop_sequence is not None:
            reason = "stop_sequence"
        elif self._calls(reply):
            reason = "tool_use"
        else:
            reason = STOP_REASONS[reply.finish_reason]
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.turn.model,
                "stop_reason": reason, "stop_sequence": finished.stop_sequence}  # fmt: skip

    def _calls(self, reply: Reply) -> list[dict[str, Any]]:
        calls = reply.tool_calls[:1] if self.single_call else reply.tool_calls
        return [
            {"type": "tool_use", "id": f"toolu_{secrets.token_hex(12)}", "name": c.name, "input": c.arguments}
            for c in calls
        ]


def usage(used: Usage) -> dict[str, int]:
    """Anthropic's usage: a cache hit is `cache_read_input_tokens`, the rest of the prompt `input_tokens`."""
    return {
        "input_tokens": used.prompt_tokens - used.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": used.cached_tokens,
        "output_tokens": used.generated_tokens,
    }


__all__ = ["MessageShape", "anthropic_messages", "count_tokens_request", "parse_messages", "usage"]
