"""The prefill stage: admitted turns' prompts fed into their caches, then handed to the decode stage.

A turn is opened when its prefill begins (`open`: the cache it continues from, its session's, a
shared prefix or a hybrid model's snapshot, and its stops: a new shared prefix to save, a snapshot,
its end), so that a shared prefix computed by the turn before is already there. A session's first
turn starts from the longest start of its prompt held anywhere, by content (`_start_by_content`): a
shared prefix, another idle session's conversation (made a shared prefix, held once for both), or a
file of the disk tier; one whose start another turn in its prefill shares (new conversations sent
together) waits for that one prefill of it, made a shared prefix (`_waits_for_shared`). Unsliced
(`--prefill-slice off`) it feeds a chunk per step, or hands every ready turn to mlx-lm's batch at once;
sliced, it feeds one slice when the decoders have had their share (`prefill.py`: the policy, whose
prompt, groups of turns prefilled as one padded batch). A turn at its end goes to the decode stage.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..calls.prompt import common_prefix
from ..kv.kv_pool import CacheState, KVPool, shared_prefix_of
from ..kv.prefix_cache import SharedPrefixes
from ..kv.prefix_store import PrefixStore, StoredPrompt
from .decode_stage import DecodeStage, batchable
from .outbox import Outbox
from .prefill import PrefillGroup, PrefillState, SlicePolicy, pick
from .turn import Turn
from .turn_prompt import PromptMaker

# The stops at which a turn leaves a shared prefix: its agent's system prompt and tools ("prefix", also
# stored on disk), or the start a new conversation sent beside it shares with it ("shared", memory only).
SHARING = ("prefix", "shared")


class PrefillStage:
    """The prefilling turns in their order (`turns`), the groups among them and the slice policy."""

    def __init__(
        self,
        decode: DecodeStage,
        outbox: Outbox,
        failed: Callable[[Turn, Exception], None],
        pool: KVPool,
        prefixes: SharedPrefixes,
        trimmable: bool,
        store: PrefixStore | None = None,
        make_cache: Callable[[], list[Any]] | None = None,
        prompts: PromptMaker | None = None,
    ) -> None:
        """`decode`: where a turn goes at its end (the model, tokenizer and config are its);
        `trimmable`: False for hybrid caches (see `_prepare_cache`); `store`: the disk tier under the
        shared prefixes (None: memory only); `make_cache`: a fresh prompt cache under the host's
        `--kv-bits` (None: mlx-lm's own); `prompts`: what made the turns' prompts (a turn's stored length
        is measured again with it when the one made with its prompt no longer holds)."""
        self.model, self.tokenizer, self.config = decode.model, decode.tokenizer, decode.config
        self.decode, self.outbox, self._failed, self.pool, self.prefixes = decode, outbox, failed, pool, prefixes
        self._trimmable, self.store, self._make_cache = trimmable, store, make_cache
        self.prompts = prompts or PromptMaker(self.tokenizer, self.config, trimmable, store)
        self.turns: deque[Turn] = deque()
        self.groups: list[PrefillGroup] = []  # turns prefilled together (see `_sliced`)
        self.policy = SlicePolicy.of(self.config.prefill_slice, self.config.prefill_step_size)  # None: slicing off

    def step(self) -> None:
        """One prefill slice when one is due (sliced), else a chunk or the ready turns into the batch."""
        if self.policy is not None:
            self._sliced()
            return
        tic, decoders = time.perf_counter(), self.decode.turns()
        self._unsliced()
        self.decode.waited(time.perf_counter() - tic, decoders)  # they waited for that chunk

    def decoded(self, seconds: float, steps: int = 1) -> None:
        """Decode work took `seconds`: it counts towards the decoders' share (`SlicePolicy`)."""
        if self.policy is not None:
            self.policy.decoded(seconds, steps)

    # -- opening a turn -------------------------------------------------------------

    def _open(self, turn: Turn) -> None:
        """Pick the cache to continue from and plan the stops, when the prefill begins.

        Deferred until then so that a shared prefix computed by the turn before
        (prefills run one after another) is already there.
        """
        state = turn.state
        turn.prefill.cache, turn.prefill.n_cached = self._prepare_cache(state, turn.ids, turn.prefix)
        self.pool.register(turn.prefill.cache)  # its session's, a copy of a prefix or of a snapshot, or a fresh one
        turn.prefill.shared = shared_prefix_of(turn.prefill.cache)
        turn.prefill.pos = turn.prefill.n_cached
        state.prompt_cache, state.token_ids, state.render = turn.prefill.cache, turn.ids[: turn.prefill.pos], None
        turn.prefill.stops = self._plan_stops(turn)
        if self.policy is None:  # slicing off: its prefill begins now (sliced: at its first slice)
            self.outbox.prefill_begun(turn)

    def _prepare_cache(self, state: CacheState, ids: list[int], prefix: list[int]) -> tuple[list[Any], int]:
        """The cache to continue from and how many prompt ids it already holds (`prefix`: the system prompt
        and tools a session's first turn starts with, see `_start_by_content`)."""
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
        return self._start_by_content(ids, prefix, state)

    def _start_by_content(self, ids: list[int], prefix: list[int], own: CacheState) -> tuple[list[Any], int]:
        """A new cache starting from the longest start of `ids` held anywhere (a new conversation, or a
        restarted process's first): a shared prefix; an idle session's cache holding more of it (at least
        `MIN_SHARED_TOKENS` more: it becomes a shared prefix that session goes on from, held once, never
        copied per session); a stored prefix longer still (`PrefixStore.longest`: the lengths stored, and
        the agent's `prefix`, whose file is checked even where the folder's lengths miss it). Else empty.
        A stored conversation found (longer than `prefix`) is the one this session goes on: its next stored
        file replaces it (`store_prompt`)."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        from ..kv.prefixed_cache import MIN_SHARED_TOKENS

        covered, _ = self.prefixes.covering(ids)
        # A hybrid model's recurrent state cannot be cut back to a shorter start: no other session's (each
        # cache is asked too: a host told its caches trim may still hold a recurrent layer).
        if self.config.reuse and self.config.share_prefix and self._trimmable:
            held = [
                (min(common_prefix(s.token_ids, ids), len(ids) - 1, s.prompt_cache[0].offset), s)  # type: ignore[index]
                for s in self.pool.in_memory()
                if s.prompt_cache and can_trim_prompt_cache(s.prompt_cache)
            ]
            n, state = max(held, key=lambda h: h[0], default=(0, None))
            if state is not None and n - covered >= MIN_SHARED_TOKENS and self.prefixes.add_from(ids[:n], state):
                covered = n
        store = self.store  # None: nothing is shared, or no disk tier
        if store is not None and (found := store.longest(ids, covered, (len(prefix),))) is not None:
            n, cache = found
            self.prefixes.add(ids[:n], cache)
            if n > len(prefix):  # a conversation's: the session's next file replaces it
                own.stored = StoredPrompt(store.path_for(ids[:n]), n, "", False)
        return self.prefixes.start(ids) or (self.fresh_cache(), 0)

    def fresh_cache(self) -> list[Any]:
        """An empty prompt cache: the host's, under its `--kv-bits`, else mlx-lm's with dense layers that
        can start from a shared prefix."""
        if self._make_cache is not None:
            return self._make_cache()
        from mlx_lm.models.cache import make_prompt_cache

        from ..kv.prefixed_cache import shared_layers

        return shared_layers(make_prompt_cache(self.model))

    def store_prompt(self, turn: Turn) -> None:
        """Keep a finished turn's conversation, up to the end of its prompt's last message, in the disk tier
        (`Request.store_prompt`), as far as a new process would tokenize it the same (a reply's tokens as
        generated may differ from its text's): a restarted host's first request goes on from there. Its
        file replaces the one the session stored at its turn before, which it goes on from. Its length was
        measured with the turn's prompt, off this thread (`PromptMaker.stored_length`); measured against
        another stored conversation than the session's now (a race with its last turn's store), it is
        measured again here."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        state, store, prompts = turn.state, self.store, self.prompts
        if store is None or not prompts.stores(turn.request) or not state.prompt_cache:
            return
        if not can_trim_prompt_cache(state.prompt_cache):  # a recurrent layer: no shorter start to store
            return
        assert turn.prompt is not None  # made at submit
        measured = turn.prompt.stored
        if measured is None or not measured.holds_for(state.stored):
            measured = prompts.stored_length(turn.request, turn.ids, state.stored)
        elif measured.last is not state.stored:  # measured from the whole text: what it goes on from now
            measured = replace(measured, prior=prompts.prior(turn.ids, state.stored))
        n, whole, prior = measured.n, measured.whole, measured.prior
        if n > (held := state.prompt_cache[0].offset):
            n, whole = held, False
        if n <= len(turn.prefix) or not store.wants(turn.ids[:n]) or (prior is not None and n <= prior.n_tokens):
            return
        head = copy.deepcopy(state.prompt_cache)  # views: the store's writer copies what it writes
        trim_prompt_cache(head, head[0].offset - n)
        store.save(turn.ids[:n], head, replaces=prior.path if prior is not None else None)
        state.stored = StoredPrompt(store.path_for(turn.ids[:n]), n, measured.text, whole)

    def _plan_stops(self, turn: Turn) -> list[tuple[int, str]]:
        stops: list[tuple[int, str]] = []
        prefix = turn.prefix
        if prefix and turn.prefill.pos <= len(prefix) and prefix not in self.prefixes:
            stops.append((len(prefix), "prefix"))
        # Where a hybrid model's snapshot goes, made with the prompt (None: reuse off, or a trimmable cache).
        snap = turn.prompt.reply_at if turn.prompt is not None else None
        if snap is not None and 0 < snap and turn.prefill.pos <= snap:
            stops.append((snap, "snapshot"))
        stops.append((len(turn.ids) - 1, "end"))
        return sorted(stops)

    # -- unsliced ---------------------------------------------------------------------

    def _unsliced(self) -> None:
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
        batched = self.config.batching and (len(ready) > 1 or self.decode.busy())
        if ready and batched and behind is None:
            for turn in ready:
                self.turns.remove(turn)
                try:
                    self._hand_over(turn, join=True)
                except Exception as exc:
                    self._failed(turn, exc)
        elif self.turns:
            turn = behind or self.turns[0]
            try:
                self._chunk(turn)
            except Exception as exc:
                self._failed(turn, exc)

    def _behind(self, ready: list[Turn]) -> Turn | None:
        """The turn after the ready ones that they wait for: it still has a stop to save before its
        end and can join their batch, and nothing decodes yet (else the ready ones join at once)."""
        if not self.config.batching or self.decode.busy() or len(self.turns) <= len(ready):
            return None
        turn = self.turns[len(ready)]  # where `_ready` stopped: opened, its next stop not "end"
        return turn if turn.prefill.stops[0][1] != "end" and batchable(turn.prefill.cache) else None

    def _ready(self) -> list[Turn]:
        """The turns at the head of the prefill queue with nothing left to save before they decode.

        A turn is opened (its cache chosen) only once every turn before it is ready, so that a
        shared prefix computed by one of those is already there.
        """
        ready: list[Turn] = []
        for turn in list(self.turns):
            if turn.prefill.cache is None and self._waits_for_shared(turn, ready):
                # The turn it waits for has a stop before its end now: the ones before it are the ready ones.
                return ready[: next(i for i, t in enumerate(ready) if t.prefill.stops[0][1] != "end")]
            try:
                if turn.prefill.cache is None:
                    self._open(turn)
            except Exception as exc:
                self._failed(turn, exc)
                continue
            if turn.prefill.stops[0][1] != "end" or not batchable(turn.prefill.cache):
                break
            ready.append(turn)
        return ready

    def _chunk(self, turn: Turn, n_tokens: int | None = None) -> None:
        """Feed one chunk (up to the next stop, at most `n_tokens`, the prefill step by default); at a
        stop, save what it asks for."""
        import mlx.core as mx

        if turn.prefill.cache is None:
            self._open(turn)
        self.outbox.prefill_begun(turn)
        stop, action = turn.prefill.stops[0]
        end = min(turn.prefill.pos + (n_tokens or self.config.prefill_step_size), stop)
        if end > turn.prefill.pos:
            tic = time.perf_counter()
            self.model(mx.array(turn.ids[turn.prefill.pos : end])[None], cache=turn.prefill.cache)
            mx.eval([c.state for c in turn.prefill.cache])
            turn.prefill.token_s = (time.perf_counter() - tic) / (end - turn.prefill.pos)
            turn.prefill.fresh = turn.prefill.fresh and action != "end"
            turn.prefill.pos = end
            turn.state.token_ids = turn.ids[:end]
        if turn.prefill.pos < stop:
            return
        turn.prefill.stops.pop(0)
        if action in SHARING:  # the turn goes on from the entry: the prefix is held once, for it and the next
            turn.prefill.cache = turn.state.prompt_cache = self.prefixes.add(turn.ids[:stop], turn.prefill.cache)
            turn.prefill.shared = shared_prefix_of(turn.prefill.cache)
            if action == "prefix" and self.store is not None:
                self.store.save(turn.ids[:stop], turn.prefill.cache)  # a copy; the writer thread does the disk
        elif action == "snapshot":
            turn.state.snapshot = (stop, self.pool.register(copy.deepcopy(turn.prefill.cache)))
        elif action == "end":
            self.turns.remove(turn)
            self._hand_over(turn, self.decode.joins(turn.prefill.cache))

    # -- sliced (see prefill.py) ------------------------------------------------------

    def _sliced(self) -> None:
        """One slice of prefill, when the decoders have had their share: the oldest prompt's, or a short
        one's (`prefill.pick`), on its own cache or its group's. Every other turn in flight waited for it."""
        if self.decode.starting():
            return  # a turn handed over has its first words out before another slice (`DecodeStage.starting`)
        opened = self._open_turns()
        decoding = self.decode.busy()
        policy = self.policy
        assert policy is not None
        work = pick(opened, self.groups, decoding, self.config.prefill_step_size, batchable, self.config.batching)
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
            n_tokens = policy.step_size if urgent else policy.size(decoding, 1, work.turn.prefill.token_s)
            try:
                self._chunk(work.turn, n_tokens)
            except Exception as exc:
                self._failed(work.turn, exc)
        elapsed = time.perf_counter() - tic
        policy.sliced(elapsed, decoding)
        for turn in self.turns:
            if turn not in fed:
                turn.prefill.wait_s += elapsed
        self.decode.waited(elapsed, [t for t in self.decode.turns() if t not in fed])

    def _open_turns(self) -> list[Turn]:
        """The prefilling turns with their cache chosen (`_open`), opening them in order: a turn waits
        while one before it still has a shared prefix to save, which it may start from."""
        opened: list[Turn] = []
        for turn in list(self.turns):
            if turn.prefill.cache is None and turn.prefill.group is None:
                if any(action in SHARING for t in opened for _, action in t.prefill.stops):
                    break
                if self._waits_for_shared(turn, opened):
                    break
                try:
                    self._open(turn)
                except Exception as exc:
                    self._failed(turn, exc)
                    continue
            opened.append(turn)
        return opened

    def _waits_for_shared(self, turn: Turn, opened: list[Turn]) -> bool:
        """Whether `turn`, a new conversation not opened yet, waits for the one prefill of the start it
        shares with an opened turn (two clients' requests with the same long start, sent together): that
        turn stops at the end of the shared part (a "shared" stop, `_chunk`) and leaves it as a shared
        prefix, which `turn` then starts from (`_start_by_content`), so those tokens are prefilled and
        held once. Only while the other's prefill has not passed that point (after it, `turn` prefills
        its own), on caches that hold a shared prefix once, and for at least `MIN_SHARED_TOKENS` more
        than the shared prefixes already cover."""
        from ..kv.prefixed_cache import MIN_SHARED_TOKENS, OverPrefix

        config, state = self.config, turn.state
        if not (config.reuse and config.share_prefix and self._trimmable):
            return False
        if state.prompt_cache is not None or state.spill_path is not None:  # it goes on from its own
            return False
        covered, _ = self.prefixes.covering(turn.ids)
        for other in opened:
            cache = other.prefill.cache
            n = min(common_prefix(other.ids, turn.ids), len(turn.ids) - 1)
            if n - covered < MIN_SHARED_TOKENS or not other.prefill.pos < n < len(other.ids) - 1:
                continue
            if cache is None or not all(isinstance(c, OverPrefix) for c in cache):
                continue
            other.prefill.stops = sorted([*other.prefill.stops, (n, "shared")])
            return True
        return False

    def _group(self, turns: tuple[Turn, ...]) -> PrefillGroup | None:
        """Turns ready together, as one group (their caches merged into one padded batch)."""
        try:
            group = PrefillGroup(self.model, turns, self.config.prefill_step_size)
        except Exception as exc:
            for turn in turns:
                self._failed(turn, exc)
            return None
        self.groups.append(group)
        self.pool.hold(group, _group_nbytes)  # it merged its turns' caches (a copy): theirs are freed
        return group

    def _feed_group(self, group: PrefillGroup, n_tokens: int) -> None:
        """One slice of a group; the turns at their end leave it and decode, together (a group of one
        left goes on on its own cache). A failed slice fails the group's turns: their caches were in it."""
        for turn in group.turns:
            self.outbox.prefill_begun(turn)
        try:
            done = group.feed(n_tokens)
            for turn in done:
                self._ungroup(group, turn)
            if len(group.turns) == 1:
                self._ungroup(group, group.turns[0])
        except Exception as exc:
            self.groups.remove(group)
            for turn in list(group.turns):
                turn.prefill.group = None
                self._failed(turn, exc)
            return
        join = self.config.batching and (len(done) > 1 or self.decode.busy())
        for turn in done:
            self.turns.remove(turn)
            try:
                self._hand_over(turn, join)
            except Exception as exc:
                self._failed(turn, exc)

    def _ungroup(self, group: PrefillGroup, turn: Turn) -> None:
        """`turn` leaves its group with its own cache (the group ends with its last turn)."""
        turn.prefill.cache = turn.state.prompt_cache = self.pool.register(group.take(turn))
        turn.state.token_ids = turn.ids[: turn.prefill.pos]
        turn.prefill.fresh = False
        if not group.turns:
            self.groups.remove(group)

    def admit(self, turn: Turn) -> None:
        """Queue an admitted turn's prefill: its prefill state starts here (its prompt time too)."""
        turn.prefill = PrefillState(time.perf_counter())
        self.turns.append(turn)

    def _hand_over(self, turn: Turn, join: bool) -> None:
        """The turn at its end goes to the decode stage with its cache and shared prefix (its prefill
        state keeps neither: a record from now on)."""
        prefill = turn.prefill
        cache, shared, prefill.cache, prefill.shared = prefill.cache, prefill.shared, None, None
        self.decode.begin(turn, cache, shared, join)

    def remove(self, turn: Turn) -> None:
        """A cancelled or failed turn leaves the stage and its group, if in one, with its cache (a turn
        left alone in the group goes on on its own cache)."""
        group = turn.prefill.group
        if group is not None:
            self._ungroup(group, turn)
            if len(group.turns) == 1:
                self._ungroup(group, group.turns[0])
        self.turns.remove(turn)

    def clear(self) -> None:
        self.turns.clear()
        self.groups.clear()


def _group_nbytes(group: PrefillGroup) -> int:
    return group.nbytes
