"""The decode stage: the turns generating their replies, in one mlx-lm `BatchGenerator` batch or, for
a turn with nothing else in flight, on mlx-lm's single-sequence path (the single turn).

A turn enters from the prefill stage (`begin`) with its cache holding all but its last prompt token.
In the batch every turn advances one token per `step`; the single turn decodes several tokens per
scheduler step (`run_single`), moves into the batch when a second turn arrives (`handover`) and back
out when it is the last one left (`leave_batch`). Each token goes to the outbox; a turn that ends
goes back to the scheduler (`ended`) with the cache that holds its reply, and a turn's own failure
(`failed`) fails only that turn. The grammar's masks of the batch's constrained rows are applied
together in the batch's model call (`masks.py`); what a turn decodes with (its processors, its sampler)
is made as it enters (`processors.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ..calls.constrainer import Constrainer
from ..kv.kv_pool import KVPool
from ..kv.rewind import refusal, rows_refusal
from ..protocol import FinishReason, ProcessorFactory
from .config import SchedulerConfig
from .draft_costs import DraftWidths
from .drafted import DraftedStream
from .drafted_batch import RowTokens, drafted_step
from .drafted_grammar import walk
from .masks import MaskBatch, MaskedModel, Row
from .outbox import Outbox
from .processors import Processors
from .single import SingleStream, take_from_batch
from .turn import DecodeState, Turn
from .verify import Sampling

log = logging.getLogger(__name__)

# A turn leaves the stage: (turn, why, the cache holding its reply, the ids it holds when cut inside the batch).
# Rows mlx-lm's batch decodes at once: a turn handed over past them waits for a row to end.
COMPLETION_BATCH_SIZE = 8
# A turn handed over has its first words out before the next prefill slice, or this many tokens (a reply
# that opens with a call, or whitespace on and on, holds the prefill up no longer: `starting`).
FIRST_WORDS_TOKENS = 8

Ended = Callable[[Turn, FinishReason, "list[Any] | None", "list[int] | None"], None]
Failed = Callable[[Turn, Exception], None]


def _started(turn: Turn) -> bool:
    """Whether `turn` has its first words out (`Outbox.token`): its first token where its caller reads no
    text as it comes, and at most `FIRST_WORDS_TOKENS` tokens."""
    generated = turn.generated
    streams = turn.sink is not None and turn.sink.streams
    return bool(generated) and (turn.out.streamed or not streams or len(generated) >= FIRST_WORDS_TOKENS)


def batchable(cache: list[Any] | None) -> bool:
    """Whether a cache can join mlx-lm's batch: every layer merges into its batch class."""
    return bool(cache) and all(hasattr(c, "merge") for c in cache)  # type: ignore[union-attr]


def _batch_nbytes(batch: Any) -> int:
    """The bytes of the rows in an mlx-lm `BatchGenerator`: waiting, prefilling and decoding."""
    return int(batch.prompt_cache_nbytes)


def _attributed(turn: Turn, processor: Callable[..., Any]) -> Callable[..., Any]:
    """`processor`, but an exception is kept on the turn (failing only that turn) instead of escaping the batch step."""

    def run(tokens: Any, logits: Any) -> Any:
        if turn.decode.error is None:
            try:
                return processor(tokens, logits)
            except Exception as exc:
                turn.decode.failed(exc)
        return logits

    return run


