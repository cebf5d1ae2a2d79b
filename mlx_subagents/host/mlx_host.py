"""`MlxModelHost`: one resident mlx-lm model serving many sessions.

All mlx work happens on the host's engine thread (see `engine.py`), one
request at a time. Each session keeps its own prompt cache and the exact token
ids that cache holds, so a new turn prefills only what is new.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PromptTooLongError
from .engine import Engine
from .loading import config_context_window, load_model, read_config, resolve_model_path, strip_provider
from .prompt import RenderState, build_prompt, common_prefix, encode, generation_prompt_length, make_render_state, render
from .protocol import FinishReason, Generation, Message, ProcessorFactory, TextCallback, ToolSchema, Usage
from .toolcalls import parse_reply

DEFAULT_PREFILL_STEP = 512
# Models advertise windows of 128k-256k tokens; a 16 GB Mac cannot hold that
# much KV for several sessions, so the default is capped (override per host).
DEFAULT_CONTEXT_CAP = 32768


@dataclass
class _CacheState:
    """A session's cache and the ids it holds; touched only on the engine thread."""

    prompt_cache: list[Any] | None = None
    token_ids: list[int] = field(default_factory=list)
    render: RenderState | None = None
    # Non-trimmable (hybrid) caches: a copy taken before the last prompt token.
    snapshot: tuple[int, list[Any]] | None = None
    kv_bytes: int = 0


@dataclass(frozen=True)
class _Request:
    messages: list[Message]
    tools: list[ToolSchema] | None
    max_tokens: int
    temperature: float


@dataclass(frozen=True)
class MemoryStats:
    kv_bytes_total: int
    kv_bytes_by_session: dict[str, int]
    active_memory: int
    peak_memory: int


def _cache_nbytes(cache: list[Any] | None) -> int:
    return sum(c.nbytes for c in cache) if cache else 0


class MlxSession:
    """A conversation on the host with its own KV cache (see `HostSession`)."""

    def __init__(self, host: MlxModelHost, name: str, agent: str | None) -> None:
        self._host = host
        self.name = name
        self.agent = agent
        self._state = _CacheState()

    @property
    def kv_bytes(self) -> int:
        return self._state.kv_bytes

    @property
    def held_tokens(self) -> int:
        """How many token ids the session's cache holds."""
        return len(self._state.token_ids)

    async def generate(
        self,
        messages: list[Message],
        *,
        tools: list[ToolSchema] | None = None,
        max_tokens: int = 1024,
        temperature: float = 0.0,
        on_text: TextCallback | None = None,
    ) -> Generation:
        """One reply. Cancelling the awaiting task stops generation at the next token."""
        request = _Request(list(messages), tools, max_tokens, temperature)
        cancel = threading.Event()
        emit = self._host._make_emitter(on_text)
        try:
            return await self._host._engine.run(lambda: self._host._generate(self, request, cancel, emit))
        except asyncio.CancelledError:
            cancel.set()
            raise

    async def reset(self) -> None:
        """Forget the cache (the next turn prefills from scratch)."""
        await self._host._engine.run(self._drop)

    async def close(self) -> None:
        await self.reset()
        self._host._sessions.pop(self.name, None)

    def _drop(self) -> None:
        self._state = _CacheState()


