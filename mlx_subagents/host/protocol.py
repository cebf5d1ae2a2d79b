"""The seam between sessions and model hosts: result types and the host protocol.

The host knows tokens and caches, not agents; sessions see only these types. It imports only
the package's vocabulary (`results.ToolMode`), never a layer above.
Messages are OpenAI-style chat dicts (`role`, `content`, `tool_calls`,
`tool_call_id`), which is what Hugging Face chat templates render.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from ..results import ToolMode

Message = dict[str, Any]
ToolSchema = dict[str, Any]
TextCallback = Callable[[str], None]
FinishReason = Literal["stop", "length", "cancelled"]
Constrained = Literal["calls", "answer"] | None  # what a grammar held a reply to (see `Reply`)
# Tokens a reply may think before the host closes the thought; 0 turns thinking off.
DEFAULT_THINKING_TOKENS = 4096
# The window per session when nothing (the engine's listing, a script, `--context-window`) says
# otherwise, and the MLX host's cap on a model's own: models advertise 128k-256k tokens, and a
# 16 GB Mac cannot hold that much KV for several sessions. Every engine worth running for agents
# serves this much.
DEFAULT_CONTEXT_WINDOW = 32768


@dataclass(frozen=True)
class ToolCall:
    """A tool call parsed from the model's output."""

    name: str
    arguments: dict[str, Any]
    id: str = ""

    def to_message_part(self) -> dict[str, Any]:
        """The `tool_calls` entry of an assistant message, as chat templates expect."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class MalformedToolCall:
    """Tool-call markup the parser could not read; `error` is the whole message the model
    reads next, the fix in its own call format included."""

    raw: str
    error: str


@dataclass(frozen=True)
class Usage:
    """Token accounting for one reply.

    `prompt_tokens = cached_tokens + prefilled_tokens`: cached tokens were reused
    from the session's KV cache, prefilled tokens were computed this turn. A reply cancelled
    before its prompt was all read counts the prompt tokens it went through.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    # Time the turn spent while other sessions' prompts were prefilled (a stall of its decoding, or a
    # wait of its own prefill): what sharing the model with them cost it.
    prefill_wait_seconds: float = 0.0
    # Tokens drafted to be verified in one forward with others (`host/mlx/drafts.py`), and of those the
    # ones the model kept: each kept one is a forward saved.
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def generation_tps(self) -> float:
        return self.generated_tokens / self.generation_seconds if self.generation_seconds else 0.0


