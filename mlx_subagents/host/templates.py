"""What a chat template accepts, found by rendering probes at load, and conversations normalised to it.

Templates differ: Gemma's raises on a `system` message and on anything but strict
user/assistant alternation, many drop `tools` silently, some reject the `tool`
role. The host renders a few probe conversations once, at load, and rewrites every
conversation into what the template accepts, so no template exception reaches the user.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .prompt import render
from .protocol import Message, ToolSchema
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


def _assistant_call(name: str, arguments: dict[str, Any]) -> Message:
    call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


@dataclass(frozen=True)
class TemplateTraits:
    """What the template renders (False: it raised, or left the probe text out)."""

    system: bool = True
    tool_role: bool = True
    alternating: bool = False  # only user/assistant/user/... (Gemma)
    tools: bool = True  # renders a tool list
    tool_calls: bool = True  # renders an assistant message's tool calls


def _shows(tokenizer: Any, messages: list[Message], needle: str, tools: list[ToolSchema] | None = None) -> bool:
    try:
        return needle in render(tokenizer, messages, tools, generation_prompt=True)
    except Exception:  # a template's raise_exception, or any failure to render: not accepted
        return False


def probe_template(tokenizer: Any) -> TemplateTraits:
    """Render one probe conversation per trait."""
    call = _assistant_call(f"{_MARK}-call", {"path": "."})
    return TemplateTraits(
        system=_shows(tokenizer, [{"role": "system", "content": f"{_MARK}-system"}, _USER], f"{_MARK}-system"),
        tool_role=_shows(tokenizer, [_USER, call, {"role": "tool", "tool_call_id": "call_0", "content": _MARK}], _MARK),
        alternating=not _shows(tokenizer, [_USER, {"role": "user", "content": f"{_MARK}-again"}], f"{_MARK}-again"),
        tools=_shows(tokenizer, [_USER], f"{_MARK}-tool", [_PROBE_TOOL]),
        tool_calls=_shows(tokenizer, [_USER, call], f"{_MARK}-call", [_PROBE_TOOL]),
    )


def example_call(tokenizer: Any, start: str, end: str) -> str | None:
    """`EXAMPLE_CALL` as this template writes it in an assistant turn, from `start` to `end`."""
    user = [_USER]
    try:
        before = render(tokenizer, user, [_PROBE_TOOL], generation_prompt=True)
        after = render(tokenizer, [*user, _assistant_call(**EXAMPLE_CALL)], [_PROBE_TOOL], generation_prompt=False)
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