class MlxModelHost:
    """Loads a model once and serves every session's generations on one engine thread.

    Args:
        model: a local mlx-lm folder, a hub id (`mlx-community/...`) or `mlx/<id>`.
        context_window: override the window read from the model config.
        processor_factory: called per request with (session name, prompt ids);
            returns logits processors (tests use it to force a script).
        reuse: keep and reuse each session's KV cache across turns.
    """

    def __init__(
        self,
        model: str,
        *,
        context_window: int | None = None,
        processor_factory: ProcessorFactory | None = None,
        prefill_step_size: int = DEFAULT_PREFILL_STEP,
        reuse: bool = True,
    ) -> None:
        self.model_id = strip_provider(model)
        self._window_override = context_window
        self._processor_factory = processor_factory
        self.prefill_step_size = prefill_step_size
        self.reuse = reuse
        self._engine = Engine()
        self._sessions: dict[str, MlxSession] = {}
        self._model: Any = None
        self.tokenizer: Any = None
        self.model_path: Path | None = None
        self._context_window = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        if self._model is not None:
            return
        self._loop = asyncio.get_running_loop()
        self.model_path = resolve_model_path(self.model_id)
        config = read_config(self.model_path)
        self._engine.start()
        self._model, self.tokenizer = await self._engine.run(lambda: load_model(self.model_path))
        trained = config_context_window(config) or DEFAULT_CONTEXT_CAP
        self._context_window = self._window_override or min(trained, DEFAULT_CONTEXT_CAP)

    async def stop(self) -> None:
        self._sessions.clear()
        await asyncio.to_thread(self._engine.stop)

    async def __aenter__(self) -> MlxModelHost:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- public accounting ---------------------------------------------------

    @property
    def context_window(self) -> int:
        return self._context_window

    def session(self, name: str, *, agent: str | None = None) -> MlxSession:
        """A new session; an existing name returns that session (its cache kept)."""
        if name not in self._sessions:
            self._sessions[name] = MlxSession(self, name, agent)
        return self._sessions[name]

    async def count_tokens(self, messages: list[Message], tools: list[ToolSchema] | None = None) -> int:
        """Tokens of the prompt these messages render to (generation prompt included)."""
        return len(encode(self.tokenizer, render(self.tokenizer, messages, tools, generation_prompt=True)))

    @property
    def kv_bytes_total(self) -> int:
        return sum(s.kv_bytes for s in self._sessions.values())

    async def memory_stats(self) -> MemoryStats:
        import mlx.core as mx

        active, peak = await self._engine.run(lambda: (mx.get_active_memory(), mx.get_peak_memory()))
        by_session = {name: s.kv_bytes for name, s in self._sessions.items()}
        return MemoryStats(sum(by_session.values()), by_session, active, peak)

    # -- engine-thread work --------------------------------------------------

    def _make_emitter(self, on_text: TextCallback | None) -> TextCallback:
        if on_text is None:
            return lambda _text: None
        loop = asyncio.get_running_loop()
        return lambda text: loop.call_soon_threadsafe(on_text, text) if text else None

    def _generate(self, session: MlxSession, request: _Request, cancel: threading.Event, emit: TextCallback) -> Generation:
        import mlx.core as mx
        from mlx_lm.sample_utils import make_sampler

        state = session._state
        ids, text = build_prompt(self.tokenizer, request.messages, request.tools, state.render, state.token_ids)
        max_tokens = self._fit(len(ids), request.max_tokens)
        if cancel.is_set():  # cancelled while queued: leave the session untouched
            return Generation(text="", finish_reason="cancelled", usage=Usage(prompt_tokens=len(ids)))
        tic = time.perf_counter()
        cache, n_cached = self._prepare_cache(state, ids)
        if not self._prefill(state, cache, request, ids, n_cached, cancel):
            return Generation(text="", finish_reason="cancelled", usage=Usage(len(ids), n_cached, len(ids) - n_cached))
        processors = self._processor_factory(session.name, ids) if self._processor_factory else []
        sampler = make_sampler(temp=request.temperature)
        generated, finish, prompt_s = self._decode(cache, ids[-1], max_tokens, sampler, processors, cancel, emit)
        total_s = time.perf_counter() - tic
        state.token_ids = ids + generated
        state.render = make_render_state(request.messages, request.tools, text, finish == "stop")
        if not self.reuse:  # keep the ids (same prompts as with reuse), drop the cache
            state.prompt_cache, state.snapshot = None, None
        state.kv_bytes = _cache_nbytes(state.prompt_cache) + (_cache_nbytes(state.snapshot[1]) if state.snapshot else 0)
        mx.clear_cache()
        return self._make_generation(request, generated, finish, ids, n_cached, prompt_s, total_s - prompt_s)

    def _fit(self, n_prompt: int, max_tokens: int) -> int:
        room = self._context_window - n_prompt
        if room <= 0:
            raise PromptTooLongError(
                f"the prompt is {n_prompt} tokens but the context window is {self._context_window}; "
                "shorten the task or the conversation (compaction), or raise --context-window"
            )
        return max(1, min(max_tokens, room))

    def _prepare_cache(self, state: _CacheState, ids: list[int]) -> tuple[list[Any], int]:
        """The cache to continue from and how many prompt ids it already holds."""
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

        held, cache = state.token_ids, state.prompt_cache
        if self.reuse and cache is not None and held:
            n = min(common_prefix(held, ids), len(ids) - 1)
            if n == len(held):
                return cache, n
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, len(held) - n)
                return cache, n
            if state.snapshot is not None and 0 < state.snapshot[0] <= n:
                return copy.deepcopy(state.snapshot[1]), state.snapshot[0]
        state.snapshot = None
        return make_prompt_cache(self._model), 0

    def _prefill(self, state: _CacheState, cache: list[Any], request: _Request, ids: list[int], start: int,
                 cancel: threading.Event) -> bool:
        """Feed ids[start:-1] in chunks (the decoder feeds the last id); False when cancelled.

        A non-trimmable cache is copied where the reply's opening begins, so a
        retry or a new user message can restart from there.
        """
        from mlx_lm.models.cache import can_trim_prompt_cache

        state.prompt_cache, state.token_ids, state.render = cache, ids[:start], None
        snap = 0
        if self.reuse and not can_trim_prompt_cache(cache):
            snap = len(ids) - generation_prompt_length(self.tokenizer, request.messages, request.tools)
        if 0 < snap and start <= snap:
            if not self._feed(state, cache, ids, start, snap, cancel):
                return False
            state.snapshot = (snap, copy.deepcopy(cache))
            start = snap
        return self._feed(state, cache, ids, start, len(ids) - 1, cancel)

    def _feed(self, state: _CacheState, cache: list[Any], ids: list[int], pos: int, stop: int,
              cancel: threading.Event) -> bool:
        import mlx.core as mx

        while pos < stop:
            end = min(pos + self.prefill_step_size, stop)
            self._model(mx.array(ids[pos:end])[None], cache=cache)
            mx.eval([c.state for c in cache])
            pos = end
            state.token_ids = ids[:pos]
            if cancel.is_set():
                return False
        return True

    def _decode(
        self, cache: list[Any], last_id: int, max_tokens: int, sampler: Any, processors: list[Any],
        cancel: threading.Event, emit: TextCallback,
    ) -> tuple[list[int], FinishReason, float]:
        """Generate from the last prompt id; the cache ends holding every yielded id."""
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        eos = self.tokenizer.eos_token_ids
        detokenizer = self.tokenizer.detokenizer
        generated: list[int] = []
        finish: FinishReason = "length"
        tic, prompt_s = time.perf_counter(), 0.0
        steps = generate_step(
            mx.array([last_id]), self._model, max_tokens=max_tokens, sampler=sampler,
            logits_processors=processors or None, prompt_cache=cache,
        )
        for token, _ in steps:
            if not generated:
                prompt_s = time.perf_counter() - tic
            generated.append(token)
            if token in eos:
                finish = "stop"
                break
            detokenizer.add_token(token)
            emit(detokenizer.last_segment)
            if cancel.is_set():
                finish = "cancelled"
                break
        steps.close()
        return generated, finish, prompt_s

    def _make_generation(
        self, request: _Request, generated: list[int], finish: FinishReason, ids: list[int],
        n_cached: int, prompt_s: float, gen_s: float,
    ) -> Generation:
        body = generated[:-1] if finish == "stop" else generated
        raw = self.tokenizer.decode(body)
        text, calls, malformed = parse_reply(self.tokenizer, raw, request.tools)
        usage = Usage(
            prompt_tokens=len(ids), cached_tokens=n_cached, prefilled_tokens=len(ids) - n_cached,
            generated_tokens=len(generated), prompt_seconds=prompt_s, generation_seconds=gen_s,
        )
        return Generation(text, calls, malformed, finish, usage, raw, tuple(generated))
