"""`EngineHost`: the host protocol over an OpenAI-compatible inference engine.

vLLM, SGLang, llama.cpp's server, Ollama, LM Studio and `mlx_lm.server` all serve
`/v1/chat/completions` with tools. The model runs there; the tools still run here, in the
workspace. The engine batches concurrent requests and caches shared prefixes, so every session
simply sends its whole conversation each turn, rendered the same way each time (byte-stable up
to the new messages) so that the engine's prefix cache hits. Nothing here is chosen silently:
the runner builds an `EngineHost` only for an engine the user named.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import openai

from ...deadlines import within
from ...errors import EngineError, SubagentError
from ..calls.formats.hermes import hermes
from ..protocol import (
    DEFAULT_CONTEXT_WINDOW,
    DEFAULT_THINKING_TOKENS,
    FinishReason,
    GenerateArgs,
    MalformedToolCall,
    Message,
    Reply,
    ToolCall,
    ToolMode,
    ToolSchema,
    Usage,
)
from .engine_errors import API_KEY_ENV, NOT_AN_ENGINE, EngineErrors
from .engine_stream import (
    EngineFailed,
    Partial,
    WrongReply,
    event_data,
    looks_like_html,
    not_a_stream,
    page_summary,
    read_some,
    transport_errors,
)
from .estimate import approx_tokens

if TYPE_CHECKING:
    from ..settings import HostSettings

# Seconds without a byte from the engine (a long prefill on a busy engine sends nothing).
DEFAULT_TIMEOUT = 300.0
DEFAULT_CONNECT_TIMEOUT = 10.0
# Seconds the start-up probe (the model listing, retries included) may take: a listing is small and
# quick, an engine that cannot list in this time is not up. `--timeout` lowers it.
DEFAULT_START_TIMEOUT = 30.0
# Seconds one reply may take from request to end, retries included: a bound on an engine that
# never ends its stream (keep-alives forever) or never answers; a long legitimate reply (a long
# prefill, then thousands of tokens on a busy engine) takes minutes, not half an hour.
DEFAULT_REPLY_TIMEOUT = 1800.0
# The most a model listing may hold (a big router lists a few hundred models in about 1 MB).
MAX_LISTING_BYTES = 8 << 20
# 429, 503, other 5xx, refused connections and timeouts are retried with the client's
# exponential backoff (0.5 s doubling, honouring Retry-After), this many times.
DEFAULT_MAX_RETRIES = 3
# Model-listing fields that carry the served context window: vLLM and SGLang (`max_model_len`),
# OpenRouter-style listings (`context_length`).
CONTEXT_FIELDS = ("max_model_len", "context_length")
# Without a key the client would read $OPENAI_API_KEY: never send that to a self-hosted engine.
NO_KEY = "none"


def engine_url(url: str) -> str:
    """The base URL the client needs: `http://host:8000` becomes `http://host:8000/v1`."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SubagentError(f"--engine {url!r} is not an http(s) URL; pass e.g. http://127.0.0.1:8000/v1")
    return url.strip().rstrip("/") if parts.path.strip("/") else f"{url.strip().rstrip('/')}/v1"