class DecodeStage:
    """The decoding turns: the batch's by uid (`decoding`) and the single turn (`single`)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: SchedulerConfig,
        outbox: Outbox,
        ended: Ended,
        failed: Failed,
        processor_factory: ProcessorFactory | None = None,
        call_format: tuple[Any, str, str] | None = None,
        sliced: bool = True,
        pool: KVPool | None = None,
    ) -> None:
        """`call_format`: (grammar kind, start, end) of the model's calls, which a grammar needs;
        `sliced`: prompts are prefilled in slices (else the batch prefills, and its steps count it);
        `pool`: where the batch and the caches taken out of it register."""
        self.model, self.tokenizer, self.config, self.outbox = model, tokenizer, config, outbox
        self._ended, self._failed = ended, failed
        self.processor_factory = processor_factory
        self.processors = Processors(tokenizer, call_format)
        self._sliced = sliced
        self.pool = pool if pool is not None else KVPool(None)
        self.decoding: dict[int, Turn] = {}
        self.single: Turn | None = None  # decoding on its own while nothing else decodes
        # The most turns that ever decoded in the batch at once: what shows that turns arriving
        # together (a call's forks, parallel children) decode together.
        self.most_decoding = 0
        self.batch: Any = None
        self._eos = frozenset(tokenizer.eos_token_ids)  # a set, not the tokenizer's property per token
        self._masks = MaskBatch(self._constrained_rows)
        self._refused = False  # the batch's rows_refusal was logged
        self.widths = DraftWidths()  # whether drafts pay in the batch, from its steps' measured costs
        self._vocab = 0  # the width of the batch's logits (a grammar-held row's draft is masked that wide)
        self._walked: set[Constrainer] = set()  # the grammars masking their rows' drafts in this drafted step

    def turns(self) -> list[Turn]:
        return [*self.decoding.values(), *([self.single] if self.single else [])]

    def starting(self) -> bool:
        """Whether a turn handed over has its first words still to come (`_started`) and a row of the batch
        to get them in (a turn with a token has its row; one past `COMPLETION_BATCH_SIZE` rows waits for a
        row to end: nothing to wait for meanwhile). Words, not a token: a reply often opens with a newline
        or two, which its caller strips, and between two slices that run at once (a short prompt's, see
        `prefill.py`) the batch decodes one token, so a first token of whitespace would reach its caller
        as words only a prefill or two later."""
        turns = self.turns()
        rows = sum(1 for t in turns if t.generated)
        return any(t.generated or rows < COMPLETION_BATCH_SIZE for t in turns if not _started(t))

    def busy(self) -> bool:
        """Whether any turn decodes (a turn that arrives then joins the batch)."""
        return bool(self.decoding or self.single)

    def joins(self, cache: list[Any] | None) -> bool:
        """Decode a turn with `cache` in the batch: others decode already. On mlx-lm's single-sequence
        path otherwise."""
        return self.config.batching and batchable(cache) and self.busy()

    def begin(self, turn: Turn, cache: list[Any] | None, shared: tuple[int, Any] | None, join: bool) -> None:
        """Decode in the batch (`join`), or as the single turn: a burst of tokens per step, or to the end
        when serialized. `cache` holds all but the last prompt token; `shared`: the shared prefix it
        starts from. The turn's decode state starts here."""
        turn.decode = DecodeState(cache, shared)
        decode = turn.decode
        decode.processors, decode.sampler, decode.grammar = self.processors.make(turn, self.processor_factory)
        if join:
            if self.single is not None:
                self.handover(self.single)
            pos = turn.prefill.pos  # type: ignore[union-attr]  # a turn decodes after its prefill
            self._insert(turn, turn.ids[pos:], turn.ids[:pos], turn.max_tokens)
            return
        turn.decode.stream = self._stream(turn, turn.decode.cache, turn.ids)  # type: ignore[arg-type]
        self.most_decoding = max(self.most_decoding, 1)
        if self.config.batching and batchable(turn.decode.cache):
            self.single = turn  # a burst of tokens per step, until it ends or a second turn arrives
        else:  # serialized (or a cache that cannot join a batch): to the end now
            self.run_single(turn, turn.max_tokens, turn.cancel.is_set)
            if turn.decode.stream is not None:  # stopped by its cancel
                self.end_single(turn, "cancelled")

    def _stream(self, turn: Turn, cache: list[Any], context: list[int], pending: Any = None) -> Any:
        """The single turn's stream: with drafts (`drafted.py`) where they are on and can run, which is
        where no logits processor but its grammar reads the turn's tokens one by one (not a thought budget,
        a forcing script) and every layer of its cache rewinds (`kv.rewind.refusal`: not a hybrid model's
        recurrent layers); mlx-lm's single path otherwise."""
        decode = turn.decode
        if self.drafts and decode.processors in ([], [decode.grammar]) and refusal(cache) is None:
            token = None if pending is None else int(pending.item())
            sampling = Sampling.of(turn.request)
            return DraftedStream(
                self.model, cache, context, sampling, decode.drafter, token, decode.drafts, decode.grammar
            )
        return SingleStream(self.model, cache, context, turn.decode.sampler, turn.decode.processors, pending)

    @property
    def drafts(self) -> bool:
        """Whether single turns draft: `lookup`, or `auto` on a GPU, where a forward of a few tokens costs
        about what one token's does (memory-bound). On a CPU it costs more with each token, and drafts
        measured no faster there (`benchmarks/speculative.py`), so `auto` leaves them off."""
        import mlx.core as mx

        draft = self.config.draft
        return draft == "lookup" or (draft == "auto" and mx.default_device().type == mx.DeviceType.gpu)

    # -- the batch ----------------------------------------------------------------

    def ensure_batch(self) -> Any:
        if self.batch is None:
            from mlx_lm.generate import BatchGenerator

            self.batch = BatchGenerator(
                MaskedModel(self.model, self._masked),
                stop_tokens=[[t] for t in self.tokenizer.eos_token_ids],
                prefill_step_size=self.config.prefill_step_size,
                completion_batch_size=COMPLETION_BATCH_SIZE,
                prefill_batch_size=8,
            )
            self.pool.hold(self.batch, _batch_nbytes)
        return self.batch

    def _insert(self, turn: Turn, prompt: list[int], held: list[int], max_tokens: int) -> None:
        """Into the batch: `held` is what the cache holds, `prompt` what is still to feed."""
        processors = [_attributed(turn, p) for p in turn.decode.processors]
        # The grammar is the row's processor for its first step only (`masks.py`).
        turn.decode.grammar_row = processors[0] if turn.decode.grammar is not None else None
        batch = self.ensure_batch()
        self.pool.leave(turn.decode.cache)  # the batch counts it from now on
        turn.decode.uid = batch.insert(
            [prompt],
            max_tokens=[max_tokens],
            caches=[turn.decode.cache],
            all_tokens=[held],
            samplers=[turn.decode.sampler],
            logits_processors=[processors],
        )[0]
        turn.state.prompt_cache = turn.decode.cache = None  # the batch owns it now
        self.decoding[turn.decode.uid] = turn
        self.most_decoding = max(self.most_decoding, len(self.decoding))

    def _masked(self, inputs: Any, cache: Any, logits: Any) -> Any:
        """The logits of a call of the batch's model: a decode step of the batch (its own caches) has
        its constrained rows masked together (`MaskBatch`)."""
        generation = self.batch._generation_batch  # type: ignore[union-attr]  # mlx-lm 0.32-0.33
        self._vocab = logits.shape[-1]
        return self._masks.apply(generation, inputs, logits) if cache is generation.prompt_cache else logits

    def _constrained_rows(self, generation: Any) -> list[Row]:
        """The rows of `generation` held by a grammar, in its order; each one's grammar leaves its
        processors in mlx-lm's loop at its first step here."""
        rows: list[Row] = []
        for i, uid in enumerate(generation.uids):
            turn = self.decoding.get(uid)
            grammar = turn.decode.grammar if turn is not None and turn.decode.error is None else None
            if grammar is None or grammar in self._walked:
                continue
            processors = generation.logits_processors[i]
            if processors and processors[0] is turn.decode.grammar_row:
                generation.logits_processors[i] = processors[1:]
            rows.append((i, grammar, turn.decode.failed))  # type: ignore[union-attr]
        return rows

    def step(self) -> None:
        """One step of the batch: a token for each turn in it, or where rows drafted, one forward that
        verifies their drafts (`drafted_batch.py`) and gives each row its kept tokens. A failure of the
        step itself fails the batch's turns."""
        try:
            if (drafted := self._drafted_step()) is not None:
                self._on_rows(drafted)
                return
            start, prompts = time.perf_counter(), self._prompts_waiting()
            if not self._sliced:  # the step also prefilled a chunk of a prompt in the batch
                with self.batch.stats() as stats:
                    _, responses = self.batch.next()
                self._prefilled_in_batch(stats.prompt_time)
            else:
                _, responses = self.batch.next()
            self.widths.plain(None if prompts else time.perf_counter() - start)
        except Exception as exc:
            self._fail_batch(exc)
            return
        self._on_rows([RowTokens(r.uid, [r.token], 0, r.finish_reason, r.prompt_cache) for r in responses])

    def _drafted_step(self) -> list[RowTokens] | None:
        """The rows' verifying forward, when drafts are on, a row drafted and drafts pay (`draft_costs.py`);
        None for mlx-lm's plain step. A row drafts where no logits processor reads its tokens (a grammar-held
        row's draft is walked through its grammar: `drafted_grammar.py`); the batch drafts while no prompt
        waits in it (those steps prefill too) and every layer rewinds row by row (`kv.rewind.rows_refusal`)."""
        if not self.drafts or self._prompts_waiting():
            return None
        generation = self.batch._generation_batch
        if not generation.uids or self._rows_refusal(generation.prompt_cache):
            return None
        rows = []
        for i, uid in enumerate(generation.uids):
            turn = self.decoding.get(uid)
            read = generation.logits_processors[i]  # a processor reads its tokens one by one (not the grammar's)
            drafter = turn.decode.drafter if turn is not None and not read and turn.decode.error is None else None
            if drafter is not None and drafter.paused:
                drafter.propose(())  # a paused drafter counts the step without reading the tokens
                drafter = None
            rows.append((turn, drafter, generation.max_tokens[i] - generation._num_tokens[i] - 1))
        outlooks = [d.outlook() if d is not None else [0.0] for _, d, _ in rows]
        most = [min(len(o) - 1, max(0, left)) for o, (_, _, left) in zip(outlooks, rows, strict=True)]
        if not self.widths.promising(most, outlooks):
            return None
        pending = self.widths.read(generation._next_tokens)
        drafts = [
            d.propose([*t.ids, *t.generated, y])[:n] if d is not None and t is not None else []
            for (t, d, _), y, n in zip(rows, pending, most, strict=True)
        ]
        width = self.widths.choose([len(d) for d in drafts], outlooks)
        if width == 1:
            return None
        drafts = [d[: width - 1] for d in drafts]
        held = walk([t for t, _, _ in rows], pending, drafts, self._vocab)  # cut where each grammar refuses
        samplings = [
            Sampling.of(t.request) if d or i in held else None for i, ((t, _, _), d) in enumerate(zip(rows, drafts))
        ]
        self._walked = {h.grammar for h in held.values()}  # masked by `drafted_step`, not `MaskBatch`
        with self.widths.drafting(width):
            out = drafted_step(self.batch._generation_batch, drafts, samplings, held)
        self._walked = set()  # `MaskBatch` masks them again from the next step (a failed step fails them all)
        for (turn, drafter, _), draft, row in zip(rows, drafts, out, strict=True):
            if draft and turn is not None and drafter is not None:
                drafter.observe(len(draft), row.accepted)
                counts = turn.decode.drafts
                counts.forwards, counts.drafted = counts.forwards + 1, counts.drafted + len(draft)
                counts.accepted, counts.tokens = counts.accepted + row.accepted, counts.tokens + row.accepted + 1
        return out

    def _prompts_waiting(self) -> bool:
        """Whether a prompt waits in the batch (its next step prefills a chunk of it)."""
        return bool(self.batch._unprocessed_sequences or len(self.batch._prompt_batch))

    def _rows_refusal(self, cache: list[Any]) -> str | None:
        """`rows_refusal` of the batch's cache, said once in the log."""
        problem = rows_refusal(cache)
        if problem is not None and not self._refused:
            self._refused = True
            log.info(problem)
        return problem

    def _on_rows(self, rows: list[RowTokens]) -> None:
        """Each row's tokens of a step, in order, to its turn; the rows that ended leave."""
        for row in rows:
            turn = self.decoding.get(row.uid)
            if turn is None:
                continue
            try:
                if turn.decode.error is not None:
                    raise turn.decode.error
                done = None
                for token in row.tokens:
                    done = self._on_token(turn, token)
                if row.finish_reason is not None:
                    del self.decoding[row.uid]
                    self._end(turn, done or "length", row.prompt_cache, None)
            except Exception as exc:
                self._failed(turn, exc)

    def _prefilled_in_batch(self, seconds: float) -> None:
        """With slicing off, the batch step prefilled for `seconds`: the turns decoding already waited."""
        if seconds > 0:
            for turn in self.decoding.values():
                if turn.decode.generated:
                    turn.decode.wait_s += seconds

    def _fail_batch(self, exc: Exception) -> None:
        """The shared decode step failed: the batch and every cache in it are gone, so its turns fail.

        Turns still prefilling or waiting hold their own caches and go on; the failed turns'
        sessions start over with an empty cache.
        """
        turns = list(self.decoding.values())
        self.decoding.clear()
        self.batch = None
        for turn in turns:
            turn.state.reset()
            self.outbox.end(turn, error=exc)

    # -- the single turn ------------------------------------------------------------

    def run_single(self, turn: Turn, n_tokens: int, stop: Callable[[], bool]) -> None:
        """Up to `n_tokens` tokens of a turn on the single path: fewer when it ends, or when `stop()`,
        asked between tokens, says so. The text so far goes out between tokens."""
        for n in range(1, n_tokens + 1):
            if self._single_step(turn) is not None or n == n_tokens or stop():
                return
            self.outbox.flush()

    def _single_step(self, turn: Turn) -> FinishReason | None:
        """One forward of a turn on the single path: one token, or with drafts each token it kept, in
        order; its cache ends holding every token it produced."""
        stream = turn.decode.stream
        kept = (
            stream.next(turn.max_tokens - len(turn.decode.generated))
            if isinstance(stream, DraftedStream)
            else [stream.next()]
        )  # type: ignore[union-attr]
        for used, token in enumerate(kept, 1):
            done = self._on_token(turn, token)
            if done is None and len(turn.decode.generated) >= turn.max_tokens:
                done = "length"
            if done is not None:
                self.end_single(turn, done, used)
                return done
        return None

    def end_single(self, turn: Turn, finish: FinishReason, used: int | None = None) -> None:
        """The single turn ends: with drafts, after the `used`-th token of its last forward (None: all)."""
        if isinstance(turn.decode.stream, DraftedStream):
            turn.decode.stream.end(used)
        turn.decode.stream = None
        if self.single is turn:
            self.single = None
        self._end(turn, finish, turn.decode.cache, None)

    def handover(self, turn: Turn) -> None:
        """A second turn is about to decode: the single one continues in the batch from its next token."""
        stream = turn.decode.stream
        assert stream is not None
        self.single, turn.decode.stream = None, None
        token = stream.handover()
        if token is None:  # drafted: its last token is not in the cache yet, the batch feeds it
            assert isinstance(stream, DraftedStream)
            held, last = stream.tokens[:-1], stream.tokens[-1]
            self._insert(turn, [last], held, turn.max_tokens - len(turn.decode.generated))
            return
        done = self._on_token(turn, token)
        if done is None and len(turn.decode.generated) >= turn.max_tokens:
            done = "length"
        if done is not None:  # it ends on that very token: put it in the cache, as the batch would have
            stream.feed(token)
            self._end(turn, done, turn.decode.cache, None)
            return
        self._insert(turn, [token], turn.ids + turn.decode.generated[:-1], turn.max_tokens - len(turn.decode.generated))

    def leave_batch(self, turn: Turn) -> None:
        """The last turn in the batch, with no other to come, goes on as the single turn: mlx-lm's
        single-sequence path is faster than a batch of one (agents end at different times, so a
        straggler is common). It continues from the token the batch computed next; a new turn brings
        it back (`handover`)."""
        try:
            taken = take_from_batch(self.batch, turn.decode.uid)  # type: ignore[arg-type]
            if taken is None:  # still prefilling in the batch, or a cache kind that stays there
                return
            del self.decoding[turn.decode.uid]  # type: ignore[arg-type]
            turn.decode.uid = None
            cache, held, pending = taken
            turn.decode.cache = turn.state.prompt_cache = self.pool.register(cache)
            turn.decode.stream = self._stream(turn, cache, held, pending)
            self.single = turn
        except Exception as exc:
            self._failed(turn, exc)

    # -- tokens and leaving -----------------------------------------------------------

    def _on_token(self, turn: Turn, token: int) -> FinishReason | None:
        """Record a token and queue it for streaming (the outbox); "stop" at an end-of-turn token. A grammar
        that failed on what it allowed ends its turn here, with its error (`Constrainer.failure`)."""
        if (grammar := turn.decode.grammar) is not None and grammar.failure is not None:
            raise grammar.failure
        if not turn.decode.generated:
            turn.decode.prompt_s = time.perf_counter() - turn.prefill.started  # type: ignore[union-attr]
        turn.decode.generated.append(token)
        if token in self._eos:
            return "stop"
        self.outbox.token(turn)
        return None

    def cancel(self, turn: Turn) -> None:
        """End a cancelled decoding turn, keeping what its cache holds."""
        if turn is self.single:
            self.end_single(turn, "cancelled")
            return
        del self.decoding[turn.decode.uid]  # type: ignore[arg-type]
        cache, held = self.batch.remove([turn.decode.uid], return_prompt_caches=True)[turn.decode.uid]
        self._end(turn, "cancelled", cache, list(held))

    def _end(self, turn: Turn, finish: FinishReason, cache: list[Any] | None, held: list[int] | None) -> None:
        """The turn leaves the stage, to the scheduler (`ended`) with the cache that holds its reply: its
        decode state keeps no cache from now on (the session's now: evicting it frees it)."""
        decode = turn.decode
        assert decode is not None
        decode.cache = decode.shared = None
        self._ended(turn, finish, cache, held)

    def waited(self, seconds: float, turns: list[Turn]) -> None:
        """`turns` (decoding) waited `seconds` while prompts were prefilled."""
        for turn in turns:
            turn.decode.wait_s += seconds  # type: ignore[union-attr]

    def remove(self, turn: Turn) -> None:
        """A failed turn leaves the stage (its cache is gone with it)."""
        if turn.decode is None:  # it failed on its way in
            return
        if turn.decode.uid is not None and self.decoding.pop(turn.decode.uid, None) is not None:
            self.batch.remove([turn.decode.uid])
        if self.single is turn:
            self.single = None

    def clear(self) -> None:
        """Forget every turn and the batch (after an unexpected error, nothing in them can be trusted)."""
        self.decoding.clear()
        self.batch, self.single = None, None
