"""The mlx thread's scheduler: admission, sliced prefill, batched or serialized decode.

Every turn (`turn.py`) moves through the same stages: waiting (admission control against
the KV budget, `admission.py`) -> prefilling (in slices, reusing the session's cache, a shared
system-prompt prefix, or a hybrid model's snapshot) -> decoding -> finished
(its cache parked in the pool for the next turn). In batched mode every
decoding session advances one token per step in one mlx-lm `BatchGenerator`
batch, and a prompt is prefilled on its own cache in slices between decode
steps, the time shared equally with the decoders (`prefill.py`), so a long
prompt does not stall them; a turn with nothing else in flight decodes on mlx-lm's
single-sequence path (the single turn), several tokens per step, moves into the batch
when a second turn arrives and back out when it is the last one left in it
with nothing else to come. In serialized mode a turn runs from start
to finish on its own, which is the reference the batched mode must match
token for token.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import PromptTooLongError
from ..calls.grammar import Constrainer, Grammars
from ..calls.prompt import build_prompt, common_prefix, encode, generation_prompt_length, make_render_state, render
from ..calls.thinking import prompt_opens_thought, thought_budget
from ..kv.kv_pool import CacheState, KVPool, KVShape, cache_nbytes, shared_prefix_of
from ..kv.prefix_cache import SharedPrefixes
from ..kv.prefix_store import PrefixStore
from ..protocol import FinishReason, ProcessorFactory, Reply, TextCallback, Usage
from ..settings import DEFAULT_PREFILL_SLICE, PrefillSlice
from .admission import Admission
from .masks import MaskBatch, MaskedModel, Row
from .prefill import PrefillGroup, SlicePolicy, pick
from .single import SingleStream, take_from_batch
from .turn import TextSink, Turn

# Streamed text reaches the callers' loops at most this often (plus a turn's first text and its end at
# once): a wake-up per token costs a syscall and a thread switch per step, more than a token of a
# small model on a CPU, and no reader sees a difference at 50 Hz. (Each wake-up also stalls this
# thread while the woken loop holds the GIL: 0.6-1.5 ms measured on a loaded 2-core machine.)
# A turn's tokens are detokenized when its text goes out, all since the last wake-up at once, and each
# caller gets them as one piece of text: one callback per turn per wake-up, not one per token, which
# also keeps the woken loop's turn with the GIL short.
DEFAULT_STREAM_INTERVAL_S = 0.02
# While the same turns only decode, the KV bytes in flight are read (for the pool's peak) every this
# many steps: caches then only grow, by whole 256-token blocks. Any change of the work is read at once.
OBSERVE_EVERY_STEPS = 8
# The single turn, with nothing else waiting, decodes up to this many tokens per step (or for
# about this long): the work around each step (cancel checks, admission, the mlx thread's queue) is then
# paid once per burst, as mlx-lm's own loop never pays it. Anything that needs a step ends a burst.
SINGLE_BURST_TOKENS = 8
SINGLE_SLICE_S = 0.02


def _attributed(turn: Turn, processor: Callable[..., Any]) -> Callable[..., Any]:
    """`processor`, but an exception is kept on the turn (failing only that turn) instead of escaping the batch step."""

    def run(tokens: Any, logits: Any) -> Any:
        if turn.error is None:
            try:
                return processor(tokens, logits)
            except Exception as exc:
                turn.failed(exc)
        return logits

    return run


def _deliver_texts(items: list[tuple[TextCallback, str]]) -> None:
    for on_text, text in items:
        on_text(text)


@dataclass
class SchedulerConfig:
    reuse: bool = True
    batching: bool = True
    prefill_step_size: int = 512
    share_prefix: bool = True
    context_window: int = 4096
    prefill_slice: PrefillSlice = DEFAULT_PREFILL_SLICE  # tokens per slice, "auto" or "off" (see prefill.py)


class Scheduler:
    """Runs turns on the mlx thread; see the module docstring."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: SchedulerConfig,
        pool: KVPool,
        shape: KVShape,
        trimmable: bool,
        processor_factory: ProcessorFactory | None = None,
        jobs_waiting: Callable[[], bool] | None = None,
        store: PrefixStore | None = None,
        make_cache: Callable[[], list[Any]] | None = None,
    ) -> None:
        """`jobs_waiting`: whether the mlx thread has a job queued (a new turn, a reset), which ends the
        single turn's burst; `store`: the disk tier under the shared prefixes (None: memory only);
        `make_cache`: a fresh prompt cache under the host's `--kv-bits` (None: mlx-lm's own)."""
        self.model, self.tokenizer, self.config, self.pool, self.shape = model, tokenizer, config, pool, shape
        self._make_cache = make_cache
        self._processor_factory = processor_factory
        self._jobs_waiting = jobs_waiting or (lambda: False)
        self.waiting: deque[Turn] = deque()
        self.prefilling: deque[Turn] = deque()
        self.decoding: dict[int, Turn] = {}
        # The most turns that ever decoded in the batch at once: what shows that turns arriving
        # together (a call's forks, parallel children) decode together.
        self.most_decoding = 0
        self.single: Turn | None = None  # the single turn: decoding on its own while nothing else decodes
        self.prefixes = SharedPrefixes()
        self.admission = Admission(
            pool,
            self.prefixes,
            shape,
            batching=config.batching,
            reuse=config.reuse,
            trimmable=trimmable,
            shares=self._shares_prefixes,
        )
        self.store = store
        self._batch: Any = None
        self._outbox: list[Turn] = []  # turns with tokens to stream (see `_flush`)
        self._flushed_at = 0.0
        self._first_text = False  # the outbox holds a turn's first text: send it now
        self._eos = frozenset(tokenizer.eos_token_ids)  # a set, not the tokenizer's property per token
        self._work: tuple[Any, ...] = ()  # what was in flight when the KV bytes were last read
        self._unobserved_steps = 0
        self._trimmable = trimmable  # False for hybrid caches (see `_prepare_cache`)
        self._grammars: Grammars | None = None  # made at the first request with a grammar
        self.call_format: tuple[Any, str, str] | None = None  # (grammar kind, start, end), set by the host
        # One sampler per (temperature, top_p): mlx-lm samples the rows sharing one as one batch.
        self._samplers: dict[tuple[float, float], Any] = {}
        self.policy = SlicePolicy.of(config.prefill_slice, config.prefill_step_size)  # None: slicing off
        self.groups: list[PrefillGroup] = []  # turns prefilled together (see `_prefill_sliced`)
        self._masks = MaskBatch(self._constrained_rows)

    # -- entry points (mlx thread) --------------------------------------------

    def submit(self, turn: Turn) -> None:
        """Tokenize and queue a turn; serialized mode runs it to completion here."""
        try:
            req = turn.request
            turn.ids, turn.text = build_prompt(
                self.tokenizer, req.messages, req.tools, turn.state.render, turn.state.token_ids, req.template_kwargs
            )
            turn.max_tokens = self._fit(len(turn.ids), turn.request.max_tokens)
            if turn.state.prompt_cache is None and turn.state.spill_path is None:  # nothing of its own to reuse
                turn.prefix = self._prefix_ids(turn) or []
        except Exception as exc:
            turn.deliver(False, exc)
            return
        self.waiting.append(turn)
        if not self.config.batching:  # to the end now, inside this job: the thread's steps do not see it
            try:
                while self.has_work():
                    self.step()
            except Exception as exc:
                self.fail_all(exc)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding or self.single)

    def step(self) -> None:
        """One unit of progress: admissions, one decode step for the batch (or a burst of the single
        turn's tokens, see SINGLE_BURST_TOKENS), one prefill slice when one is due (`prefill.py`).

        A turn's own failure (its prompt, processors, cache restore, reply parsing) fails only
        that turn; a failure of the shared batch step fails the turns in the batch. Anything else
        is a bug outside any one turn, after which nothing can be trusted: it escapes, and the
        mlx thread (or the serialized `submit`) fails every turn (`fail_all`).
        """
        self._drop_cancelled()
        self._admit()
        if self.decoding:
            tic = time.perf_counter()
            self._decode_step()
            self._decoded(time.perf_counter() - tic)
            if len(self.decoding) == 1 and not (self.waiting or self.prefilling or self.single or self._jobs_waiting()):
                self._leave_batch(next(iter(self.decoding.values())))
        if self.single is not None:
            single, tic, before = self.single, time.perf_counter(), len(self.single.generated)
            try:
                self._single_burst(single)
            except Exception as exc:
                self._fail(single, exc)
            self._decoded(time.perf_counter() - tic, len(single.generated) - before)
        if self.prefilling:
            self._prefill()
        self._observe()
        self._flush(force=not self.has_work())

    def _flush(self, force: bool = False) -> None:
        """Hand the streamed text so far to each caller's loop in one wake-up (see DEFAULT_STREAM_INTERVAL_S)."""
        if not self._outbox:
            return
        now = time.perf_counter()
        if not (force or self._first_text or now - self._flushed_at >= DEFAULT_STREAM_INTERVAL_S):
            return
        self._flushed_at, self._first_text = now, False
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[TextCallback, str]]] = {}
        for turn in self._outbox:
            turn.queued = False
            self._detokenize(turn)
            if text := turn.detokenizer.last_segment:
                sink: TextSink = turn.sink  # type: ignore[assignment]
                by_loop.setdefault(sink.loop, []).append((sink.on_text, text))
        self._outbox.clear()
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver_texts, items)
            except RuntimeError:  # that caller's loop is closed
                pass

    def _observe(self) -> None:
        """Keep the pool's peak: read the KV bytes when the work in flight changed, else every few steps."""
        head = self.prefilling[0].pos if self.prefilling else -1
        work = (len(self.waiting), len(self.prefilling), head, len(self.decoding), self.single is None)
        self._unobserved_steps += 1
        if work != self._work or self._unobserved_steps >= OBSERVE_EVERY_STEPS:
            self._work, self._unobserved_steps = work, 0
            self.pool.observe(self.resident_bytes(), self.resident_sessions())

    def resident_bytes(self) -> int:
        """KV bytes held right now: idle sessions, shared prefixes, work in flight."""
        batch = self._batch.prompt_cache_nbytes if self._batch is not None and self.decoding else 0
        active = batch + sum(cache_nbytes(t.cache) for t in self.prefilling) + sum(g.nbytes for g in self.groups)
        active += cache_nbytes(self.single.cache) if self.single is not None else 0
        snapshots = sum(cache_nbytes(t.state.snapshot[1]) for t in self._active() if t.state.snapshot)
        return self.pool.idle_bytes() + self.prefixes.nbytes() + active + snapshots

    def resident_sessions(self) -> int:
        """Sessions whose KV caches are in memory right now: idle ones not evicted, turns in flight."""
        return self.pool.resident(len(self._active()))

    def make_room(self) -> None:
        """Evict idle caches until what is held fits the pool's budget (it was lowered), as far as
        idle caches go: work in flight ends as admitted."""
        self.pool.make_room(self.admission.needed(self._active()))

    # -- admission ------------------------------------------------------------

    def _active(self) -> list[Turn]:
        return [*self.prefilling, *self.decoding.values(), *([self.single] if self.single else [])]

    def _admit(self) -> None:
        """Start the waiting turns, first come first served, while they fit (`admission.py`)."""
        while self.waiting:
            turn = self.waiting[0]
            try:
                verdict = self.admission.judge(turn, self._active())
                if verdict == "wait":
                    return
                if verdict == "start":
                    self.waiting.popleft()
                    self._start(turn)
            except PromptTooLongError as exc:  # it cannot fit even alone: refused, its session as it was
                self.waiting.popleft()
                turn.deliver(False, exc)
            except Exception as exc:  # e.g. its spilled cache cannot be read back
                self._fail(turn, exc)

    # -- prefill ----------------------------------------------------------------

    def fork(self, state: CacheState, parent_name: str) -> None:
        """Start a new session where session `parent_name` is: the ids it holds and how they render (so
        that the fork's prompt is spliced onto them token for token, as the parent's next one would be),
        and a shared prefix of its cache at exactly those ids, which the fork's first turn starts from
        (`_prepare_cache`) and prefills only the rest. The parent then starts from that entry as well (the
        same tokens, held once for it and its forks); a
        parent whose cache is spilled or dropped gives only its ids (the fork prefills them all), and a
        parent in a turn of its own (a background fork's) gives nothing: its cache and ids may disagree
        while it decodes, so the fork starts cold."""
        parent = self.pool.idle(parent_name)
        if parent is None:
            return
        state.token_ids, state.render, state.n_tool_calls = list(parent.token_ids), parent.render, parent.n_tool_calls
        if (
            self.config.reuse
            and parent.prompt_cache is not None
            and parent.token_ids
            and parent.token_ids not in self.prefixes
        ):
            # The parent goes on from the entry too: its conversation is then held once, for it and its forks.
            parent.prompt_cache = self.prefixes.add(parent.token_ids, parent.prompt_cache)
            parent.measure()

    def _start(self, turn: Turn) -> None:
        """Claim the session's cache (restoring a spilled one) and queue the prefill."""
        self.pool.claim(turn.name)
        self.pool.restore(turn.state)
        self.prefixes.restore_over(turn.state)
        turn.started = time.perf_counter()
        self.prefilling.append(turn)

    def _open(self, turn: Turn) -> None:
        """Pick the cache to continue from and plan the stops, when the prefill begins.

        Deferred until then so that a shared prefix computed by the turn before
        (prefills run one after another) is already there.
        """
        state = turn.state
        self._load_prefix(turn.prefix)
        turn.cache, turn.n_cached = self._prepare_cache(state, turn.ids)
        turn.shared = shared_prefix_of(turn.cache)
        turn.pos = turn.n_cached
        state.prompt_cache, state.token_ids, state.render = turn.cache, turn.ids[: turn.pos], None
        turn.stops = self._plan_stops(turn)
        if self.policy is None:  # slicing off: its prefill begins now (sliced: at its first slice)
            self._tell_prefill(turn)

    def _tell_prefill(self, turn: Turn) -> None:
        """Tell the turn's sink, once, that its prefill begins: the tokens to compute and those cached.
        Sliced, that is its first slice, not its opening: until then it waits behind other prompts."""
        if turn.told:
            return
        turn.told = True
        if turn.sink is not None and turn.sink.on_prefill is not None:
            with contextlib.suppress(RuntimeError):  # that caller's loop is closed
                turn.sink.loop.call_soon_threadsafe(turn.sink.on_prefill, len(turn.ids) - turn.pos, turn.pos)

    def _prepare_cache(self, state: CacheState, ids: list[int]) -> tuple[list[Any], int]:
        """The cache to continue from and how many prompt ids it already holds."""
        from mlx_lm.models.cache import trim_prompt_cache

        held, cache = state.token_ids, state.prompt_cache
        if state.dropped:  # evicted without a spill: what it held is prefilled again
            self.pool.counters.reprefilled_tokens += min(common_prefix(held, ids), len(ids) - 1)
            state.dropped = False
        if self.config.reuse and cache is not None and held:
            n = min(common_prefix(held, ids), len(ids) - 1)
            if n == len(held):
                return cache, n
            if self._trimmable:
                trim_prompt_cache(cache, len(held) - n)
                return cache, n
            if state.snapshot is not None and 0 < state.snapshot[0] <= n:
                return copy.deepcopy(state.snapshot[1]), state.snapshot[0]
        state.snapshot = None
        return self.prefixes.start(ids) or (self._fresh_cache(), 0)

    def _fresh_cache(self) -> list[Any]:
        """An empty prompt cache: the host's, under its `--kv-bits`, else mlx-lm's with dense layers that
        can start from a shared prefix."""
        if self._make_cache is not None:
            return self._make_cache()
        from mlx_lm.models.cache import make_prompt_cache

        from ..kv.prefixed_cache import shared_layers

        return shared_layers(make_prompt_cache(self.model))

    def _shares_prefixes(self) -> bool:
        """Whether this model's caches hold a shared prefix once (some layer starts from it), not a copy."""
        from ..kv.prefixed_cache import OverPrefix

        return any(isinstance(c, OverPrefix) for c in self._fresh_cache())

    def _load_prefix(self, prefix: list[int]) -> None:
        """A new session's prefix that no session of this process prefilled: from the disk tier, when stored."""
        if prefix and self.store is not None and prefix not in self.prefixes:
            cache = self.store.load(prefix)
            if cache is not None:
                self.prefixes.add(prefix, cache)

    def _prefix_ids(self, turn: Turn) -> list[int] | None:
        """The tokens of the system prompt and tools, when the prompt starts with them."""
        messages = turn.request.messages
        if not (self.config.reuse and self.config.share_prefix and messages and messages[0].get("role") == "system"):
            return None
        req = turn.request
        text = render(
            self.tokenizer, messages[:1], req.tools, generation_prompt=False, template_kwargs=req.template_kwargs
        )
        prefix = encode(self.tokenizer, text)
        ok = 0 < len(prefix) < len(turn.ids) - 1 and turn.ids[: len(prefix)] == prefix
        return prefix if ok else None

    def _plan_stops(self, turn: Turn) -> list[tuple[int, str]]:
        stops: list[tuple[int, str]] = []
        prefix = turn.prefix
        if prefix and turn.pos <= len(prefix) and prefix not in self.prefixes:
            stops.append((len(prefix), "prefix"))
        if self.config.reuse and not self._trimmable:
            req = turn.request
            snap = len(turn.ids) - generation_prompt_length(
                self.tokenizer, req.messages, req.tools, req.template_kwargs
            )
            if 0 < snap and turn.pos <= snap:
                stops.append((snap, "snapshot"))
        stops.append((len(turn.ids) - 1, "end"))
        return sorted(stops)

    def _prefill(self) -> None:
        if self.policy is not None:
            self._prefill_sliced()
            return
        tic, decoders = time.perf_counter(), [t for t in self._active() if t not in self.prefilling]
        self._prefill_unsliced()
        for turn in decoders:  # they waited for that chunk
            turn.prefill_wait_s += time.perf_counter() - tic

    def _prefill_unsliced(self) -> None:
        """`--prefill-slice off`: start decoding every turn ready to, together (mlx-lm's batch prefills
        what is left of their prompts, a chunk per decode step); else feed one turn one chunk.

        Turns that arrive together (the usual fan-out of sub-agents) then enter mlx-lm's batch in
        the same step: it prefills their remaining prompts as one padded batch and they decode in
        step from the first token, instead of one decoding on the single path while the next ones prefill.
        While nothing decodes yet, the ready turns wait for the turn behind them to reach its end
        (a hybrid model's turn first saves a snapshot); once others decode, ready turns join at once.
        """
        ready = self._ready()
        behind = self._behind(ready)
        batched = self.config.batching and (len(ready) > 1 or bool(self.decoding or self.single))
        if ready and batched and behind is None:
            for turn in ready:
                self.prefilling.remove(turn)
                try:
                    self._begin_decode(turn, join=True)
                except Exception as exc:
                    self._fail(turn, exc)
        elif self.prefilling:
            turn = behind or self.prefilling[0]
            try:
                self._prefill_chunk(turn)
            except Exception as exc:
                self._fail(turn, exc)

    def _behind(self, ready: list[Turn]) -> Turn | None:
        """The turn after the ready ones that they wait for: it still has a stop to save before its
        end and can join their batch, and nothing decodes yet (else the ready ones join at once)."""
        if not self.config.batching or self.decoding or self.single or len(self.prefilling) <= len(ready):
            return None
        turn = self.prefilling[len(ready)]  # where `_ready` stopped: opened, its next stop not "end"
        return turn if turn.stops[0][1] != "end" and self._batchable(turn.cache) else None

    def _ready(self) -> list[Turn]:
        """The turns at the head of the prefill queue with nothing left to save before they decode.

        A turn is opened (its cache chosen) only once every turn before it is ready, so that a
        shared prefix computed by one of those is already there.
        """
        ready: list[Turn] = []
        for turn in list(self.prefilling):
            try:
                if turn.cache is None:
                    self._open(turn)
            except Exception as exc:
                self._fail(turn, exc)
                continue
            if turn.stops[0][1] != "end" or not self._batchable(turn.cache):
                break
            ready.append(turn)
        return ready

    def _prefill_chunk(self, turn: Turn, n_tokens: int | None = None) -> None:
        """Feed one chunk (up to the next stop, at most `n_tokens`, the prefill step by default); at a
        stop, save what it asks for."""
        import mlx.core as mx

        if turn.cache is None:
            self._open(turn)
        self._tell_prefill(turn)
        stop, action = turn.stops[0]
        end = min(turn.pos + (n_tokens or self.config.prefill_step_size), stop)
        if end > turn.pos:
            tic = time.perf_counter()
            self.model(mx.array(turn.ids[turn.pos : end])[None], cache=turn.cache)
            mx.eval([c.state for c in turn.cache])
            turn.token_s = (time.perf_counter() - tic) / (end - turn.pos)
            turn.fresh = turn.fresh and action != "end"
            turn.pos = end
            turn.state.token_ids = turn.ids[:end]
        if turn.pos < stop:
            return
        turn.stops.pop(0)
        if action == "prefix":  # the turn goes on from the entry: the prefix is held once, for it and the next
            turn.cache = turn.state.prompt_cache = self.prefixes.add(turn.ids[:stop], turn.cache)
            turn.shared = shared_prefix_of(turn.cache)
            if self.store is not None:
                self.store.save(turn.ids[:stop], turn.cache)  # a copy; the writer thread does the disk
        elif action == "snapshot":
            turn.state.snapshot = (stop, copy.deepcopy(turn.cache))
        elif action == "end":
            self.prefilling.remove(turn)
            self._begin_decode(turn, self._joins_batch(turn))

    # -- sliced prefill (see prefill.py) ------------------------------------------

    def _prefill_sliced(self) -> None:
        """One slice of prefill, when the decoders have had their share: the shortest remaining prompt's
        (`prefill.pick`), on its own cache or its group's. Every other turn in flight waited for it."""
        opened = self._open_turns()
        decoding = bool(self.decoding or self.single)
        policy = self.policy
        assert policy is not None
        work = pick(opened, self.groups, decoding, self.config.prefill_step_size, self._batchable, self.config.batching)
        urgent = work is not None and policy.urgent(work)
        if work is None or not (urgent or policy.due(decoding)):
            return
        group = self._group(work.together) if work.together else work.group
        tic = time.perf_counter()
        if group is not None:
            fed = list(group.turns)
            n_tokens = policy.step_size if urgent else policy.size(decoding, len(fed), group.token_s)
            self._feed_group(group, n_tokens)
        elif work.turn is not None:
            fed = [work.turn]
            n_tokens = policy.step_size if urgent else policy.size(decoding, 1, work.turn.token_s)
            try:
                self._prefill_chunk(work.turn, n_tokens)
            except Exception as exc:
                self._fail(work.turn, exc)
        elapsed = time.perf_counter() - tic
        policy.sliced(elapsed, decoding)
        for turn in self._active():
            if turn not in fed:
                turn.prefill_wait_s += elapsed

    def _open_turns(self) -> list[Turn]:
        """The prefilling turns with their cache chosen (`_open`), opening them in order: a turn waits
        while one before it still has a shared prefix to save, which it may start from."""
        opened: list[Turn] = []
        for turn in list(self.prefilling):
            if turn.cache is None and turn.group is None:
                if any(action == "prefix" for t in opened for _, action in t.stops):
                    break
                try:
                    self._open(turn)
                except Exception as exc:
                    self._fail(turn, exc)
                    continue
            opened.append(turn)
        return opened

    def _group(self, turns: tuple[Turn, ...]) -> PrefillGroup | None:
        """Turns ready together, as one group (their caches merged into one padded batch)."""
        try:
            group = PrefillGroup(self.model, turns, self.config.prefill_step_size)
        except Exception as exc:
            for turn in turns:
                self._fail(turn, exc)
            return None
        self.groups.append(group)
        return group

    def _feed_group(self, group: PrefillGroup, n_tokens: int) -> None:
        """One slice of a group; the turns at their end leave it and decode, together (a group of one
        left goes on on its own cache). A failed slice fails the group's turns: their caches were in it."""
        for turn in group.turns:
            self._tell_prefill(turn)
        try:
            done = group.feed(n_tokens)
            for turn in done:
                self._ungroup(group, turn)
            if len(group.turns) == 1:
                self._ungroup(group, group.turns[0])
        except Exception as exc:
            self.groups.remove(group)
            for turn in list(group.turns):
                turn.group = None
                self._fail(turn, exc)
            return
        join = self.config.batching and (len(done) > 1 or bool(self.decoding or self.single))
        for turn in done:
            self.prefilling.remove(turn)
            try:
                self._begin_decode(turn, join)
            except Exception as exc:
                self._fail(turn, exc)

    def _ungroup(self, group: PrefillGroup, turn: Turn) -> None:
        """`turn` leaves its group with its own cache (the group ends with its last turn)."""
        turn.cache = turn.state.prompt_cache = group.take(turn)
        turn.state.token_ids = turn.ids[: turn.pos]
        turn.fresh = False
        if not group.turns:
            self.groups.remove(group)

    def _leave_group(self, turn: Turn) -> None:
        """A cancelled or failed turn leaves its group, if in one, with its cache (a turn left alone in
        the group goes on on its own cache)."""
        group = turn.group
        if group is not None:
            self._ungroup(group, turn)
            if len(group.turns) == 1:
                self._ungroup(group, group.turns[0])

    def _decoded(self, seconds: float, steps: int = 1) -> None:
        """Decode work took `seconds`: it counts towards the decoders' share (`SlicePolicy`)."""
        if self.policy is not None:
            self.policy.decoded(seconds, steps)

    # -- decode -----------------------------------------------------------------

    def _joins_batch(self, turn: Turn) -> bool:
        """Decode in the batch: others decode already. On mlx-lm's single-sequence path otherwise."""
        return self.config.batching and self._batchable(turn.cache) and bool(self.decoding or self.single)

    def _begin_decode(self, turn: Turn, join: bool) -> None:
        """Decode in the batch (`join`), or as the single turn: a burst of tokens per step, or to the end
        when serialized."""
        turn.processors = self._processor_factory(turn.name, turn.ids) if self._processor_factory else []
        turn.sampler = self._sampler(turn.request.temperature, turn.request.top_p)
        if turn.request.seed is not None:
            import mlx.core as mx

            mx.random.seed(turn.request.seed)  # its draws follow from here (alone in the batch: exactly)
        request = turn.request
        if (request.grammar_tools or request.answer_schema is not None) and (grammar := self._grammar(turn)):
            grammar.known = turn.generated  # the tokens this loop has read: no sync to learn them
            grammar.limit = turn.max_tokens  # a call still open near it is closed
            turn.grammar, turn.processors = grammar, [grammar, *turn.processors]
        if turn.request.thinking is not None and (
            budget := thought_budget(self.tokenizer, turn.request.thinking, turn.ids)
        ):
            turn.processors = [*turn.processors, budget]  # last: closing the thought wins over other processors
        turn.detokenizer = self.tokenizer.detokenizer if turn.sink else None
        if join:
            if self.single is not None:
                self._handover(self.single)
            self._insert(turn, turn.ids[turn.pos :], turn.ids[: turn.pos], turn.max_tokens)
            return
        turn.stream = SingleStream(self.model, turn.cache, turn.ids, turn.sampler, turn.processors)  # type: ignore[arg-type]
        self.most_decoding = max(self.most_decoding, 1)
        if self.config.batching and self._batchable(turn.cache):
            self.single = turn  # a burst of tokens per step, until it ends or a second turn arrives
        else:  # serialized (or a cache that cannot join a batch): to the end now
            self._decode_single(turn, turn.max_tokens, turn.cancel.is_set)
            if turn.stream is not None:  # stopped by its cancel
                self._end_single(turn, "cancelled")

    def _grammar(self, turn: Turn) -> Constrainer | None:
        """The turn's grammar for its calls and answer: first of its processors (a processor after it that
        forces a token wins, and the grammar lets go there: no check on the device of what the others
        left), before the thought budget, so a thought is closed even mid-call."""
        if self._grammars is None:
            assert self.call_format is not None, "a request with a grammar needs the host's call format"
            self._grammars = Grammars(self.tokenizer, *self.call_format)
        request = turn.request
        opened = prompt_opens_thought(self.tokenizer, turn.ids)
        thinks = bool(request.thinking)  # None: not a thinking model; 0: thinking off
        return self._grammars.processor(
            request.grammar_tools, request.answer_schema, opened, thinks, require_call=request.require_call
        )

    def _sampler(self, temperature: float, top_p: float = 1.0) -> Any:
        """The sampler of `temperature` and `top_p`, one object for every turn that has them: mlx-lm samples
        a batch whose rows share one sampler with one call, and row by row otherwise."""
        key = (temperature, top_p if temperature > 0 else 1.0)  # greedy: top_p changes nothing
        if key not in self._samplers:
            from mlx_lm.sample_utils import make_sampler

            self._samplers[key] = make_sampler(temp=key[0], top_p=key[1] if key[1] < 1 else 0.0)
        return self._samplers[key]

    def _insert(self, turn: Turn, prompt: list[int], held: list[int], max_tokens: int) -> None:
        """Into the batch: `held` is what the cache holds, `prompt` what is still to feed."""
        processors = [_attributed(turn, p) for p in turn.processors]
        # The grammar is the row's processor for its first step only (`masks.py`).
        turn.grammar_row = processors[0] if turn.grammar is not None else None
        turn.uid = self._ensure_batch().insert(
            [prompt],
            max_tokens=[max_tokens],
            caches=[turn.cache],
            all_tokens=[held],
            samplers=[turn.sampler],
            logits_processors=[processors],
        )[0]
        turn.state.prompt_cache = turn.cache = None  # the batch owns it now
        self.decoding[turn.uid] = turn
        self.most_decoding = max(self.most_decoding, len(self.decoding))

    def _masked(self, inputs: Any, cache: Any, logits: Any) -> Any:
        """The logits of a call of the batch's model: a decode step of the batch (its own caches) has
        its constrained rows masked together (`MaskBatch`)."""
        generation = self._batch._generation_batch  # type: ignore[union-attr]  # mlx-lm 0.32-0.33
        return self._masks.apply(generation, inputs, logits) if cache is generation.prompt_cache else logits

    def _constrained_rows(self, generation: Any) -> list[Row]:
        """The rows of `generation` held by a grammar, in its order; each one's grammar leaves its
        processors in mlx-lm's loop at its first step here."""
        rows: list[Row] = []
        for i, uid in enumerate(generation.uids):
            turn = self.decoding.get(uid)
            if turn is None or turn.grammar is None or turn.error is not None:
                continue
            processors = generation.logits_processors[i]
            if processors and processors[0] is turn.grammar_row:
                generation.logits_processors[i] = processors[1:]
            rows.append((i, turn.grammar, turn.failed))
        return rows

    def _single_burst(self, turn: Turn) -> None:
        """Tokens of the single turn until it ends, SINGLE_BURST_TOKENS or SINGLE_SLICE_S, or until something
        needs a step: a turn waiting or prefilling, a job for the mlx thread, its own cancel."""
        deadline = time.perf_counter() + SINGLE_SLICE_S
        if self.policy is not None and self.prefilling:  # a prompt to prefill: until the decoders' share ends
            deadline = min(deadline, self.policy.ready_at)

        def needs_a_step() -> bool:
            return bool(
                self.waiting
                or (self.prefilling and self.policy is None)
                or turn.cancel.is_set()
                or self._jobs_waiting()
                or time.perf_counter() >= deadline
            )

        self._decode_single(turn, SINGLE_BURST_TOKENS, needs_a_step)

    def _decode_single(self, turn: Turn, n_tokens: int, stop: Callable[[], bool]) -> None:
        """Up to `n_tokens` tokens of a turn on the single path: fewer when it ends, or when `stop()`,
        asked between tokens, says so. The text so far goes out between tokens."""
        for n in range(1, n_tokens + 1):
            if self._single_step(turn) is not None or n == n_tokens or stop():
                return
            self._flush()

    def _single_step(self, turn: Turn) -> FinishReason | None:
        """One token of a turn on the single path; its cache ends holding every token it produced."""
        done = self._on_token(turn, turn.stream.next())  # type: ignore[union-attr]
        if done is None and len(turn.generated) >= turn.max_tokens:
            done = "length"
        if done is not None:
            self._end_single(turn, done)
        return done

    def _end_single(self, turn: Turn, finish: FinishReason) -> None:
        turn.stream = None
        if self.single is turn:
            self.single = None
        self._finish(turn, finish, turn.cache)

    def _handover(self, turn: Turn) -> None:
        """A second turn is about to decode: the single one continues in the batch from its next token."""
        stream = turn.stream
        assert stream is not None
        self.single, turn.stream = None, None
        token = stream.handover()
        done = self._on_token(turn, token)
        if done is None and len(turn.generated) >= turn.max_tokens:
            done = "length"
        if done is not None:  # it ends on that very token: put it in the cache, as the batch would have
            stream.feed(token)
            self._finish(turn, done, turn.cache)
            return
        self._insert(turn, [token], turn.ids + turn.generated[:-1], turn.max_tokens - len(turn.generated))

    def _leave_batch(self, turn: Turn) -> None:
        """The last turn in the batch, with no other to come, goes on as the single turn: mlx-lm's
        single-sequence path is faster than a batch of one (agents end at different times, so a
        straggler is common). It continues from the token the batch computed next; a new turn brings
        it back (`_handover`)."""
        try:
            taken = take_from_batch(self._batch, turn.uid)  # type: ignore[arg-type]
            if taken is None:  # still prefilling in the batch, or a cache kind that stays there
                return
            del self.decoding[turn.uid]  # type: ignore[arg-type]
            turn.uid = None
            cache, held, pending = taken
            turn.cache = turn.state.prompt_cache = cache
            turn.stream = SingleStream(self.model, cache, held, turn.sampler, turn.processors, pending)
            self.single = turn
        except Exception as exc:
            self._fail(turn, exc)

    def _decode_step(self) -> None:
        try:
            if self.policy is None:  # slicing off: the step also prefilled a chunk of a prompt in the batch
                with self._batch.stats() as stats:
                    _, responses = self._batch.next()
                self._prefilled_in_batch(stats.prompt_time)
            else:
                _, responses = self._batch.next()
        except Exception as exc:
            self._fail_batch(exc)
            return
        for response in responses:
            turn = self.decoding.get(response.uid)
            if turn is None:
                continue
            try:
                if turn.error is not None:
                    raise turn.error
                done = self._on_token(turn, response.token)
                if response.finish_reason is not None:
                    del self.decoding[response.uid]
                    self._finish(turn, done or "length", response.prompt_cache)
            except Exception as exc:
                self._fail(turn, exc)

    def _prefilled_in_batch(self, seconds: float) -> None:
        """With slicing off, the batch step prefilled for `seconds`: the turns decoding already waited."""
        if seconds > 0:
            for turn in self.decoding.values():
                if turn.generated:
                    turn.prefill_wait_s += seconds

    def _on_token(self, turn: Turn, token: int) -> FinishReason | None:
        """Record a token and queue it for streaming (see `_flush`); "stop" at an end-of-turn token.

        Until a turn's first text appears its tokens are detokenized at once, so that text goes out
        at the end of this step.
        """
        if not turn.generated:
            turn.prompt_s = time.perf_counter() - turn.started
        turn.generated.append(token)
        if token in self._eos:
            return "stop"
        if turn.sink is not None:
            if not turn.queued:
                turn.queued = True
                self._outbox.append(turn)
            if not turn.streamed:
                self._detokenize(turn)
                if turn.detokenizer.text:
                    turn.streamed = self._first_text = True
        return None

    def _detokenize(self, turn: Turn) -> None:
        """Feed the turn's detokenizer the tokens it has not had (an end-of-turn token is not text)."""
        detokenizer, eos = turn.detokenizer, self._eos
        for token in turn.generated[turn.fed :]:
            if token not in eos:
                detokenizer.add_token(token)
        turn.fed = len(turn.generated)

    def _drop_cancelled(self) -> None:
        for turn in [t for t in (*self.waiting, *self._active()) if t.cancel.is_set()]:
            try:
                self._cancel(turn)
            except Exception as exc:
                self._fail(turn, exc)

    def _cancel(self, turn: Turn) -> None:
        """End a cancelled turn where it is, keeping what its cache holds."""
        if turn in self.waiting:
            self.waiting.remove(turn)
            turn.deliver(True, self._reply(turn, "cancelled"))
        elif turn in self.prefilling:
            self._leave_group(turn)
            self.prefilling.remove(turn)
            self.pool.park(turn.name, turn.state)
            turn.deliver(True, self._reply(turn, "cancelled"))
        elif turn is self.single:
            self._end_single(turn, "cancelled")
        else:
            del self.decoding[turn.uid]  # type: ignore[arg-type]
            cache, held = self._batch.remove([turn.uid], return_prompt_caches=True)[turn.uid]
            self._finish(turn, "cancelled", cache, held=list(held))

    def _finish(self, turn: Turn, finish: FinishReason, cache: list[Any] | None, held: list[int] | None = None) -> None:
        """Park the cache with the ids it holds (`held` when cut short inside the batch)."""
        state, req = turn.state, turn.request
        state.prompt_cache, state.token_ids = cache, held if held is not None else turn.ids + turn.generated
        turn.cache = turn.shared = None  # the session's now: evicting it frees it, however long the turn lives
        # A cut reply's caller keeps only the text that reached it (not the tokens still in the outbox):
        # no splicing onto it, the next prompt reuses the ids it shares with what was kept.
        cut = finish == "cancelled"
        state.render = None if cut else make_render_state(req.messages, req.tools, turn.text, finish == "stop")
        if not self.config.reuse:  # keep the ids (same prompts as with reuse), drop the cache
            state.prompt_cache, state.snapshot = None, None
        self.pool.park(turn.name, state)
        self._flush(force=True)  # the streamed text reaches the caller before its result does
        turn.deliver(True, self._reply(turn, finish))
        if not self.decoding and not self.prefilling:
            import mlx.core as mx

            mx.clear_cache()  # idle: give freed buffers back rather than keep them cached

    def _reply(self, turn: Turn, finish: FinishReason) -> Reply:
        body = turn.generated[:-1] if finish == "stop" else turn.generated
        # The raw reply: the host splits it into text and tool calls in the model's own format.
        raw = self.tokenizer.decode(body) if body else ""
        total = time.perf_counter() - turn.started if turn.started else 0.0
        usage = Usage(
            prompt_tokens=len(turn.ids),
            cached_tokens=turn.n_cached,
            generated_tokens=len(turn.generated),
            prompt_seconds=turn.prompt_s,
            generation_seconds=max(0.0, total - turn.prompt_s),
            prefill_wait_seconds=turn.prefill_wait_s,
        )
        grammar = turn.grammar.engaged if turn.grammar is not None else None
        return Reply(raw, [], [], finish, usage, raw, tuple(turn.generated), constrained=grammar)

    # -- helpers ----------------------------------------------------------------

    def _fit(self, n_prompt: int, max_tokens: int) -> int:
        room = self.config.context_window - n_prompt
        if room <= 0:
            raise PromptTooLongError(
                f"the prompt is {n_prompt} tokens but the context window is {self.config.context_window}; "
                "shorten the task or the conversation (compaction), or raise --context-window"
            )
        return max(1, min(max_tokens, room))

    @staticmethod
    def _batchable(cache: list[Any] | None) -> bool:
        return bool(cache) and all(hasattr(c, "merge") for c in cache)  # type: ignore[union-attr]

    def _ensure_batch(self) -> Any:
        if self._batch is None:
            from mlx_lm.generate import BatchGenerator

            self._batch = BatchGenerator(
                MaskedModel(self.model, self._masked),
                stop_tokens=[[t] for t in self.tokenizer.eos_token_ids],
                prefill_step_size=self.config.prefill_step_size,
                completion_batch_size=8,
                prefill_batch_size=8,
            )
        return self._batch

    def _fail(self, turn: Turn, exc: Exception) -> None:
        """This turn's own failure: it leaves the scheduler and its session starts over with an empty cache."""
        if turn in self.waiting:
            self.waiting.remove(turn)
        if turn in self.prefilling:
            self._leave_group(turn)
            self.prefilling.remove(turn)
        if turn.uid is not None and self.decoding.pop(turn.uid, None) is not None:
            self._batch.remove([turn.uid])
        if self.single is turn:
            self.single = None
        self.pool.claim(turn.name)  # not idle: it may have been parked before the failure
        turn.state.reset()
        turn.deliver(False, exc)

    def _fail_batch(self, exc: Exception) -> None:
        """The shared decode step failed: the batch and every cache in it are gone, so its turns fail.

        Turns still prefilling or waiting hold their own caches and go on; the failed turns'
        sessions start over with an empty cache.
        """
        turns = list(self.decoding.values())
        self.decoding.clear()
        self._batch = None
        for turn in turns:
            turn.state.reset()
            turn.deliver(False, exc)

    def fail_all(self, exc: BaseException) -> None:
        """Fail every turn, waiting or in flight: after an unexpected error no cache can be trusted."""
        turns = [*self.waiting, *self._active()]
        self.waiting.clear()
        self.prefilling.clear()
        self.groups.clear()
        self.decoding.clear()
        self._batch, self.single = None, None
        for turn in turns:
            turn.state.reset()  # a clean slate: the next turn prefills
            turn.deliver(False, exc)
