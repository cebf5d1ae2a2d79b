"""OpenAI Chat Completions (`POST /v1/chat/completions`): requests in, answers out, in OpenAI's shape.

A request's messages, tools, `response_format` and sampling become a `ChatTurn`; its answer is a
`chat.completion` (or, with `stream`, `chat.completion.chunk` events and `data: [DONE]`), with the
reply's calls as `tool_calls` (written by the model in its own call format, held by the grammar to a
tool and arguments its schema accepts), a thinking model's thought as `reasoning_content`, and
`usage.prompt_tokens_details.cached_tokens`: the prompt tokens the session's KV cache already held.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, Literal

from pydantic import Field

from ..host.protocol import DEFAULT_THINKING_TOKENS, Message, Reply, ToolCall, Usage
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

# A thinking budget per `reasoning_effort` (none: no thought).
EFFORT = {
    "none": 0,
    "minimal": 256,
    "low": 1024,
    "medium": DEFAULT_THINKING_TOKENS,
    "high": 4 * DEFAULT_THINKING_TOKENS,
}


class Function(Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(Lenient):
    type: Literal["function"]
    function: Function


class CallFunction(Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class Call(Lenient):
    id: str = ""
    type: Literal["function"] = "function"
    function: CallFunction


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[Call] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # mlx_lm.server's and OpenRouter's name for it


class JsonSchemaFormat(Lenient):
    name: str = "answer"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class NamedTool(Lenient):
    type: Literal["function"] = "function"
    function: dict[str, Any]


class StreamOptions(Lenient):
    include_usage: bool = False


class ChatRequest(Lenient):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)  # not OpenAI's; llama.cpp's and vLLM's (`extra_body`)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def parse_chat(body: dict[str, Any]) -> ChatShape:
    """The request as a turn and the shape of its answer; what is wrong is one `ApiError` naming the field."""
    request = validated(ChatRequest, body, "Chat Completions")
    _refuse_unserved(request)
    tools, choice = _tools(request)
    thinking = EFFORT[request.reasoning_effort] if request.reasoning_effort else DEFAULT_THINKING_TOKENS
    if (request.chat_template_kwargs or {}).get("enable_thinking") is False:
        thinking = 0
    stop = stop_sequences([request.stop] if isinstance(request.stop, str) else request.stop or [], "stop")
    turn = ChatTurn(
        model=request.model,
        messages=chat_messages(request.messages),
        tools=tools if choice != "none" else None,
        max_tokens=request.max_completion_tokens or request.max_tokens,
        temperature=request.temperature if request.temperature is not None else 0.0,
        top_p=request.top_p or 1.0,
        top_k=request.top_k or 0,
        seed=request.seed,
        stop=stop,
        thinking=thinking,
        answer_schema=_answer_schema(request.response_format),
        tool_choice=choice if choice != "none" else "auto",
        stream=request.stream,
        schema_fields=schema_fields(tools, "tools[{}].function.parameters", "response_format.json_schema.schema"),
    )
    single = request.parallel_tool_calls is False
    return ChatShape(turn, request.stream_options is not None and request.stream_options.include_usage, single)


def _refuse_unserved(request: ChatRequest) -> None:
    """Refuse, in one line naming the field, what asks for an answer this server does not make: a
    client that sent it would otherwise get another answer than it asked for, and not know it. What
    only tunes how an answer is served (`store`, `user`, `service_tier`, `prediction`) is left out."""
    checks = [
        ("n", (request.n or 1) > 1, f"{request.n} answers to one request are not made here; send 1 or leave n out"),
        ("logprobs", bool(request.logprobs), "logprobs are not returned by this server; leave logprobs out"),
        ("top_logprobs", bool(request.top_logprobs), "logprobs are not returned by this server; leave it out"),
        ("presence_penalty", bool(request.presence_penalty), "not applied by this server; send 0 or leave it out"),
        ("frequency_penalty", bool(request.frequency_penalty), "not applied by this server; send 0 or leave it out"),
        ("logit_bias", bool(request.logit_bias), "not applied by this server; leave it out"),
        (
            "modalities",
            any(m != "text" for m in request.modalities or ()),
            "only text answers are made by this server; send ['text'] or leave modalities out",
        ),
        ("audio", request.audio is not None, "audio answers are not made by this server; leave audio out"),
        (
            "web_search_options",
            request.web_search_options is not None,
            "web search is a server tool, which this server does not run; leave it out",
        ),
        ("functions", request.functions is not None, "the legacy functions are not read here; send them as tools"),
        (
            "function_call",
            request.function_call is not None,
            "the legacy function_call is not read here; send it as tool_choice",
        ),
    ]
    for field, asked, why in checks:
        if asked:
            raise ApiError(400, f"{field}: {why}", field)
    refuse_prefill(request.messages)


def _tools(request: ChatRequest) -> tuple[list[dict[str, Any]] | None, str]:
    made = [
        function_tool(t.function.name, t.function.description, t.function.parameters, f"tools[{i}].function")
        for i, t in enumerate(request.tools or [])
    ]
    tools = named_once(made, "tools[{}].function.name")
    choice = request.tool_choice
    if isinstance(choice, NamedTool):
        return tools or None, chosen_tool(str(choice.function.get("name")), tools, "tool_choice")
    if choice == "required":
        return tools or None, chosen_tool("required", tools, "tool_choice")
    return tools or None, choice or "auto"


def _answer_schema(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "object"}
    given = response_format.json_schema
    if given is None or given.schema_ is None:
        raise ApiError(
            400, "response_format.json_schema.schema is missing; send the JSON schema of the answer", "response_format"
        )
    return answer_schema(given.schema_, "response_format.json_schema.schema")


def chat_messages(messages: list[ChatMessage]) -> list[Message]:
    """The conversation as the host renders it: text content, calls with their arguments as objects,
    leading system and developer messages in one system message."""
    out: list[Message] = []
    names: dict[str, str] = {}  # call id -> function name, for the tool results
    for i, m in enumerate(messages):
        text = _text(m.content, f"messages[{i}].content")
        if m.role in ("system", "developer"):
            if out and out[-1]["role"] == "system" and len(out) == 1:
                out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
            else:
                out.append({"role": "system", "content": text})
        elif m.role == "user":
            out.append({"role": "user", "content": text})
        elif m.role == "tool":
            result: Message = {"role": "tool", "content": text, "tool_call_id": m.tool_call_id or ""}
            if m.tool_call_id in names:
                result["name"] = names[m.tool_call_id or ""]
            out.append(result)
        else:
            message: Message = {"role": "assistant", "content": text}
            if reasoning := m.reasoning_content or m.reasoning:
                message["reasoning_content"] = reasoning
            if m.tool_calls:
                message["tool_calls"] = [_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]
                names.update({c.id: c.function.name for c in m.tool_calls})
            out.append(message)
    return out


def _text(content: str | list[dict[str, Any]] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type", "untyped")
            raise ApiError(400, f"{where}[{j}]: {kind} parts are not read by this server; send text", where)
        parts.append(part["text"])
    return "\n".join(parts)


def _call(call: Call, where: str) -> dict[str, Any]:
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            raise ApiError(
                400, f"{where}.function.arguments is not valid JSON ({exc}); send the arguments the call had", where
            ) from None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{where}.function.arguments is not a JSON object; send the arguments the call had", where)
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


class ChatShape:
    """The answer to one request: a `chat.completion`, or its chunks."""

    def __init__(self, turn: ChatTurn, include_usage: bool, single_call: bool) -> None:
        self.turn, self.include_usage, self.single_call = turn, include_usage, single_call
        self.id = f"chatcmpl-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self._opened = False

    def whole(self, finished: Finished) -> dict[str, Any]:
        reply = finished.reply
        calls = self._calls(reply)
        message: dict[str, Any] = {"role": "assistant", "content": visible_content(reply) or None}
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if calls:
            message["tool_calls"] = calls
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": self._finish(reply, calls)}
        return {**self._head("chat.completion"), "choices": [choice], "usage": usage(reply.usage)}

    def on(self, event: Event) -> list[tuple[str | None, Any]]:
        out = [] if self._opened else [(None, self._chunk({"role": "assistant", "content": ""}))]
        self._opened = True
        if isinstance(event, TextDelta):
            out.append((None, self._chunk({"content": event.text})))
        elif isinstance(event, ReasoningDelta):
            out.append((None, self._chunk({"reasoning_content": event.text})))
        elif isinstance(event, Finished):
            reply = event.reply
            calls = self._calls(reply)
            extra = "\n".join(bad.raw for bad in reply.malformed_tool_calls)
            if extra:
                out.append((None, self._chunk({"content": extra})))
            if calls:
                out.append((None, self._chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})))
            out.append((None, self._chunk({}, self._finish(reply, calls))))
            if self.include_usage:
                out.append((None, {**self._head("chat.completion.chunk"), "choices": [], "usage": usage(reply.usage)}))
        elif isinstance(event, PrefillBegun):
            pass  # the role chunk above: the prompt is admitted
        return out

    def end(self) -> list[tuple[str | None, Any]]:
        return [(None, "[DONE]")]

    def error(self, error: ApiError) -> list[tuple[str | None, Any]]:
        return [(None, error.body("openai")), (None, "[DONE]")]

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.turn.model}

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        chunk = {**self._head("chat.completion.chunk"), "choices": [choice]}
        return {**chunk, "usage": None} if self.include_usage else chunk

    def _calls(self, reply: Reply) -> list[dict[str, Any]]:
        calls = reply.tool_calls[:1] if self.single_call else reply.tool_calls
        return [openai_call(c) for c in calls]

    @staticmethod
    def _finish(reply: Reply, calls: list[dict[str, Any]]) -> str:
        if calls:
            return "tool_calls"
        return "length" if reply.finish_reason == "length" else "stop"


def openai_call(call: ToolCall) -> dict[str, Any]:
    """A call as OpenAI writes it: an id of its own, the arguments as a JSON string."""
    arguments = json.dumps(call.arguments, ensure_ascii=False)
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }


def usage(used: Usage) -> dict[str, Any]:
    """OpenAI's usage: the prompt's tokens, of which cached, and the reply's."""
    return {
        "prompt_tokens": used.prompt_tokens,
        "completion_tokens": used.generated_tokens,
        "total_tokens": used.prompt_tokens + used.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": used.cached_tokens},
    }


__all__ = ["ChatShape", "chat_messages", "parse_chat", "usage"]
