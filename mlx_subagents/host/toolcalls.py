"""Tool-call formats: split a reply into text and calls, hide the markup while streaming.

A `CallFormat` is a pair of markers and a parser from mlx-lm's `tool_parsers`
(`json_tools` for Qwen/Hermes `<tool_call>`, `qwen3_coder`, `mistral`, ...): a
native model uses the one mlx-lm found for its tokenizer, a prompted model the
Hermes format the host teaches it. A call that does not parse comes back as a
`MalformedToolCall` whose error says how to write it in this format, never raised.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .protocol import MalformedToolCall, TextCallback, ToolCall, ToolSchema

Parser = Callable[[str, Any], Any]
# The call an error's fix shows, in the model's own format.
EXAMPLE_CALL = {"name": "tool_name", "arguments": {"argument": "value"}}


def hermes_call(name: str, arguments: Mapping[str, Any]) -> str:
    """One call in the Hermes format (what Qwen's template writes, and prompted models are taught)."""
    body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


@dataclass(frozen=True)
class CallFormat:
    """How one model writes tool calls.

    Args:
        start, end: the markers around a call (`end` is empty where a call runs to the
            end of the reply, as with Mistral's `[TOOL_CALLS]`).
        parser: mlx-lm's `parse_tool_call(text, tools)` for the text between them.
        example: `EXAMPLE_CALL` written in this format, for the fix in an error.
    """

    start: str
    end: str
    parser: Parser
    example: str

    @classmethod
    def native(cls, tokenizer: Any, example: str | None) -> CallFormat | None:
        """The format mlx-lm's tokenizer wrapper found for this model, or None when it has none."""
        if not getattr(tokenizer, "has_tool_calling", False) or tokenizer.tool_parser is None:
            return None
        start, end = tokenizer.tool_call_start, tokenizer.tool_call_end or ""
        body = json.dumps(EXAMPLE_CALL, ensure_ascii=False)
        return cls(start, end, tokenizer.tool_parser, example or f"{start}{body}{end}")

    def split(
        self, text: str, tools: list[ToolSchema] | None, first_index: int = 0
    ) -> tuple[str, list[ToolCall], list[MalformedToolCall]]:
        """(visible text, tool calls, malformed calls) of one generated reply."""
        start, end = self.start, self.end
        if start not in text:
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
                    malformed.append(MalformedToolCall(start + raw, self.error(f"the call has no closing {end}")))
                    continue
            try:
                calls.extend(self._parse(raw, tools, first_index + len(calls)))
            except Exception as exc:
                malformed.append(MalformedToolCall(start + raw + end, self.error(f"{type(exc).__name__}: {exc}")))
        visible.append(rest)
        return "".join(visible).strip(), calls, malformed

    def visible_text(self, on_text: TextCallback) -> VisibleText:
        """A callback for streamed text that passes on only what is not call markup."""
        return VisibleText(on_text, self.start, self.end)

    def _parse(self, raw: str, tools: list[ToolSchema] | None, index: int) -> list[ToolCall]:
        parsed = self.parser(raw, tools)
        items = parsed if isinstance(parsed, list) else [parsed]
        return [_to_call(item, index + i) for i, item in enumerate(items)]

    def error(self, reason: str) -> str:
        """What the model reads about a call that did not parse: the reason, then the fix."""
        return (
            f"Error: your tool call could not be parsed ({reason}). "
            f"Write each call exactly in this format, with the tool's own name and arguments:\n{self.example}"
        )


@lru_cache(maxsize=1)
def hermes() -> CallFormat:
    """The one format a prompted model is taught: `<tool_call>{"name": ..., "arguments": ...}</tool_call>`."""
    from mlx_lm.tool_parsers import json_tools

    example = hermes_call(EXAMPLE_CALL["name"], EXAMPLE_CALL["arguments"])  # type: ignore[arg-type]
    return CallFormat(json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call, example)


def _to_call(parsed: Any, index: int) -> ToolCall:
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        raise ValueError('a tool call must be an object with a "name" string and an "arguments" object')
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = json.loads(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise ValueError('"arguments" must be a JSON object')
    return ToolCall(name=parsed["name"], arguments=arguments, id=f"call_{index}")


class VisibleText:
    """Streams a reply without its tool-call markup, holding back what may be the start of a marker.

    mlx-lm's `TextStateMachine` (what its server uses to route text, reasoning and
    calls) matches the markers on decoded text, so a marker split across tokens is
    still found. Call `flush` when the reply ends: held-back text that never became
    a marker is passed on then.
    """

    def __init__(self, on_text: TextCallback, start: str, end: str) -> None:
        from mlx_lm.generate import TextStateMachine

        self._on_text = on_text
        machine = TextStateMachine({"normal": [(start, "call")], "call": [(end, "normal")] if end else []})
        self._state = machine.make_state("normal")

    def __call__(self, text: str) -> None:
        from mlx_lm.generate import TextStateMachine

        self._state, segments = TextStateMachine.split(self._state, text)
        self._emit("".join(chunk for state, chunk in segments if state == "normal"))

    def flush(self) -> None:
        from mlx_lm.generate import TextStateMachine

        self._state, rest, state = TextStateMachine.flush(self._state)
        self._emit(rest if state == "normal" else "")

    def _emit(self, text: str) -> None:
        if text:
            self._on_text(text)
