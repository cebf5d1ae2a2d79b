"""A replay host: scripted replies instead of a model (model id `scripted:PATH`).

It serves fast, deterministic tests of the tool loop and lets a user replay a
session without weights, behind the same `ModelHost`/`HostSession` protocols as
the MLX host. The script is a JSON or YAML file:

    context_window: 32768          # optional
    replies:                       # fallback for every agent
      - tool_calls: [{name: ls, arguments: {path: .}}]
      - {reasoning: "the listing answers it", content: done}   # a thinking model's reply
    agents:                        # optional, per agent; wins over `replies`
      scout:
        replies:
          - raw: "<tool_call>not json</tool_call>"   # a malformed tool call
          - {content: found it, delay: 0.5}          # sleeps 0.5 s first
          - {content: "I will", stall: 60}           # streams "I will", then 60 s before it ends
    sessions:                      # optional, per host session name; wins over `agents`
      scout-2:                     # the second of two parallel scouts (`scout-1`, `scout-2`)
        replies: [the second scout's answer]

A bare list at the top level is shorthand for `{"replies": [...]}`, and a bare
string reply is shorthand for `{"content": "..."}`. Tests build the same host in
memory with `ScriptedHost.from_replies([...])`; `host.history` records what each
session was sent.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mlx_subagents.errors import PromptTooLongError, ScriptError
from mlx_subagents.host.calls.formats.hermes import END as TOOL_CALL_END
from mlx_subagents.host.calls.formats.hermes import START as TOOL_CALL_START
from mlx_subagents.host.calls.formats.hermes import hermes
from mlx_subagents.host.engine.estimate import approx_tokens
from mlx_subagents.host.protocol import (
    DEFAULT_CONTEXT_WINDOW,
    DEFAULT_THINKING_TOKENS,
    GenerateArgs,
    HostEvent,
    MalformedToolCall,
    Message,
    OnHostEvent,
    PrefillBegun,
    ReasoningDelta,
    Reply,
    TextDelta,
    TokensSoFar,
    ToolCall,
    ToolMode,
    ToolSchema,
    Usage,
)
from mlx_subagents.userfiles import TOO_DEEP, data_problem, first_error, load_file

if TYPE_CHECKING:
    from mlx_subagents.host.settings import HostSettings

SCRIPTED_PREFIX = "scripted:"


# --- the script file ---------------------------------------------------------------------------


class ScriptedToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)

    @field_validator("arguments", mode="before")
    @classmethod
    def _json_arguments(cls, value: Any) -> Any:
        # OpenAI-style transcripts carry arguments as a JSON string.
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"arguments is not valid JSON: {exc.msg}") from None
            except RecursionError:
                raise ValueError(TOO_DEEP) from None
            if problem := data_problem(value):
                raise ValueError(problem)
        return value


class ScriptedReply(BaseModel):
    """One model reply: text and/or tool calls, or `raw` malformed tool-call markup; `reasoning` before them."""

    model_config = ConfigDict(extra="forbid")

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ScriptedToolCall] = Field(default_factory=list)
    raw: str | None = None
    delay: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    # Seconds the reply goes on after its reasoning and text have streamed (a model that does not stop):
    # a timeout or Ctrl-C then cuts a reply that has said something.
    stall: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    finish_reason: Literal["stop", "length"] = "stop"

    @model_validator(mode="before")
    @classmethod
    def _string_shorthand(cls, value: Any) -> Any:
        return {"content": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _raw_not_combined(self) -> ScriptedReply:
        if self.raw is not None and (self.content or self.tool_calls):
            raise ValueError("'raw' cannot be combined with 'content' or 'tool_calls'")
        return self


class AgentScript(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replies: list[ScriptedReply]


class Script(BaseModel):
    """The whole file: fallback replies, per-agent replies and the context window."""

    model_config = ConfigDict(extra="forbid")

    replies: list[ScriptedReply] = Field(default_factory=list)
    agents: dict[str, AgentScript] = Field(default_factory=dict)
    # Per host session name: two sessions of one agent (parallel tasks) with different replies.
    sessions: dict[str, AgentScript] = Field(default_factory=dict)
    context_window: int = Field(default=DEFAULT_CONTEXT_WINDOW, gt=0, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _list_shorthand(cls, value: Any) -> Any:
        return {"replies": value} if isinstance(value, list) else value

    @model_validator(mode="after")
    def _has_replies(self) -> Script:
        if not self.replies and not any(a.replies for a in (*self.agents.values(), *self.sessions.values())):
            raise ValueError("the script has no replies: add 'replies' or 'agents.<name>.replies'")
        return self

    def replies_for(self, agent: str | None, session: str = "") -> list[ScriptedReply]:
        """The session's own replies if it has a script, else its agent's, else the top-level ones."""
        if session in self.sessions:
            return self.sessions[session].replies
        if agent is not None and agent in self.agents:
            return self.agents[agent].replies
        return self.replies


def load_script(path: Path) -> Script:
    """Read and validate a script file; any problem is one `ScriptError` line naming the file."""
    fmt = "yaml" if path.suffix.lower() in (".yaml", ".yml") else "json"
    data = load_file(path, fmt, "scripted model file", ScriptError)
    try:
        return Script.model_validate(data)
    except ValidationError as exc:
        raise ScriptError(f"{path}: {_describe(exc)}") from None


def make_script(replies: list[Any], *, agents: dict[str, list[Any]] | None = None) -> Script:
    """Validate replies given in memory (the same shapes as in a file); a problem is one `ScriptError` line."""
    data = {"replies": replies, "agents": {a: {"replies": r} for a, r in (agents or {}).items()}}
    try:
        return Script.model_validate(data)
    except ValidationError as exc:
        raise ScriptError(f"scripted replies: {_describe(exc)}") from None


def _describe(exc: ValidationError) -> str:
    if not exc.errors()[0]["loc"] and exc.errors()[0]["type"] == "model_type":
        return "expected a mapping with 'replies' and/or 'agents' (or a list of replies)"
    return first_error(exc)


def _parse_error(raw: str) -> str:
    """Why `raw` is not a readable tool call, phrased like a parser would."""
    body = raw.strip()
    if body.startswith(TOOL_CALL_START):
        body = body[len(TOOL_CALL_START) :]
    if body.endswith(TOOL_CALL_END):
        body = body[: -len(TOOL_CALL_END)]
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"tool call is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})"
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return "tool call JSON has no string 'name'"
    return "tool call could not be parsed"


# --- host and sessions ---------------------------------------------------------------------------


class ScriptedHost:
    """A `ModelHost` that replays a script (a file, or replies given in memory); no weights, no threads.

    `history[session_name]` lists the message lists each session was sent, in order.
    """

    tool_mode: ToolMode = "native"  # replies arrive as structured calls
    thinks = False  # a scripted reply's reasoning is replayed, never bounded by a budget

    def __init__(self, source: Path | str | Script, *, context_window: int | None = None) -> None:
        if isinstance(source, Script):
            self.path: Path | None = None
            self.script = source
            self.model_id = f"{SCRIPTED_PREFIX}memory"
        else:
            self.path = Path(source)
            self.script = load_script(self.path)
            self.model_id = f"{SCRIPTED_PREFIX}{source}"
        valid = isinstance(context_window, int) and not isinstance(context_window, bool)
        if context_window is not None and not (valid and context_window > 0):
            raise ValueError(f"context_window must be a positive int, got {context_window!r}")
        self._context_window = context_window or self.script.context_window
        self.history: dict[str, list[list[Message]]] = {}

    @classmethod
    def from_replies(
        cls, replies: list[Any], *, agents: dict[str, list[Any]] | None = None, context_window: int | None = None
    ) -> ScriptedHost:
        """A host replaying `replies` (or `agents[agent]` for sessions of that agent), without a file.

        Replies take the file's shapes: `"text"`, `{"content": ..., "tool_calls": [...]}`, `{"raw": ...}`.
        """
        return cls(make_script(replies, agents=agents), context_window=context_window)

    @classmethod
    def from_model_id(cls, model_id: str, *, context_window: int | None = None) -> ScriptedHost:
        """Build from `scripted:PATH`."""
        if not model_id.startswith(SCRIPTED_PREFIX):
            raise ValueError(f"not a scripted model id: {model_id!r}")
        return cls(Path(model_id[len(SCRIPTED_PREFIX) :]), context_window=context_window)

    @classmethod
    def from_settings(cls, model: str, settings: HostSettings) -> ScriptedHost:
        """Build from `scripted:PATH` and a run's settings, of which a script takes only the window."""
        return cls.from_model_id(model, context_window=settings.context_window)

    @property
    def source(self) -> str:
        """Where the replies come from, for error messages."""
        return str(self.path) if self.path is not None else "the in-memory script"

    @property
    def context_window(self) -> int:
        return self._context_window

    def session(self, name: str, *, agent: str | None = None, fork_of: str = "") -> ScriptedSession:
        """A new session replaying its agent's replies from the first one (a fork's too: it has no cache)."""
        return ScriptedSession(self, name, agent)

    async def count_tokens(
        self, messages: list[Message], tools: list[ToolSchema] | None = None, *, thinking: int = DEFAULT_THINKING_TOKENS
    ) -> int:
        return approx_tokens(messages, tools)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