class EngineHost:
    """Serves every session's model calls from an OpenAI-compatible engine at `url`.

    Args:
        url: the engine's base URL (`/v1` is added when the URL has no path).
        model: the engine's model id (what its `/v1/models` lists).
        api_key: sent as a bearer token; default `$MLX_SUBAGENTS_API_KEY`, else none.
        context_window: the window per session; default the engine's (from its model
            listing), else `DEFAULT_CONTEXT_WINDOW`. It may lower the engine's, not raise it.
        timeout: seconds without a byte from the engine before a request fails.
        max_retries: retries of a refused, rate-limited (429) or unavailable (5xx) request.
        start_timeout: seconds the start-up probe may take, retries included (at most
            `DEFAULT_START_TIMEOUT`; a run's `--timeout` lowers it).
        reply_timeout: seconds one reply may take, retries included.
    """

    # The engine renders the tools with its template and parses the calls; an engine without a
    # parser for its model returns them as text, read as the prompted mode's Hermes format.
    tool_mode: ToolMode = "native"
    thinks = True  # its model may: `thinking` 0 asks its template for none, any other budget is the engine's

    def __init__(
        self,
        url: str,
        model: str,
        *,
        api_key: str | None = None,
        context_window: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        start_timeout: float | None = None,
        reply_timeout: float = DEFAULT_REPLY_TIMEOUT,
    ) -> None:
        self.url = engine_url(url)
        self.model_id = model
        self.max_retries = max_retries
        self.timeout = timeout
        self.start_timeout = min(DEFAULT_START_TIMEOUT, start_timeout or DEFAULT_START_TIMEOUT)
        self.reply_timeout = reply_timeout
        self._window_override = context_window
        self._context_window = context_window or DEFAULT_CONTEXT_WINDOW
        self._client = openai.AsyncOpenAI(
            base_url=self.url,
            api_key=api_key or os.environ.get(API_KEY_ENV) or NO_KEY,
            timeout=openai.Timeout(timeout, connect=DEFAULT_CONNECT_TIMEOUT),
            max_retries=max_retries,
        )
        self.errors = EngineErrors(self.url, model, timeout, max_retries)
        self._sessions: dict[str, EngineSession] = {}
        # Engine prompt tokens per approximate token, learned from each reply's usage.
        self._token_ratio = 1.0

    @classmethod
    def from_settings(cls, model: str, settings: HostSettings) -> EngineHost:
        """The host of a run's engine (`settings.engine`), `model` being its model id: its key, its
        window and how long its start-up probe may wait."""
        if settings.engine is None:
            raise ValueError(f"an engine host needs the engine's URL; model {model!r} names none")
        return cls(
            settings.engine,
            model,
            api_key=settings.api_key,
            context_window=settings.context_window,
            start_timeout=settings.start_timeout,
        )

    @property
    def context_window(self) -> int:
        return self._context_window

    async def start(self) -> None:
        """Probe the engine's model listing: fail fast when it cannot be reached or refuses the key."""
        listed = await self._listing(probe=True)
        served = next((m for m in listed if m.get("id") == self.model_id), {})
        limit = next((v for k in CONTEXT_FIELDS if isinstance(v := served.get(k), int) and v > 0), None)
        if limit is None:
            return
        if self._window_override and self._window_override > limit:
            raise SubagentError(
                f"engine {self.url}: model '{self.model_id}' serves at most {limit} tokens of context; "
                f"lower --context-window to {limit} or less"
            )
        self._context_window = self._window_override or limit

    async def stop(self) -> None:
        self._sessions.clear()
        await self._client.close()

    async def __aenter__(self) -> EngineHost:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def session(self, name: str, *, agent: str | None = None, fork_of: str = "") -> EngineSession:
        """A new session; an existing name returns that session. A fork (`fork_of`) sends its whole
        conversation like any session: the engine's own prefix cache reuses what it can."""
        if name not in self._sessions:
            self._sessions[name] = EngineSession(self, name, agent)
        return self._sessions[name]

    async def count_tokens(
        self, messages: list[Message], tools: list[ToolSchema] | None = None, *, thinking: int = DEFAULT_THINKING_TOKENS
    ) -> int:
        """An estimate: the engine has the tokenizer, so count characters and scale by what the
        engine reported for earlier prompts (compaction needs the size, not the exact ids)."""
        return math.ceil(approx_tokens(to_wire(messages), tools) * self._token_ratio)

    async def served_models(self) -> list[str]:
        """The model ids the engine lists (empty when it has no listing)."""
        return [str(m.get("id")) for m in await self._listing(probe=False)]

    async def _listing(self, *, probe: bool) -> list[dict[str, Any]]:
        """The models the engine lists, within `start_timeout`; on the probe, an engine that cannot be
        reached, refuses the key, does not answer or answers with a page is fatal."""
        try:
            return await within(self._read_listing(), self.start_timeout)
        except asyncio.TimeoutError:
            if probe:
                raise EngineError(
                    f"engine {self.url}: the model listing ({self.url}/models) did not answer within "
                    f"{self.start_timeout:g} s; check that the engine is up and not stuck (its logs), then retry"
                ) from None
        except (openai.AuthenticationError, openai.PermissionDeniedError, openai.APIConnectionError) as exc:
            if probe:
                raise self.errors.failed(exc) from None
        except WrongReply as exc:
            if probe:
                raise EngineError(f"engine {self.url}: {exc}; {NOT_AN_ENGINE}") from None
        except (openai.APIError, ValueError):  # no listing (404), a broken one: not fatal
            pass
        return []

    async def _read_listing(self) -> list[dict[str, Any]]:
        wait = min(self.timeout, self.start_timeout)
        client = self._client.with_options(timeout=openai.Timeout(wait, connect=DEFAULT_CONNECT_TIMEOUT))
        async with client.models.with_streaming_response.list() as response:
            body = await read_some(response.iter_bytes(), MAX_LISTING_BYTES + 1)
            content_type = response.headers.get("content-type", "")
        text = body.decode("utf-8", "replace")
        if looks_like_html(content_type, text):
            raise WrongReply(
                f"the engine answered the model listing with an HTML page (status {response.status_code}), not "
                f"JSON: {page_summary(text)}"
            )
        if len(body) > MAX_LISTING_BYTES:
            raise ValueError("a listing over the size limit")
        listing = json.loads(text)  # not JSON: a ValueError, not fatal
        data = listing.get("data") if isinstance(listing, dict) else None
        return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []

    def _learn(self, wire: list[Message], tools: list[ToolSchema] | None, prompt_tokens: int) -> None:
        estimate = approx_tokens(wire, tools)
        if prompt_tokens and estimate:
            self._token_ratio = min(4.0, max(0.25, prompt_tokens / estimate))


