"""How one model gets its tools and conversation, and how its replies split: decided once, at load.

`native`: the chat template renders a tool list and mlx-lm has a parser for the
model's call markers; the template's own instructions are the only ones the model
gets. `prompted`: the template drops or rejects `tools`, so the tool list and one
call format (Hermes `<tool_call>` JSON, which most open models were trained on) go
into the system prompt, byte-identical every turn so the cached prefix survives,
and the host parses that format itself. Either way the conversation is normalised
to what the template accepts (see `templates.py`). A thinking model's markers and
whether its generation prompt opens a thought (with thinking on, and off) are
probed here too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ChatTemplateError
from ..protocol import MalformedToolCall, Message, OnHostEvent, ToolCall, ToolMode, ToolSchema
from .formats import kind_of
from .formats.hermes import hermes, hermes_call
from .templates import TemplateTraits, example_call, normalise, opens_thought, probe_template
from .toolcalls import CallFormat, ThinkMarkers, VisibleText, split_reasoning

PROMPTED_TOOLS_HEADER = "# Tools\n\nYou can call these tools; their JSON schemas:\n<tools>\n"
PROMPTED_TOOLS_FOOTER = (
    "\n</tools>\n\n"
    "To call a tool, write the call in this format (one block per call):\n"
    '<tool_call>\n{"name": "<tool name>", "arguments": {<the arguments as a JSON object>}}\n</tool_call>\n'
    "Each result comes back to you inside <tool_response></tool_response>."
)


def prompted_tools(tools: list[ToolSchema]) -> str:
    """The tool list and call format for the system prompt: the same bytes for the same tools."""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return f"{PROMPTED_TOOLS_HEADER}{lines}{PROMPTED_TOOLS_FOOTER}"


@dataclass(frozen=True)
class ChatFormat:
    """The model's tool mode, what its template accepts, its call format and thought markers.

    `opens`: whether the generation prompt ends inside a thought, with thinking on and off.
    """

    tool_mode: ToolMode
    traits: TemplateTraits
    calls: CallFormat
    think: ThinkMarkers | None = None
    opens: tuple[bool, bool] = (False, False)

    @classmethod
    def load(cls, tokenizer: Any, model: str) -> ChatFormat:
        """Probe the template; a model without one is refused (there is no chat to render)."""
        if not getattr(tokenizer, "has_chat_template", False):
            raise ChatTemplateError(
                f"model {model} has no chat template (no chat_template in tokenizer_config.json or "
                "chat_template.jinja); use an instruct/chat version of the model"
            )
        traits = probe_template(tokenizer)
        think = ThinkMarkers.of(tokenizer)
        opens = (
            (opens_thought(tokenizer, think, True), opens_thought(tokenizer, think, False)) if think else (False, False)
        )
        if traits.tools and traits.tool_calls:
            start, end = getattr(tokenizer, "tool_call_start", None), getattr(tokenizer, "tool_call_end", None)
            example = example_call(tokenizer, traits, start, end or "") if start else None
            native = CallFormat.native(tokenizer, example)
            if native is not None:
                return cls("native", traits, native, think, opens)
        return cls("prompted", traits, hermes(), think, opens)

    @property
    def thinks(self) -> bool:
        """A thinking model: markers in its vocabulary and a template that opens a thought or renders one.

        (Instruct models that share a thinking vocabulary but never think get no budget.)
        """
        return self.think is not None and (self.opens[0] or self.traits.reasoning)

    @property
    def grammar_kind(self) -> str | None:
        """The call format of this model's calls that has a grammar (`formats/`): Hermes JSON (also the
        prompted mode's), Qwen3-Coder XML or Mistral; None for another, whose calls and answers stay free."""
        return kind_of(self.calls.parser) if self.calls.start else None

    def opened(self, thinking: int) -> bool:
        """Whether a reply starts inside a thought, with this budget (0: thinking off)."""
        return self.opens[0] if thinking else self.opens[1]

    def present(
        self, messages: list[Message], tools: list[ToolSchema] | None
    ) -> tuple[list[Message], list[ToolSchema] | None]:
        """The messages and tools to render through the template for this conversation."""
        if self.tool_mode == "native":
            return normalise(messages, self.traits, tool_results_as_user=False), tools or None
        return normalise(_with_prompted_tools(messages, tools), self.traits, tool_results_as_user=True), None

    def split(
        self, text: str, tools: list[ToolSchema] | None, first_index: int = 0, opened: bool = False
    ) -> tuple[str, str, list[ToolCall], list[MalformedToolCall]]:
        """(reasoning, visible text, tool calls, malformed calls) of one raw reply; calls inside the
        reasoning are not calls."""
        reasoning, rest = split_reasoning(text, self.think, opened)
        return (reasoning, *self.calls.split(rest, tools, first_index))

    def visible_text(self, emit: OnHostEvent | None, opened: bool = False) -> VisibleText:
        """Streamed text to `emit` as host events: visible text and reasoning, without call markup."""
        return self.calls.visible_text(emit, self.think, opened)


def read_chat_format(path: Path) -> ChatFormat:
    """A model folder's chat format from its tokenizer files only, without loading the weights
    (for listing models and their tool mode)."""
    from mlx_lm.utils import load_tokenizer

    return ChatFormat.load(load_tokenizer(path), str(path))


def _with_prompted_tools(messages: list[Message], tools: list[ToolSchema] | None) -> list[Message]:
    """Tools into the system prompt; earlier calls written back as the Hermes text they were."""
    out = [_calls_as_text(m) if m.get("tool_calls") else m for m in messages]
    if not tools:
        return out
    block = prompted_tools(tools)
    if out and out[0].get("role") == "system":
        return [{**out[0], "content": f"{out[0].get('content') or ''}\n\n{block}"}, *out[1:]]
    return [{"role": "system", "content": block}, *out]


def _calls_as_text(message: Message) -> Message:
    calls = [c.get("function", c) for c in message["tool_calls"]]
    text = [message.get("content") or "", *(hermes_call(c["name"], _arguments(c.get("arguments"))) for c in calls)]
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": "\n".join(t for t in text if t)}


def _arguments(arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
    return arguments if isinstance(arguments, dict) else {}
