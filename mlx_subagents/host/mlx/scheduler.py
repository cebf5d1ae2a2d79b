"""The mlx thread's scheduler: turns through admission and their stages, batched or serialized.

Every turn (`turn.py`) moves through the same stages: waiting (admission control against
the KV budget, `admission.py`) -> prefilling (`prefill_stage.py`: in slices, reusing the session's
cache, a shared system-prompt prefix, or a hybrid model's snapshot) -> decoding (`decode_stage.py`)
-> finished (its cache parked in the pool for the next turn, its reply sent); the stage a turn is in
is its status (`stage_of`), and each stage writes only its own state of the turn (`turn.py`). What a
caller learns on the way (its prefill begun, its streamed text, then its reply) leaves through the
outbox (`outbox.py`), and `step()` returns it.
In batched mode every decoding session advances one token per step in one mlx-lm
`BatchGenerator` batch, and a prompt is prefilled on its own cache in slices between decode
steps, the time shared equally with the decoders (`prefill.py`), so a long
prompt does not stall them; a turn with nothing else in flight decodes on mlx-lm's
single-sequence path (the single turn), several tokens per step, moves into the batch
when a second turn arrives and back out when it is the last one left in it
with nothing else to come. In serialized mode a turn runs from start
to finish on its own, which is the reference the batched mode must match
token for token. The scheduler admits, starts, cancels, finishes and fails turns; each stage owns
the turns in it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ...errors import PromptTooLongError
from ..kv.kv_pool import CacheState, KVPool, KVShape
from ..kv.prefix_cache import SharedPrefixes
from ..kv.prefix_store import PrefixStore
from ..protocol import FinishReason, ProcessorFactory, Reply, Usage
from ..settings import OFF
from .admission import Admission
from .config import SchedulerConfig
from .decode_stage import DecodeStage
from .outbox import Outbox, Outputs
from .prefill_stage import PrefillStage
from .turn import Turn
from .turn_prompt import Basis, PromptMaker

__all__ = ["Scheduler", "SchedulerConfig"]

# While the same turns only decode, the KV bytes in flight are read (for the pool's peak) every this
# many steps: caches then only grow, by whole 256-token blocks. Any change of the work is read at once.
OBSERVE_EVERY_STEPS = 8
# The single turn, with nothing else waiting, decodes up to this many tokens per step (or for
# about this long): the work around each step (cancel checks, admission, the mlx thread's queue) is then
# paid once per burst, as mlx-lm's own loop never pays it. Anything that needs a step ends a burst.
SINGLE_BURST_TOKENS = 8
SINGLE_SLICE_S = 0.02


class Scheduler:
    """Runs turns on the mlx thread through its stages; see the module docstring."""

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
        call_format: tuple[Any, str, str] | None = None,
    ) -> None:
        """`jobs_waiting`: whether the mlx thread has a job queued (a new turn, a reset), which ends the
        single turn's burst; `store`: the disk tier under the shared prefixes (None: memory only);
        `make_cache`: a fresh prompt cache under the host's `--kv-bits` (None: mlx-lm's own);
        `call_format`: (grammar kind, start, end) of the model's calls (None: no call grammar)."""
        self.tokenizer, self.config, self.pool = tokenizer, config, pool
        self._jobs_waiting = jobs_waiting or (lambda: False)
        self.waiting: deque[Turn] = deque()
        self.prefixes = SharedPrefixes(pool=pool)
        self.outbox = Outbox(tokenizer)
        sliced = config.prefill_slice != OFF
        self.decode = DecodeStage(
            model,
            tokenizer,
            config,
            self.outbox,
            self._finish,
            self._fail,
            processor_factory,
            call_format,
            sliced,
            pool,
        )
        self.prompts = PromptMaker(tokenizer, config, trimmable, store)  # used on any thread
        self.prefill = PrefillStage(
            self.decode, self.outbox, self._fail, pool, self.prefixes, trimmable, store, make_cache, self.prompts
        )
        self.admission = Admission(
            pool,
            self.prefixes,
            shape,
            batching=config.batching,
            reuse=config.reuse,
            trimmable=trimmable,
            shares=self._shares_prefixes,
        )
        self._work: tuple[Any, ...] = ()  # what was in flight when the KV bytes were last read
        self._unobserved_steps = 0

    # -- entry points (mlx thread) --------------------------------------------

    def submit(self, turn: Turn) -> Outputs:
        """Queue a turn, with its prompt as made before (`turn_prompt.py`) if its session still holds what
        that was made from, else made here; serialized mode runs it to completion here. Returns what its
        caller was handed meanwhile (as `step` does)."""
        try:
            req, state, prompt = turn.request, turn.state, turn.prompt
            if prompt is None or not prompt.fits(state):
                prompt = turn.prompt = self.prompts.make(req, Basis.of(state))
            turn.ids, turn.text = prompt.ids, prompt.text
            turn.max_tokens = self._fit(len(turn.ids), turn.request.max_tokens)
            if state.prompt_cache is None and state.spill_path is None:  # nothing of its own to reuse
                prefix = prompt.prefix if prompt.prefix is not None else self.prompts.prefix_ids(req, turn.ids)
                turn.prefix = prefix or []
        except Exception as exc:
            self.outbox.end(turn, error=exc)
            return self.outbox.sent()
        self.waiting.append(turn)
        if not self.config.batching:  # to the end now, inside this job: the thread's steps do not see it
            try:
                while self.has_work():
                    self._advance()
            except Exception as exc:
                return self.fail_all(exc)
        return self.outbox.sent()

    def stage_of(self, turn: Turn) -> str:
        """A turn's status: the stage it is in ("waiting", "prefilling", "decoding"), or "ended"."""
        if turn in self.waiting:
            return "waiting"
        if turn in self.prefill.turns:
            return "prefilling"
        return "decoding" if turn in self.decode.turns() else "ended"

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefill.turns or self.decode.busy())

    def step(self) -> Outputs:
        """One unit of progress: admissions, one decode step for the batch (or a burst of the single
        turn's tokens, see SINGLE_BURST_TOKENS), one prefill slice when one is due (`prefill.py`).
        Returns each turn's outputs of this step (its prefill begun, its new text and tokens so far,
        its reply or error at its end), which the outbox has handed to its caller (`outbox.send`).

        A turn's own failure (its prompt, processors, cache restore, reply parsing) fails only
        that turn; a failure of the shared batch step fails the turns in the batch. Anything else
        is a bug outside any one turn, after which nothing can be trusted: it escapes, and the
        mlx thread (or the serialized `submit`) fails every turn (`fail_all`).
        """
        self._advance()
        return self.outbox.sent()

    def _advance(self) -> None:
        decode = self.decode
        self._drop_cancelled()
        self._admit()
        if decode.decoding:
            tic = time.perf_counter()
            decode.step()
            self.prefill.decoded(time.perf_counter() - tic)
            if len(decode.decoding) == 1 and not (
                self.waiting or self.prefill.turns or decode.single or self._jobs_waiting()
            ):
                decode.leave_batch(next(iter(decode.decoding.values())))
        if decode.single is not None:
            single, tic, before = decode.single, time.perf_counter(), len(decode.single.generated)
            try:
                self._single_burst(single)
            except Exception as exc:
                self._fail(single, exc)
            self.prefill.decoded(time.perf_counter() - tic, len(single.generated) - before)
        if self.prefill.turns:
            self.outbox.flush()  # a first token decoded in this step goes out before a slice holds it
            self.prefill.step()
        self._observe()
        self.outbox.flush(force=not self.has_work())

    def _single_burst(self, turn: Turn) -> None:
        """Tokens of the single turn until it ends, SINGLE_BURST_TOKENS or SINGLE_SLICE_S, or until something
        needs a step: a turn waiting or prefilling, a job for the mlx thread, its own cancel."""
        policy, prefilling = self.prefill.policy, self.prefill.turns
        deadline = time.perf_counter() + SINGLE_SLICE_S
        if policy is not None and prefilling:  # a prompt to prefill: until the decoders' share ends
            deadline = min(deadline, policy.ready_at)

        def needs_a_step() -> bool:
            return bool(
                self.waiting
                or (prefilling and policy is None)
                or turn.cancel.is_set()
                or self._jobs_waiting()
                or time.perf_counter() >= deadline
            )

        self.decode.run_single(turn, SINGLE_BURST_TOKENS, needs_a_step)

    def _observe(self) -> None:
        """Keep the pool's peak: read the KV bytes when the work in flight changed, else every few steps."""
        prefilling = self.prefill.turns
        head = prefilling[0].prefill.pos if prefilling else -1  # type: ignore[union-attr]
        work = (len(self.waiting), len(prefilling), head, len(self.decode.decoding), self.decode.single is None)
        self._unobserved_steps += 1
        if work != self._work or self._unobserved_steps >= OBSERVE_EVERY_STEPS:
            self._work, self._unobserved_steps = work, 0
            self.pool.observe(self.resident_bytes(), self.resident_sessions())

    def resident_bytes(self) -> int:
        """KV bytes held right now: the pool's one read (every cache registers with it)."""
        return self.pool.held_bytes()

    def resident_sessions(self) -> int:
        """Sessions whose KV caches are in memory right now: idle ones not evicted, turns in flight."""
        return self.pool.resident(len(self._active()))

    def make_room(self) -> None:
        """Evict idle caches until what is held fits the pool's budget (it was lowered), as far as
        idle caches go: work in flight ends as admitted."""
        self.pool.reserve(self.admission.needed(self._active()))

    # -- admission ------------------------------------------------------------

    def _active(self) -> list[Turn]:
        return [*self.prefill.turns, *self.decode.turns()]

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
                self.outbox.end(turn, error=exc)
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
        self.prefill.admit(turn)

    def _shares_prefixes(self) -> bool:
        """Whether this model's caches hold a shared prefix once (some layer starts from it), not a copy."""
        from ..kv.prefixed_cache import OverPrefix

        return any(isinstance(c, OverPrefix) for c in self.prefill.fresh_cache())

    # -- leaving ------------------------------------------------------------------

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
            self.outbox.end(turn, self._reply(turn, "cancelled"))
        elif turn in self.prefill.turns:
            self.prefill.remove(turn)
            self.pool.park(turn.name, turn.state)
            self.outbox.end(turn, self._reply(turn, "cancelled"))
        else:
            self.decode.cancel(turn)

    def _finish(self, turn: Turn, finish: FinishReason, cache: list[Any] | None, held: list[int] | None = None) -> None:
        """Park the cache with the ids it holds (`held` when cut short inside the batch)."""
        state, req = turn.state, turn.request
        state.prompt_cache, state.token_ids = cache, held if held is not None else turn.ids + turn.generated
        # A cut reply's caller keeps only the text that reached it (not the tokens still in the outbox):
        # no splicing onto it, the next prompt reuses the ids it shares with what was kept.
        cut = finish == "cancelled"
        assert turn.prompt is not None  # made at submit
        state.render = None if cut else replace(turn.prompt.render, ended_with_eos=finish == "stop")
        if not self.config.reuse:  # keep the ids (same prompts as with reuse), drop the cache
            state.prompt_cache, state.snapshot = None, None
        self.pool.park(turn.name, state)
        self.outbox.end(turn, self._reply(turn, finish))  # after the text streamed so far
        if req.store_prompt and not cut:  # after the reply: its caller does not wait for the copy
            self.prefill.store_prompt(turn)
        if not self.decode.decoding and not self.prefill.turns:
            import mlx.core as mx

            mx.clear_cache()  # idle: give freed buffers back rather than keep them cached

    def _reply(self, turn: Turn, finish: FinishReason) -> Reply:
        body = turn.generated[:-1] if finish == "stop" else turn.generated
        # The raw reply: the host splits it into text and tool calls in the model's own format.
        raw = self.tokenizer.decode(body) if body else ""
        prefill, decode = turn.prefill, turn.decode  # None: it ended before that stage
        total = time.perf_counter() - prefill.started if prefill is not None else 0.0
        prompt_s = decode.prompt_s if decode is not None else 0.0
        # A turn cancelled before it decoded went through only what its cache holds: what it prefilled is
        # counted, not the rest of its prompt (none of it while it waited).
        went = len(turn.ids) if decode is not None else prefill.pos if prefill is not None else 0
        usage = Usage(
            prompt_tokens=went,
            cached_tokens=prefill.n_cached if prefill is not None else 0,
            generated_tokens=len(turn.generated),
            prompt_seconds=prompt_s,
            generation_seconds=max(0.0, total - prompt_s),
            prefill_wait_seconds=(prefill.wait_s if prefill else 0.0) + (decode.wait_s if decode else 0.0),
            drafted_tokens=decode.drafts.drafted if decode is not None else 0,
            accepted_tokens=decode.drafts.accepted if decode is not None else 0,
        )
        grammar = decode.grammar.engaged if decode is not None and decode.grammar is not None else None
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

    def _fail(self, turn: Turn, exc: Exception) -> None:
        """This turn's own failure: it leaves the scheduler and its session starts over with an empty cache."""
        if turn in self.waiting:
            self.waiting.remove(turn)
        if turn in self.prefill.turns:
            self.prefill.remove(turn)
        self.decode.remove(turn)
        self.pool.claim(turn.name)  # not idle: it may have been parked before the failure
        turn.state.reset()
        self.outbox.end(turn, error=exc)

    def fail_all(self, exc: BaseException) -> Outputs:
        """Fail every turn, waiting or in flight: after an unexpected error no cache can be trusted.
        Returns what their callers were handed (as `step` does)."""
        turns = [*self.waiting, *self._active()]
        self.waiting.clear()
        self.prefill.clear()
        self.decode.clear()
        for turn in turns:
            turn.state.reset()  # a clean slate: the next turn prefills
            self.outbox.end(turn, error=exc)
        return self.outbox.sent()