# --- messages on the wire ----------------------------------------------------------------------


def answer_format(schema: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI `response_format` holding an answer to `schema`: vLLM, SGLang, llama.cpp's server,
    LM Studio and Ollama decode it under the schema (docs/engines.md); an engine without structured
    outputs ignores it, and the answer's validation stays the check either way."""
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def to_wire(messages: list[Message]) -> list[Message]:
    """The conversation as the chat-completions API takes it, rendered the same way every turn.

    Tool-call arguments become JSON strings; a tool result without a call id (the error for
    a call that could not be parsed) goes as a user message, which every engine accepts.
    """
    wire: list[Message] = []
    for message in messages:
        role = message["role"]
        content = message.get("content") or ""
        if role == "tool" and not message.get("tool_call_id"):
            wire.append({"role": "user", "content": content})
        elif role == "tool":
            wire.append({"role": "tool", "tool_call_id": message["tool_call_id"], "content": content})
        elif message.get("tool_calls"):
            calls = [_wire_call(call) for call in message["tool_calls"]]
            wire.append({"role": role, "content": content, "tool_calls": calls})
        else:
            wire.append({"role": role, "content": content})
    return wire


def _wire_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    arguments = function.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": call.get("id", ""),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


# --- sessions ----------------------------------------------------------------------------------------


class EngineSession:
    """One conversation on the engine (see `HostSession`); the KV cache lives on the engine.

    Each reply streams; cancelling `generate` closes the stream at once. The engine splits off the
    reasoning (its `reasoning_content` deltas) and owns any thinking budget; `thinking=0` asks its chat
    template for no thinking (`enable_thinking: false`, as the MLX host does).
    """

    def __init__(self, host: EngineHost, name: str, agent: str | None) -> None:
        self._host = host
        self.name = name
        self.agent = agent
        self._n_calls = 0
        self.cut: Usage | None = None

    @property
    def kv_bytes(self) -> int:
        return 0

    async def close(self) -> None:
        self._host._sessions.pop(self.name, None)

    async def generate(
        self, messages: list[Message], args: GenerateArgs = GenerateArgs(), *, tools: list[ToolSchema] | None = None
    ) -> Reply:
        host = self._host
        wire = to_wire(messages)
        request: dict[str, Any] = {
            "model": host.model_id,
            "messages": wire,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if args.top_p < 1:
            request["top_p"] = args.top_p
        if args.top_k > 0:
            request["top_k"] = args.top_k  # not OpenAI's, but llama.cpp's, vLLM's and mlx_lm.server's
        if args.seed is not None:
            request["seed"] = args.seed
        if tools:
            request["tools"] = tools  # `tool_choice: auto` constrains no call: calls stay the engine's parser's
            if args.tool_choice != "auto":
                named = {"type": "function", "function": {"name": args.tool_choice}}
                request["tool_choice"] = "required" if args.tool_choice == "required" else named
        elif args.grammar and args.answer_schema is not None:
            request["response_format"] = answer_format(args.answer_schema)
        if args.thinking == 0:
            # vLLM, SGLang, llama.cpp's server and mlx_lm.server pass these to the chat template.
            request["extra_body"] = {"chat_template_kwargs": {"enable_thinking": False}}
        visible = hermes().visible_text(args.on_event) if args.on_event is not None else None
        partial = Partial(args.max_tokens, visible, on_event=args.on_event)
        self.cut = None
        started = time.perf_counter()
        try:
            await within(self._stream(request, partial, started, wire, tools), host.reply_timeout)
        except asyncio.TimeoutError:
            self.cut = None  # not a cancellation: the reply failed
            raise EngineError(
                f"engine {host.url}: the reply did not end within {host.reply_timeout:g} s (it had "
                f"{len(partial.text)} characters); the engine may be stuck (check its logs), then retry"
            ) from None
        if partial.visible is not None:
            partial.visible.flush()
        return self._reply(partial, wire, tools, started)

    async def _stream(
        self,
        request: dict[str, Any],
        partial: Partial,
        started: float,
        wire: list[Message],
        tools: list[ToolSchema] | None,
    ) -> None:
        """Send the request and read its event stream into `partial`, closing the stream at the end, on a
        fault, on cancellation, or as soon as the reply passes its `max_tokens`."""
        host = self._host
        try:
            stream = await host._client.chat.completions.create(**request)
        except openai.NotFoundError as exc:
            raise host.errors.not_found(exc, await host.served_models()) from None
        except openai.APIError as exc:
            raise host.errors.failed(exc) from None
        response = stream.response
        timeout, broken = transport_errors(response)
        ignored: list[str] = []
        try:
            content_type = response.headers.get("content-type", "")
            if not content_type.lower().startswith("text/event-stream"):
                body = await read_some(response.aiter_bytes())
                raise host.errors.wrong(not_a_stream(response.status_code, content_type, body), streamed=None)
            async for data in event_data(response.aiter_bytes(), ignored):
                if not partial.add(data, time.perf_counter()):
                    partial.finish_reason = "length"  # cut here: the engine went past max_tokens
                    return
        except WrongReply as exc:
            raise host.errors.wrong(str(exc), streamed=len(partial.text)) from None
        except EngineFailed as exc:
            raise host.errors.failed(exc, streamed=len(partial.text)) from None
        except timeout:
            raise host.errors.failed(
                openai.APITimeoutError(request=response.request), streamed=len(partial.text)
            ) from None
        except broken:
            raise host.errors.cut(len(partial.text), ignored) from None
        except asyncio.CancelledError:  # the engine's usage comes at the end of the stream: estimated
            self.cut = self._usage(partial, wire, tools, 0.0, time.perf_counter() - started)
            raise
        finally:
            await asyncio.shield(stream.close())
        if partial.finish_reason is None:  # the body ended cleanly but the reply did not
            raise host.errors.cut(len(partial.text), ignored, n_chunks=partial.n_chunks)

    def _reply(self, partial: Partial, wire: list[Message], tools: list[ToolSchema] | None, started: float) -> Reply:
        calls, malformed = self._structured_calls(partial)
        text, text_calls, text_malformed = hermes().split(partial.text, tools, self._n_calls)
        self._n_calls += len(text_calls)
        ended = time.perf_counter()
        first = partial.first_delta or ended
        return Reply(
            text=text,
            tool_calls=calls + text_calls,
            malformed_tool_calls=malformed + text_malformed,
            finish_reason=_finish_reason(partial.finish_reason),
            usage=self._usage(partial, wire, tools, first - started, ended - first),
            raw_text=partial.text,
            reasoning=partial.reasoning.strip(),
        )

    def _structured_calls(self, partial: Partial) -> tuple[list[ToolCall], list[MalformedToolCall]]:
        calls: list[ToolCall] = []
        malformed: list[MalformedToolCall] = []
        for index in sorted(partial.calls):
            part = partial.calls[index]
            try:
                arguments = json.loads(part["arguments"]) if part["arguments"].strip() else {}
                if not isinstance(arguments, dict):
                    raise ValueError('"arguments" must be a JSON object')
            except ValueError as exc:
                raw = json.dumps({"name": part["name"], "arguments": part["arguments"]}, ensure_ascii=False)
                error = (
                    f"Error: the arguments of your call to {part['name']} are not a JSON object "
                    f"({type(exc).__name__}: {exc}). Call the tool again with its arguments as one JSON object."
                )
                malformed.append(MalformedToolCall(raw=raw, error=error))
                continue
            calls.append(ToolCall(part["name"], arguments, id=part["id"] or f"call_{self._n_calls}"))
            self._n_calls += 1
        return calls, malformed

    def _usage(
        self, partial: Partial, wire: list[Message], tools: list[ToolSchema] | None, prompt_s: float, gen_s: float
    ) -> Usage:
        usage = partial.usage or {}
        prompt, generated = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if partial.over_limit or not (_count(prompt) and _count(generated)):
            # No usage (an engine that ignores `include_usage`, a stream closed here): estimate.
            estimate = max(partial.n_tokens, approx_tokens([{"content": partial.text + partial.reasoning}]))
            generated = partial.max_tokens if partial.over_limit else min(estimate, partial.max_tokens)
            return Usage(approx_tokens(wire, tools), 0, generated, prompt_s, gen_s)
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else 0
        self._host._learn(wire, tools, prompt)
        return Usage(
            prompt_tokens=prompt,
            cached_tokens=cached if _count(cached) else 0,
            generated_tokens=generated,
            prompt_seconds=prompt_s,
            generation_seconds=gen_s,
        )


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _finish_reason(reason: str | None) -> FinishReason:
    return "length" if reason == "length" else "stop"