@dataclass(frozen=True)
class Reply:
    """One model reply: visible text, structured tool calls, the reasoning before them, and accounting.

    `reasoning` is what a thinking model wrote inside its thought markers: never part of
    `text`, and a tool call written there is not in `tool_calls`. `constrained` says what a
    grammar held to its format: "calls" (each started call) or "answer" (the reply was the
    answer, held to its schema); None when nothing was.
    """

    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    malformed_tool_calls: list[MalformedToolCall] = field(default_factory=list)
    finish_reason: FinishReason = "stop"
    usage: Usage = field(default_factory=Usage)
    raw_text: str = ""
    token_ids: tuple[int, ...] = ()
    reasoning: str = ""
    constrained: Constrained = None

    def to_message(self) -> Message:
        """The assistant message to append to the conversation.

        The reasoning goes in `reasoning_content`, where Qwen3-style templates read it back
        (for the turns after the last user message), so the re-rendered prompt matches the cache.
        """
        # A malformed call stays visible, so the error the model gets refers to its own words.
        content = "\n".join([self.text, *(bad.raw for bad in self.malformed_tool_calls)]).strip()
        message: Message = {"role": "assistant", "content": content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [c.to_message_part() for c in self.tool_calls]
        return message


@dataclass(frozen=True)
class TextDelta:
    """A piece of the reply's visible text as it is generated (no call markup, no reasoning)."""

    text: str
    kind: Literal["text"] = "text"


@dataclass(frozen=True)
class ReasoningDelta:
    """A piece of what a thinking model writes inside its thought, as it is generated."""

    text: str
    kind: Literal["reasoning"] = "reasoning"


@dataclass(frozen=True)
class PrefillBegun:
    """The host begins prefilling the prompt: the `tokens` it computes now and those its cache already
    holds (`cached`); a live view says "prefilling N tokens"."""

    tokens: int
    cached: int
    kind: Literal["prefill"] = "prefill"


@dataclass(frozen=True)
class TokensSoFar:
    """How many tokens the reply has generated so far (call markup and reasoning included), as they
    stream, so that a view can show a decode rate."""

    n: int
    kind: Literal["tokens"] = "tokens"


# What a host reports of a reply while it is made, in order: its prefill, then its text, reasoning and
# token counts as they stream. A new event is one class here, one place a host emits it and one reader
# (`agents/session.py`); `kind` tells them apart.
HostEvent = TextDelta | ReasoningDelta | PrefillBegun | TokensSoFar
OnHostEvent = Callable[[HostEvent], None]


@dataclass(frozen=True)
class GenerateArgs:
    """How one reply is generated: its limits, its sampling, and where its host events go.

    Args:
        max_tokens: bounds the reply after a thinking model's thought (see `thinking`).
        temperature: the sampling temperature; 0 decodes greedily.
        top_p: sample from the smallest set of tokens whose probabilities add up to this (1: all).
        top_k: sample from the `top_k` most likely tokens only (0: all).
        seed: seeds the sampler as the reply starts: the same reply to the same prompt while it
            decodes alone (in a batch, best effort: the other rows draw from the same generator).
        on_event: gets the reply's host events (`HostEvent`) on the caller's loop as they happen: its
            prefill, its visible text and reasoning as they are generated, the tokens so far.
        thinking: tokens a thinking model may think (0: off) before the host closes its thought.
        grammar: constrain each tool call, once started, to a known tool and arguments its schema
            accepts, and an answer to `answer_schema` (where the host can: see docs/agents.md).
        answer_schema: the JSON schema the final answer (a reply without a call) must satisfy.
        tool_choice: `auto` (the model decides), `required` (the reply is calls to the tools), or a
            tool's name (the reply is a call to it); held by the grammar.
        store_prompt: keep the conversation's KV, up to the end of these messages, in the host's disk
            tier too, so that a new process (a restarted server) goes on from it: for a client that
            sends the whole conversation again (the chat endpoints'), not an agent's own session.
        thought_in_max_tokens: `max_tokens` bounds the thought and the answer together, as the chat
            APIs' `max_tokens` bounds every generated token: the thought's budget is cut to leave room
            for its end marker and one token of answer (else the thought comes on top of it).
        client_schemas: the tools' and the answer's schemas are a client's (the endpoints'): their grammar
            is built under tighter limits before the turn is admitted, and one it cannot hold within them
            is refused (`GrammarError`), never loosened or decoded without it.
    """

    max_tokens: int = 1024
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    on_event: OnHostEvent | None = None
    thinking: int = DEFAULT_THINKING_TOKENS
    grammar: bool = True
    answer_schema: dict[str, Any] | None = None
    tool_choice: str = "auto"
    store_prompt: bool = False
    thought_in_max_tokens: bool = False
    client_schemas: bool = False


@runtime_checkable
class HostSession(Protocol):
    """One conversation's handle on the host: its own KV cache, reused across turns.

    `cut`: what the last reply spent (tokens prefilled and generated) when cancelling `generate`
    (a timeout, Ctrl-C) cut it short; set before the cancellation propagates, None otherwise.
    """

    name: str
    cut: Usage | None

    async def generate(
        self, messages: list[Message], args: GenerateArgs = GenerateArgs(), *, tools: list[ToolSchema] | None = None
    ) -> Reply:
        """One reply to `messages`, with `tools` offered, generated as `args` says."""
        ...

    @property
    def kv_bytes(self) -> int: ...

    async def close(self) -> None: ...


@runtime_checkable
class ModelHost(Protocol):
    """A resident model serving any number of sessions, one model call at a time."""

    model_id: str

    @property
    def context_window(self) -> int: ...

    @property
    def tool_mode(self) -> ToolMode: ...

    @property
    def thinks(self) -> bool:
        """Whether its model thinks before it answers: where a thinking budget applies."""
        ...

    def session(self, name: str, *, agent: str | None = None, fork_of: str = "") -> HostSession:
        """The session `name` (a new one, or the existing one with its cache). `fork_of`: a new session
        that starts where that session is (a fork); a host may reuse that session's cache for it."""
        ...

    async def count_tokens(
        self, messages: list[Message], tools: list[ToolSchema] | None = None, *, thinking: int = DEFAULT_THINKING_TOKENS
    ) -> int:
        """Tokens of the prompt these messages render to, as a turn with this `thinking` budget renders them."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


# A factory the host calls once per request to get fresh logits processors
# (used by tests to force a script through the real inference path).
ProcessorFactory = Callable[[str, list[int]], list[Callable[..., Any]]]
