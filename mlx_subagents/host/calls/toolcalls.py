"""Tool-call formats and thought markers: split a reply into reasoning, text and calls, and
route each while streaming.

A `CallFormat` is a pair of markers and a parser from mlx-lm's `tool_parsers`
(`json_tools` for Qwen/Hermes `<tool_call>`, `qwen3_coder`, `mistral`, ...): a
native model uses the one mlx-lm found for its tokenizer, a prompted model the
Hermes format the host teaches it (`formats/hermes.py`; each format with a
grammar has its module in `formats/`). A call that does not parse comes back as a
`MalformedToolCall` whose error says how to write it in this format, never raised.
A thinking model's reasoning (between mlx-lm's `think_start` and `think_end`, which
the prompt may already have opened) is split off first: a call written there is
not a call.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..protocol import MalformedToolCall, OnHostEvent, ReasoningDelta, TextDelta, ToolCall, ToolSchema

Parser = Callable[[str, Any], Any]
# The call an error's fix shows, in the model's own format.
EXAMPLE_CALL = {"name": "tool_name", "arguments": {"argument": "value"}}


@dataclass(frozen=True)
class ThinkMarkers:
    """A thinking model's thought markers (`<think>`/`</think>`, `<|channel>thought`/`<channel|>`, ...)."""

    start: str
    end: str

    @classmethod
    def of(cls, tokenizer: Any) -> ThinkMarkers | None:
        """The markers mlx-lm's tokenizer wrapper found in the vocabulary, or None for a model that does not think."""
        if not getattr(tokenizer, "has_thinking", False):
            return None
        return cls(tokenizer.think_start, tokenizer.think_end)


def split_reasoning(text: str, think: ThinkMarkers | None, opened: bool = False) -> tuple[str, str]:
    """(reasoning, the rest) of a raw reply; `opened`: the prompt ended inside a thought.

    A thought the reply never closed (cut by a limit) is all reasoning.
    """
    if think is None:
        return "", text
    from mlx_lm.generate import TextStateMachine

    machine = TextStateMachine(_transitions(think, None, None))
    state, segments = TextStateMachine.split(machine.make_state("reasoning" if opened else "normal"), text)
    _, rest, last = TextStateMachine.flush(state)
    segments.append((last, rest))
    reasoning = "".join(chunk for name, chunk in segments if name == "reasoning")
    return reasoning.strip(), "".join(chunk for name, chunk in segments if name != "reasoning")


def _transitions(think: ThinkMarkers | None, start: str | None, end: str | None) -> dict[str, list[tuple[str, str]]]:
    """mlx-lm `TextStateMachine` edges: normal <-> reasoning, normal <-> call."""
    edges: dict[str, list[tuple[str, str]]] = {"normal": []}
    if think is not None:
        edges["normal"].append((think.start, "reasoning"))
        edges["reasoning"] = [(think.end, "normal")]
    if start is not None:
        edges["normal"].append((start, "call"))
        edges["call"] = [(end, "normal")] if end else []
    return edges


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

    def visible_text(
        self, emit: OnHostEvent | None, think: ThinkMarkers | None = None, opened: bool = False
    ) -> VisibleText:
        """A callback for streamed text that emits what is neither call markup nor reasoning as text
        (`TextDelta`), and the reasoning as reasoning (`ReasoningDelta`)."""
        return VisibleText(emit, self.start, self.end, think, opened)

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
    """Streams a reply without its tool-call markup as host events, reasoning apart, holding back what
    may be the start of a marker.

    mlx-lm's `TextStateMachine` (what its server uses to route text, reasoning and
    calls) matches the markers on decoded text, so a marker split across tokens is
    still found. Call `flush` when the reply ends: held-back text that never became
    a marker is passed on then.
    """

    def __init__(
        self, emit: OnHostEvent | None, start: str, end: str, think: ThinkMarkers | None = None, opened: bool = False
    ) -> None:
        from mlx_lm.generate import TextStateMachine

        self._emit_event = emit
        machine = TextStateMachine(_transitions(think, start, end))
        self._state = machine.make_state("reasoning" if opened and think is not None else "normal")

    def __call__(self, text: str) -> None:
        from mlx_lm.generate import TextStateMachine

        self._state, segments = TextStateMachine.split(self._state, text)
        for name, chunk in segments:
            self._emit(name, chunk)

    def flush(self) -> None:
        from mlx_lm.generate import TextStateMachine

        self._state, rest, state = TextStateMachine.flush(self._state)
        self._emit(state, rest)

    def _emit(self, state: str | None, text: str) -> None:
        if not text or self._emit_event is None:
            return
        if state == "normal":
            self._emit_event(TextDelta(text))
        elif state == "reasoning":
            self._emit_event(ReasoningDelta(text))
