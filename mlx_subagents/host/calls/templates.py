"""What a chat template accepts, found by rendering probes at load, and conversations normalised to it.

Templates differ: Gemma's raises on a `system` message and on anything but strict
user/assistant alternation, many drop `tools` silently, some reject the `tool`
role. The host renders a few probe conversations once, at load, and rewrites every
conversation into what the template accepts, so no template exception reaches the user.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from ..protocol import Message, ToolSchema
from .prompt import render
from .toolcalls import EXAMPLE_CALL

# Probe text no template writes by itself.
_MARK = "zq7-probe"
_PROBE_TOOL: ToolSchema = {
    "type": "function",
    "function": {
        "name": f"{_MARK}-tool",
        "description": "Probe.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}
_USER: Message = {"role": "user", "content": "Hello."}


def _assistant_call(name: str, arguments: dict[str, Any], call_id: str = "call_0") -> Message:
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def short_call_id(call_id: str) -> str:
    """A stable 9-character alphanumeric stand-in for a call id, for templates that demand one."""
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


@dataclass(frozen=True)
class TemplateTraits:
    """What the template renders (False: it raised, or left the probe text out)."""

    system: bool = True
    tool_role: bool = True
    alternating: bool = False  # only user/assistant/user/... (Gemma)
    tools: bool = True  # renders a tool list
    tool_calls: bool = True  # renders an assistant message's tool calls
    reasoning: bool = False  # renders an assistant message's `reasoning_content` (a thinking model's template)
    short_call_ids: bool = False  # only with 9-character alphanumeric call ids (Mistral)


def _shows(tokenizer: Any, messages: list[Message], needle: str, tools: list[ToolSchema] | None = None) -> bool:
    try:
        return needle in render(tokenizer, messages, tools, generation_prompt=True)
    except Exception:  # a template's raise_exception, or any failure to render: not accepted
        return False


def probe_template(tokenizer: Any) -> TemplateTraits:
    """Render one probe conversation per trait."""
    name = f"{_MARK}-call"
    tool_calls = _shows(tokenizer, [_USER, _assistant_call(name, {"path": "."})], name, [_PROBE_TOOL])
    short_ids = not tool_calls and _shows(
        tokenizer, [_USER, _assistant_call(name, {"path": "."}, short_call_id("call_0"))], name, [_PROBE_TOOL]
    )
    call_id = short_call_id("call_0") if short_ids else "call_0"
    result = {"role": "tool", "tool_call_id": call_id, "content": _MARK}
    return TemplateTraits(
        system=_shows(tokenizer, [{"role": "system", "content": f"{_MARK}-system"}, _USER], f"{_MARK}-system"),
        tool_role=_shows(tokenizer, [_USER, _assistant_call(name, {"path": "."}, call_id), result], _MARK),
        alternating=not _shows(tokenizer, [_USER, {"role": "user", "content": f"{_MARK}-again"}], f"{_MARK}-again"),
        tools=_shows(tokenizer, [_USER], f"{_MARK}-tool", [_PROBE_TOOL]),
        tool_calls=tool_calls or short_ids,
        short_call_ids=short_ids,
        reasoning=_shows(
            tokenizer,
            [_USER, {**_assistant_call(name, {"path": "."}, call_id), "reasoning_content": f"{_MARK}-thought"}],
            f"{_MARK}-thought",
        ),
    )


def opens_thought(tokenizer: Any, think: Any, enable_thinking: bool) -> bool:
    """Whether the generation prompt ends inside a thought (Qwen3.5 writes `<think>\n` there when thinking
    is on, and an empty closed thought when it is off)."""
    try:
        text = render(
            tokenizer, [_USER], None, generation_prompt=True, template_kwargs={"enable_thinking": enable_thinking}
        )
    except Exception:
        return False
    return text.rfind(think.start) > text.rfind(think.end)


def example_call(tokenizer: Any, traits: TemplateTraits, start: str, end: str) -> str | None:
    """`EXAMPLE_CALL` as this template writes it in an assistant turn, from `start` to `end`."""
    user = [_USER]
    call = _assistant_call(**EXAMPLE_CALL, call_id=short_call_id("call_0") if traits.short_call_ids else "call_0")
    try:
        before = render(tokenizer, user, [_PROBE_TOOL], generation_prompt=True)
        after = render(tokenizer, [*user, call], [_PROBE_TOOL], generation_prompt=False)
    except Exception:
        return None
    at = after.find(start, len(before) if after.startswith(before) else 0)
    if at < 0:
        return None
    text = after[at:]
    stop = text.find(end, len(start)) + len(end) if end and end in text[len(start) :] else -1
    if stop < 0:  # the call runs to the end of the turn
        eos = tokenizer.eos_token or ""
        stop = text.find(eos) if eos and eos in text else len(text)
    return text[:stop].strip() or None


def tool_output(content: str) -> str:
    """A tool result written into a user message, marked as tool output (Qwen and Hermes mark it so)."""
    return f"<tool_response>\n{content}\n</tool_response>"


def normalise(messages: list[Message], traits: TemplateTraits, *, tool_results_as_user: bool) -> list[Message]:
    """The conversation in a shape the template accepts; the input is left unchanged.

    Tool results become user messages marked as tool output (when asked, or when
    the template rejects the `tool` role; consecutive ones join in one message),
    a system message the template rejects is folded into the user message after
    it, and under strict alternation consecutive messages of one role are merged.
    """
    out: list[Message] = []
    for message in messages:
        if traits.short_call_ids:
            message = _with_short_ids(message)
        role = message.get("role")
        if role == "tool" and (tool_results_as_user or not traits.tool_role):
            message = {"role": "user", "content": tool_output(str(message.get("content") or "")), "_from": "tool"}
        elif role == "system" and not traits.system:
            message = {"role": "user", "content": str(message.get("content") or ""), "_from": "system"}
        if out and _joins(out[-1], message, traits):
            out[-1] = _merged(out[-1], message)
        else:
            out.append(dict(message))
    for message in out:
        message.pop("_from", None)
    return out


def _with_short_ids(message: Message) -> Message:
    if message.get("tool_call_id"):
        return {**message, "tool_call_id": short_call_id(message["tool_call_id"])}
    if message.get("tool_calls"):
        calls = [{**c, "id": short_call_id(c["id"])} if c.get("id") else c for c in message["tool_calls"]]
        return {**message, "tool_calls": calls}
    return message


def _joins(last: Message, message: Message, traits: TemplateTraits) -> bool:
    if last["role"] != message["role"]:
        return False
    return traits.alternating or last.get("_from") == "system" or last.get("_from") == message.get("_from") == "tool"


def _merged(a: Message, b: Message) -> Message:
    merged = {**a, "content": "\n\n".join(c for c in (a.get("content") or "", b.get("content") or "") if c)}
    merged["_from"] = b.get("_from")
    calls = [*(a.get("tool_calls") or []), *(b.get("tool_calls") or [])]
    if calls:
        merged["tool_calls"] = calls
    return merged
