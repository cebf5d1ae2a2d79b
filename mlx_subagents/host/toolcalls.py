"""Split a reply into visible text and tool calls, with mlx-lm's own parsers.

The tokenizer wrapper knows the model's tool-call markers and parser
(`json_tools` for Qwen/Hermes, `qwen3_coder`, `mistral`, ...). A call that
does not parse is returned as a `MalformedToolCall`, never raised.
"""

from __future__ import annotations

import json
from typing import Any

from .protocol import MalformedToolCall, ToolCall, ToolSchema


def _to_call(parsed: Any, index: int) -> ToolCall:
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        raise ValueError('a tool call must be an object with a "name" string and an "arguments" object')
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = json.loads(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise ValueError('"arguments" must be a JSON object')
    return ToolCall(name=parsed["name"], arguments=arguments, id=f"call_{index}")


def _parse_one(tokenizer: Any, raw: str, tools: list[ToolSchema] | None, index: int) -> list[ToolCall]:
    parsed = tokenizer.tool_parser(raw, tools)
    items = parsed if isinstance(parsed, list) else [parsed]
    return [_to_call(item, index + i) for i, item in enumerate(items)]


def parse_reply(
    tokenizer: Any, text: str, tools: list[ToolSchema] | None, first_index: int = 0
) -> tuple[str, list[ToolCall], list[MalformedToolCall]]:
    """(visible text, tool calls, malformed calls) of one generated reply."""
    start = getattr(tokenizer, "tool_call_start", None) if getattr(tokenizer, "has_tool_calling", False) else None
    end = tokenizer.tool_call_end if start else None
    if not start or start not in text:
        return text.strip(), [], []
    visible: list[str] = []
    calls: list[ToolCall] = []
    malformed: list[MalformedToolCall] = []
    rest = text
    while start in rest:
        before, _, after = rest.partition(start)
        visible.append(before)
        if end and end in after:
            raw, _, rest = after.partition(end)
        else:
            raw, rest = after, ""
            if end:
                malformed.append(MalformedToolCall(raw=start + raw, error=f"the tool call has no closing {end}"))
                continue
        try:
            calls.extend(_parse_one(tokenizer, raw, tools, first_index + len(calls)))
        except Exception as exc:
            malformed.append(MalformedToolCall(raw=start + raw + (end or ""), error=f"{type(exc).__name__}: {exc}"))
    visible.append(rest)
    return "".join(visible).strip(), calls, malformed
