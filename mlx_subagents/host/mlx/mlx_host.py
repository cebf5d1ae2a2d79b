"""`MlxModelHost`: one resident mlx-lm model serving many sessions.

All mlx work happens on the host's mlx thread (see `mlx_thread.py`); the
`Scheduler` there runs every session's turns, batched or one at a time, and
the `KVPool` keeps their caches within a byte budget. Each session (`mlx_session.py`)
keeps its own prompt cache and the exact token ids it holds, so a new turn prefills
only what is new.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import ChatTemplateError, SubagentError
from ..calls.chat_format import ChatFormat
from ..calls.prompt import encode, render
from ..kv import budget
from ..kv.budget import DEFAULT_MAX_SESSIONS, SharedKVBudget, default_kv_budget, parse_bytes
from ..kv.kv_bits import KVSetting
from ..kv.kv_pool import DEFAULT_DROP_BELOW_TOKENS, KVPool, KVShape
from ..kv.prefix_files import default_max_bytes, prefix_cache_dir
from ..kv.prefix_store import PrefixStore, model_identity
from ..protocol import (
    DEFAULT_THINKING_TOKENS,
    Message,
    ProcessorFactory,
    ToolMode,
    ToolSchema,
)
from ..settings import (
    DEFAULT_DRAFT,
    DEFAULT_KV_BITS,
    DEFAULT_PREFILL_SLICE,
    PrefillSlice,
    check_kv_bits,
    parse_draft,
    parse_prefill_slice,
)
from .drafted import DraftCounts
from .kv_size import kv_shapes, measure, session_window
from .loading import config_context_window, load_model, read_config, resolve_model_path, strip_provider
from .mlx_session import MlxSession
from .mlx_thread import MlxThread
from .prompt_worker import PromptWorker
from .resident import Registration, reserve
from .scheduler import Scheduler, SchedulerConfig

if TYPE_CHECKING:
    from ..settings import HostSettings

DEFAULT_PREFILL_STEP = 512


@dataclass(frozen=True)
class MemoryStats:
    kv_bytes_total: int
    kv_bytes_by_session: dict[str, int]
    kv_budget: int | None
    active_memory: int
    peak_memory: int
    pool: dict[str, int] = field(default_factory=dict)
    shared_prefix_hits: int = 0
    sessions_resident: int = 0  # sessions whose caches are in memory now (idle or in a turn)


class MlxModelHost:
    """Loads a model once and serves every session's replies on one mlx thread.

    Args:
        model: a local mlx-lm folder, a hub id (`mlx-community/...`) or `mlx/<id>`.
        context_window: the window per session (default: the model's, capped at
            `DEFAULT_CONTEXT_WINDOW` and at what the KV budget holds for `max_sessions` sessions).
        processor_factory: called per request with (session name, prompt ids);
            returns logits processors, run after the grammar's mask (tests use it to force a script;
            a processor that forces a token gives it a finite logit, as `testing.forced` does).
        reuse: keep and reuse each session's KV cache across turns.
        batching: decode all active sessions in one batch (False: one turn at a time).
        kv_budget: bytes (or "4GB", or a fraction of RAM) for all KV caches; None derives
            it from RAM and the model size; 0 means unbounded; a `SharedKVBudget` splits one
            budget with the other hosts that share it.
        max_sessions: sessions the per-session window must fit at once.
        prefix_cache: bytes of disk for shared prefixes kept across processes (`PrefixStore`); None: a
            small share of the free disk; 0: none.
        prefix_cache_dir: where those files go (default `$MLX_SUBAGENTS_HOME/cache/prefixes`).
        prefill_slice: how a prompt is prefilled while other sessions decode (`prefill.py`): `auto`
            (slices sized from what decode steps and prompt tokens cost), a number of tokens per
            slice, or `off` (it joins the batch at once and is prefilled there a chunk per decode step).
        kv_bits: 16 (not quantized), 8 or 4: every session's KV cache quantized per group to that
            many bits; a model whose attention cannot take it runs at 16, with one warning.
        draft: `lookup`: each decoding session, alone or in the batch, drafts tokens by prompt lookup
            and verifies them in one forward (`drafts.py`; the same tokens); `off`: one token per
            forward; `auto`: lookup on a GPU, off on a CPU (where a forward's cost grows with its tokens).
        drop_below_tokens: an evicted cache holding fewer tokens is dropped (re-prefilled on its next
            turn) rather than spilled to disk.
    """

    def __init__(
        self,
        model: str,
        *,
        context_window: int | None = None,
        processor_factory: ProcessorFactory | None = None,
        prefill_step_size: int = DEFAULT_PREFILL_STEP,
        reuse: bool = True,
        batching: bool = True,
        share_prefix: bool = True,
        kv_budget: int | str | SharedKVBudget | None = None,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        spill_dir: Path | None = None,
        prefix_cache: int | None = None,
        prefix_cache_dir: Path | None = None,
        prefill_slice: PrefillSlice = DEFAULT_PREFILL_SLICE,
        kv_bits: int = DEFAULT_KV_BITS,
        drop_below_tokens: int = DEFAULT_DROP_BELOW_TOKENS,
        draft: str = DEFAULT_DRAFT,
    ) -> None:
        self.model_id = strip_provider(model)
        try:
            self.kv_bits_requested = check_kv_bits(kv_bits)
        except ValueError as exc:
            raise SubagentError(f"{exc}; 16 keeps the KV cache unquantized") from None
        self.kv_setting = KVSetting()  # what the host runs at, decided at load
        self._window_override = context_window
        self._processor_factory = processor_factory
        self._config = SchedulerConfig(reuse, batching, prefill_step_size, share_prefix)
        self._config.prefill_slice = parse_prefill_slice(prefill_slice)
        self._config.draft = parse_draft(draft)
        self.drafts = DraftCounts()  # every reply's drafted and accepted tokens, summed (doctor, serve --status)
        self._shared = kv_budget if isinstance(kv_budget, SharedKVBudget) else None
        self._budget_request = None if self._shared else parse_bytes(kv_budget)  # type: ignore[arg-type]
        self.max_sessions = max_sessions
        self._spill_dir = spill_dir
        self._drop_below = drop_below_tokens
        self._store_bytes = prefix_cache
        self._store_dir = prefix_cache_dir
        self.prefix_store: PrefixStore | None = None
        self._cache_kind: str | None = None
        self._mlx = MlxThread()
        self._prompts: PromptWorker | None = None  # made at start, with the scheduler
        self._sessions: dict[str, MlxSession] = {}
        self._model: Any = None
        self.tokenizer: Any = None
        self.model_path: Path | None = None
        self.kv_shape = KVShape(0, 0)
        self._trimmable = True
        self.chat: ChatFormat
        self._pool = KVPool(None)
        self._scheduler: Scheduler
        self._registration: Registration | None = None  # its entry among the machine's resident models

    @classmethod
    def from_settings(cls, model: str, settings: HostSettings) -> MlxModelHost:
        """The resident model a run's settings make: its batching, window, KV budget (shared with the
        run's other models), prefix cache and logits processors."""
        return cls(
            model,
            context_window=settings.context_window,
            processor_factory=settings.processor_factory,
            batching=settings.batching,
            kv_budget=settings.kv_budget,
            prefix_cache=settings.prefix_cache,
            prefill_slice=settings.prefill_slice,
            draft=settings.draft,
            kv_bits=settings.kv_bits,
        )

    @property
    def draft(self) -> str:
        """How a session drafts tokens to verify in one forward: `auto`, `lookup` or `off`."""
        return self._config.draft

    @property
    def drafting(self) -> bool:
        """Whether sessions draft here: `lookup`, or `auto` on a GPU (known once the model is loaded)."""
        return self._model is not None and self._scheduler.decode.drafts

    @property
    def prefill_slice(self) -> PrefillSlice:
        """The prefill slice policy's setting: `auto`, tokens per slice, or `off`."""
        return self._config.prefill_slice

    @property
    def prefill_step(self) -> int:
        """The most prompt tokens one forward feeds (a slice with nothing decoding)."""
        return self._config.prefill_step_size

    @property
    def reuse(self) -> bool:
        return self._config.reuse

    @property
    def batching(self) -> bool:
        return self._config.batching

    @property
    def kv_bits(self) -> int:
        """The bits per KV value every session's cache holds: as asked (`kv_bits`), or 16 when the model
        cannot take a quantized cache."""
        return self.kv_setting.bits

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        if self._model is not None:
            return
        self.model_path = resolve_model_path(self.model_id)
        config = read_config(self.model_path)
        self._mlx.start()
        self.kv_shape, self._trimmable = await self._mlx.run(self._load)
        self.chat = await self._chat_format()
        budget, total = self._reserve()
        try:
            self._config.context_window = self._window(config_context_window(config), budget, total)
        except SubagentError:
            self._unregister()
            await self._unload()
            raise
        self._pool = KVPool(budget, spill_dir=self._spill_dir, drop_below_tokens=self._drop_below)
        self._scheduler = Scheduler(  # no mlx work in it: built here, run on the mlx thread
            self._model,
            self.tokenizer,
            self._config,
            self._pool,
            self.kv_shape,
            self._trimmable,
            self._processor_factory,
            self._mlx.has_jobs,
            await self._open_store(),
            self._make_cache,
            (kind, self.chat.calls.start, self.chat.calls.end)
            if (kind := self.chat.grammar_kind) is not None
            else None,
        )
        self._mlx.stepper = self._scheduler
        self._prompts = PromptWorker(self._mlx, self._scheduler)
        if self._shared:
            await self._shared.join(self, budget)

    async def stop(self) -> None:
        self._unregister()
        self._sessions.clear()
        if self._prompts is not None:
            self._prompts.close()
        await asyncio.to_thread(self._mlx.stop)
        self._pool.close()  # after the mlx thread, which spills: no spill file outlives the host
        if self.prefix_store is not None:  # after the mlx thread: it queues the last writes
            await asyncio.to_thread(self.prefix_store.close)

    async def _open_store(self) -> PrefixStore | None:
        """The disk tier, keyed by all that a prefix's cache depends on; None when off or not storable."""
        import mlx.core as mx
        import mlx_lm

        if not (self.reuse and self._config.share_prefix) or self._store_bytes == 0 or self._cache_kind is None:
            return None
        folder = self._store_dir or prefix_cache_dir()
        size = default_max_bytes(folder) if self._store_bytes is None else self._store_bytes
        files = await asyncio.to_thread(model_identity, self.model_path)  # type: ignore[arg-type]
        identity = "|".join(
            [files, mx.__version__, mlx_lm.__version__, str(mx.default_device()), str(self._config.prefill_step_size)]
        )
        self.prefix_store = PrefixStore(folder, size, identity, self._cache_kind, self.model_id)
        return self.prefix_store

    async def __aenter__(self) -> MlxModelHost:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _chat_format(self) -> ChatFormat:
        """Decided at load; a model that cannot chat stops the mlx thread it started, then says why."""
        try:
            return ChatFormat.load(self.tokenizer, self.model_id)
        except ChatTemplateError:
            await self._unload()
            raise

    async def _unload(self) -> None:
        """A model that cannot serve: stop the mlx thread `start` began and let the model go."""
        self._model = None
        await asyncio.to_thread(self._mlx.stop)

    def _load(self) -> tuple[KVShape, bool]:
        """Load the model and tokenizer, and `measure` their KV cache: one trip to the mlx thread."""
        self._model, self.tokenizer = load_model(self.model_path)  # type: ignore[arg-type]
        measured = measure(self._model, self.kv_bits_requested, self.model_id)
        self.kv_setting, self._cache_kind = measured.setting, measured.kind
        return measured.shape, measured.trimmable

    def _make_cache(self) -> list[Any]:
        """A fresh prompt cache under the host's KV setting (mlx thread)."""
        return self.kv_setting.make_cache(self._model)

    async def kv_shapes(self) -> dict[int, KVShape | str]:
        """The KV bytes a session costs at each `--kv-bits` setting, or why this model cannot take it
        (read off fresh caches, nothing computed: what `doctor` prints)."""
        return await self._mlx.run(lambda: kv_shapes(self._model))

    def weights_bytes(self) -> int:
        """The weights as stored: mlx loads safetensors as they are (walking the parameters costs more)."""
        return sum(f.stat().st_size for f in self.model_path.glob("*.safetensors")) if self.model_path else 0

    def _budget(self, free: int | None = None) -> int | None:
        """The budget of a host alone: the request, else half of the free RAM (`free`; default: all of
        it) minus its weights; None: unbounded (asked for, or the RAM is not known)."""
        if self._budget_request == 0:
            return None
        if self._budget_request is not None:
            return self._budget_request
        ram = budget.total_memory()
        return default_kv_budget(ram if free is None else free, self.weights_bytes()) if ram else None

    def _reserve(self) -> tuple[int | None, int | None]:
        """(its budget, the shared total) decided from the memory other processes' models leave, and
        registered for the processes that start next (`resident.py`)."""
        decided: list[tuple[int | None, int | None]] = []

        def decide(free: int) -> int | None:
            decided.append(self._shared.share_for(self, free) if self._shared else (self._budget(free), None))
            return decided[-1][0]

        _, self._registration = reserve(self.model_id, self.weights_bytes(), budget.total_memory(), decide)
        return decided[-1]

    def _unregister(self) -> None:
        if self._registration is not None:
            self._registration.remove()
            self._registration = None

    async def set_kv_budget(self, budget: int | None) -> None:
        """A new budget for the pool (another resident model took its share): idle caches over it are
        evicted now; work in flight ends as admitted, and new turns wait for room within it."""

        def resize() -> None:
            self._pool.budget = budget
            self._scheduler.make_room()

        await self._mlx.run(resize)
        if self._registration is not None:
            self._registration.update(budget)

    def _window(self, trained: int | None, budget: int | None, shared_total: int | None = None) -> int:
        """The per-session window (`session_window`): the model's, capped, and what the budget holds."""
        return session_window(
            self.kv_shape,
            trained,
            budget,
            max_sessions=self.max_sessions,
            trimmable=self._trimmable,
            override=self._window_override,
            model_id=self.model_id,
            shared_total=shared_total,
        )

    # -- public accounting ---------------------------------------------------

    @property
    def context_window(self) -> int:
        return self._config.context_window

    @property
    def tool_mode(self) -> ToolMode:
        """`native` (the template's own tool format) or `prompted` (ours, in the system prompt)."""
        return self.chat.tool_mode

    @property
    def thinks(self) -> bool:
        """A thinking model (`ChatFormat.thinks`): its replies' thoughts are bounded by a budget."""
        return self.chat.thinks

    @property
    def kv_trimmable(self) -> bool:
        """False for hybrid models, whose sessions also hold a cache snapshot."""
        return self._trimmable

    @property
    def kv_budget(self) -> int | None:
        return self._pool.budget

    def session(self, name: str, *, agent: str | None = None, fork_of: str = "") -> MlxSession:
        """A new session; an existing name returns that session (its cache kept). A new one with
        `fork_of` starts where that session is now (`Scheduler.fork`), whenever its first turn comes."""
        if name not in self._sessions:
            self._sessions[name] = MlxSession(self, name, agent, fork_of)
        return self._sessions[name]

    async def count_tokens(
        self, messages: list[Message], tools: list[ToolSchema] | None = None, *, thinking: int = DEFAULT_THINKING_TOKENS
    ) -> int:
        """Tokens of the prompt these messages render to (generation prompt included), rendered as a turn
        with this `thinking` budget renders them (off: the template's `enable_thinking=False`). Counted
        in a worker thread: a conversation of megabytes takes seconds to tokenize, which the caller's
        event loop (a server's every client) would otherwise wait for."""
        messages, tools = self.chat.present(messages, tools)
        switch = {"enable_thinking": False} if self.chat.thinks and thinking <= 0 else None

        def count() -> int:
            text = render(self.tokenizer, messages, tools, generation_prompt=True, template_kwargs=switch)
            return len(encode(self.tokenizer, text))

        return await asyncio.to_thread(count)

    @property
    def kv_bytes_total(self) -> int:
        return sum(s.kv_bytes for s in self._sessions.values())

    @property
    def n_sessions(self) -> int:
        """Sessions it holds now (each with its own KV cache)."""
        return len(self._sessions)

    @property
    def most_decoding(self) -> int:
        """The most turns that ever decoded at once, in one batch (1: one on its own; 0 before the first turn)."""
        return self._scheduler.decode.most_decoding if self._model is not None else 0

    async def memory_stats(self) -> MemoryStats:
        import mlx.core as mx

        def read() -> MemoryStats:
            by_session = {name: s.kv_bytes for name, s in self._sessions.items()}
            return MemoryStats(
                kv_bytes_total=self._scheduler.resident_bytes(),
                kv_bytes_by_session=by_session,
                kv_budget=self._pool.budget,
                active_memory=mx.get_active_memory(),
                peak_memory=mx.get_peak_memory(),
                pool=self._pool.counters.to_dict(),
                shared_prefix_hits=self._scheduler.prefixes.hits,
                sessions_resident=self._scheduler.resident_sessions(),
            )

        return await self._mlx.run(read)