class ScriptedSession:
    """One conversation: its own cursor into the agent's replies.

    `generate` returns the next scripted reply, its text and reasoning streamed in one piece each;
    `max_tokens`, `temperature` and `thinking` are ignored.

    Usage mimics a KV cache: the previous turn's prompt + reply messages that
    start the new prompt count as cached (only if the tools are unchanged, as
    real templates render them first); the rest counts as prefilled.
    """

    def __init__(self, host: ScriptedHost, name: str, agent: str | None) -> None:
        self.name = name
        self.agent = agent
        self._host = host
        self._replies = host.script.replies_for(agent, name)
        self._cursor = 0
        self._n_calls = 0
        self._busy = False
        self._closed = False
        self._previous: list[Message] = []
        self._previous_tools: list[ToolSchema] | None = None
        self.cut: Usage | None = None

    @property
    def kv_bytes(self) -> int:
        return 0

    async def close(self) -> None:
        self._closed = True

    async def generate(
        self, messages: list[Message], args: GenerateArgs = GenerateArgs(), *, tools: list[ToolSchema] | None = None
    ) -> Reply:
        if self._closed:
            raise RuntimeError(f"scripted session '{self.name}' is closed")
        if self._busy:
            raise RuntimeError(f"scripted session '{self.name}' is already generating")
        self._host.history.setdefault(self.name, []).append(copy.deepcopy(messages))
        if self._cursor >= len(self._replies):
            raise ScriptError(
                f"scripted model: session '{self.name}' (agent '{self.agent}') has no reply left "
                f"after {self._cursor} replies in {self._host.source}"
            )
        prompt_tokens = approx_tokens(messages, tools)
        if prompt_tokens >= self._host.context_window:
            raise PromptTooLongError(
                f"scripted model: prompt of ~{prompt_tokens} tokens does not fit the context "
                f"window of {self._host.context_window} tokens ({self._host.source})"
            )
        scripted = self._replies[self._cursor]
        self._busy, self.cut = True, None
        cached = self._cached_tokens(messages, tools)
        streamed = 0  # tokens of the reply streamed before a cut
        emit = args.on_event or _ignore
        emit(PrefillBegun(max(0, prompt_tokens - cached), cached))  # a script's `delay` stands for the prefill
        try:
            if scripted.delay:
                await asyncio.sleep(scripted.delay)
            if scripted.stall:
                _stream(scripted.reasoning, scripted.content, emit)
                streamed = approx_tokens([{"role": "assistant", "content": scripted.reasoning + scripted.content}])
                emit(TokensSoFar(streamed))  # and its `stall`, the decode
                await asyncio.sleep(scripted.stall)
        except asyncio.CancelledError:  # cut: the prompt was read, and what streamed was generated
            self.cut = Usage(prompt_tokens=prompt_tokens, cached_tokens=cached, generated_tokens=streamed)
            raise
        finally:
            self._busy = False
        # Only a delivered reply is consumed: a cancelled call leaves the cursor in place.
        self._cursor += 1
        reply = self._make_reply(scripted, messages, tools, prompt_tokens)
        if not scripted.stall:
            _stream(reply.reasoning, reply.text, emit)
            emit(TokensSoFar(reply.usage.generated_tokens))
        return reply

    def _make_reply(
        self,
        scripted: ScriptedReply,
        messages: list[Message],
        tools: list[ToolSchema] | None,
        prompt_tokens: int,
    ) -> Reply:
        calls = [self._tool_call(c) for c in scripted.tool_calls]
        raw = scripted.raw
        malformed = [MalformedToolCall(raw, hermes().error(_parse_error(raw)))] if raw is not None else []
        reply_message = Reply(text=scripted.content, tool_calls=calls, reasoning=scripted.reasoning).to_message()
        cached = self._cached_tokens(messages, tools)
        self._previous = [*messages, reply_message]
        self._previous_tools = tools
        return Reply(
            text=scripted.content,
            tool_calls=calls,
            malformed_tool_calls=malformed,
            finish_reason=scripted.finish_reason,
            usage=Usage(
                prompt_tokens=prompt_tokens,
                cached_tokens=cached,
                generated_tokens=approx_tokens([reply_message]),
            ),
            raw_text=raw if raw is not None else scripted.content + "".join(map(_markup, calls)),
            reasoning=scripted.reasoning,
        )

    def _tool_call(self, call: ScriptedToolCall) -> ToolCall:
        self._n_calls += 1
        return ToolCall(name=call.name, arguments=dict(call.arguments), id=f"call_{self._n_calls}")

    def _cached_tokens(self, messages: list[Message], tools: list[ToolSchema] | None) -> int:
        if not self._previous or tools != self._previous_tools:
            return 0
        n_common = 0
        for old, new in zip(self._previous, messages):
            if old != new:
                break
            n_common += 1
        return approx_tokens(messages[:n_common], tools) if n_common else 0


def _stream(reasoning: str, text: str, emit: OnHostEvent) -> None:
    if reasoning:
        emit(ReasoningDelta(reasoning))
    if text:
        emit(TextDelta(text))


def _ignore(event: HostEvent) -> None:
    """The host events of a call that asked for none."""


def _markup(call: ToolCall) -> str:
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_START}{body}{TOOL_CALL_END}"
