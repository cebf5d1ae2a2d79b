"""Prefill in slices between decode steps: when a slice runs, how many tokens it feeds, and whose.

A prompt that joins mlx-lm's batch is prefilled there in chunks of the prefill step with one decode
step between chunks, so every session decoding meanwhile advances one token per chunk: a child's
first turn or a `read` of a long file silences its siblings for the whole prefill. Here a prompt is
prefilled on its own cache, a slice at a time, by the scheduler, and enters the batch with that
cache holding all but its last token (mlx-lm's batch then only decodes).

The policy (`SlicePolicy`) is an equal time share between the two kinds of work. While sessions
decode, a slice runs only once as much time has passed since the last slice ended as that slice
took, and a decode step more (the first step after a slice is about a step slower). So the decoders
keep about half their speed (all of it once the prefill is done: the scheduler's own work between
slices counts on their side), and the prefill gets the other half, never starved by many decoders
or slow steps. With `auto` a slice lasts about `SLICE_DECODE_STEPS` decode steps: a decode
step costs about what any forward costs however few its tokens (the weights read, the kernels
launched, the Python around them), so a slice of eight steps' time spends most of it on prompt
tokens, and a decoder's longest pause is eight of its steps. Its token count follows from the
measured cost of the group's last slice per token, which grows with the prompt's depth. A number
(`--prefill-slice 64`) fixes the tokens per slice instead. With nothing decoding there is nobody to
yield to: a slice is the host's prefill step.

Whose prompt: the oldest first (in the order the turns were admitted), so that turns arriving together
get their first tokens one after another, the oldest after its own prefill, the next after two, as first
come first served gives, not all of them after every prefill (a step's prefill is one turn's, as vLLM's
chunked prefill fills its token budget in arrival order: more turns in one padded forward would only
delay the oldest). But a turn with at most a prefill step left goes before those with more, so a short
turn that arrives while a long one is prefilled is not behind it, and a new one goes at once, in one
slice, before the decoders' share is over (they get that time back after it). Turns that are ready
together while nothing decodes (the fan-out of sub-agents) join the oldest one's slice as one
`PrefillGroup`, one padded batch (mlx-lm's `PromptProcessingBatch`), only while every row is at most
`GROUP_ROW_TOKENS`: batching k rows of L tokens beats prefilling them in turn (on the mean first token)
only while L tokens cost less than a forward's fixed cost, and on a compute-bound machine longer rows
cost k times one row's. A group enters the batch in the same step and decodes in lockstep.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..settings import AUTO, OFF, PrefillSlice

# auto: a slice lasts about this many decode steps (see the module docstring).
SLICE_DECODE_STEPS = 8
# auto: never fewer tokens per row than this (a first slice, before any cost is known, feeds this many).
MIN_SLICE_TOKENS = 16
# Turns ready together join one padded group only while each has at most this many prompt tokens left:
# k rows of L tokens in one forward cost c0 + k*L*c1 (c0 a forward's fixed cost, c1 a prompt token's), in
# turn they give mean first tokens of (k+1)/2 * (c0 + L*c1), so the group wins only while L*c1 <= c0.
# Measured on this project's 2-core CPU, tiny model, 4 rows against 1 (in turn: 2.5x on the mean): at a
# depth of 32 tokens 1.7-2.2x for rows of 8-24 tokens, 2.4-3.2x for 32-128; at 3,500 2.6-5.6x from 8 on.
GROUP_ROW_TOKENS = 32
# Weight of the newest reading in the running averages of a decode step's and a prompt token's cost.
EMA = 0.25


@dataclass(eq=False)
class PrefillState:
    """A turn's part that the prefill stage writes (`prefill_stage.py`, and its groups here), from the
    turn's admission on; after its handover to the decode stage, a record for its reply."""

    started: float  # when it was admitted: its prompt's time counts from here
    cache: list[Any] | None = None  # its own cache (None: not opened yet, in a group, or handed over)
    n_cached: int = 0  # prompt tokens its cache held when opened
    pos: int = 0  # prompt tokens its cache holds
    stops: list[tuple[int, str]] = field(default_factory=list)  # (position, "prefix" | "shared" | "snapshot" | "end")
    group: PrefillGroup | None = None  # prefilled with others as one padded batch (its cache is the group's)
    fresh: bool = True  # no slice of its last prompt segment yet (it may still join a group)
    token_s: float = 0.0  # its last solo slice's seconds per token
    wait_s: float = 0.0  # time it spent while other turns' prompts were prefilled
    shared: tuple[int, Any] | None = None  # the shared prefix its cache starts from: (tokens, prefix); None: not opened


class Turn(Protocol):
    """What the prefill reads of the scheduler's `Turn`: its prompt, its session's cache state and its
    prefill state (how far its cache holds the prompt, its stops, its cache and group)."""

    ids: list[int]
    state: Any
    prefill: PrefillState


def describe(value: PrefillSlice, step_size: int) -> str:
    """The slice policy in a line (`subagent doctor`)."""
    if value == OFF:
        return f"off: a prompt joins the batch at once and is prefilled in chunks of {step_size} between decode steps"
    size = (
        f"about {SLICE_DECODE_STEPS} decode steps' time (at least {MIN_SLICE_TOKENS} tokens)"
        if value == AUTO
        else f"{value} tokens"
    )
    return (
        f"{value}: slices of {size} while others decode, the time shared equally; "
        f"{step_size} tokens with nothing decoding; oldest prompt first"
    )


@dataclass
class SlicePolicy:
    """When a prefill slice may run and how many tokens it feeds per row.

    Args:
        tokens: the tokens of a slice while others decode (None: auto).
        step_size: what a slice feeds with nothing decoding, and the most it ever feeds.
    """

    tokens: int | None
    step_size: int
    decode_s: float = 0.0  # a decode step's duration, averaged
    ready_at: float = 0.0  # when (perf_counter) the next slice may run while others decode

    @classmethod
    def of(cls, value: PrefillSlice, step_size: int) -> SlicePolicy | None:
        """The policy of a `--prefill-slice` value; None when slicing is off."""
        if value == OFF:
            return None
        return cls(None if value == AUTO else min(int(value), step_size), step_size)

    def due(self, decoding: bool) -> bool:
        """Whether a slice may run now: nothing decodes, or the decoders have had their share."""
        return not decoding or time.perf_counter() >= self.ready_at

    def size(self, decoding: bool, rows: int, token_s: float) -> int:
        """Tokens per row of the next slice of a group of `rows` whose last slice cost `token_s`
        seconds per token and row (0: not known yet)."""
        if not decoding:
            return self.step_size
        if self.tokens is not None:
            return self.tokens
        if not (token_s > 0 and self.decode_s > 0):
            return MIN_SLICE_TOKENS
        target = SLICE_DECODE_STEPS * self.decode_s / (token_s * max(1, rows))
        return max(MIN_SLICE_TOKENS, min(self.step_size, int(target)))

    def decoded(self, seconds: float, steps: int = 1) -> None:
        """A decode step (or a burst of `steps` single-path tokens) took `seconds` (what `auto` sizes by)."""
        if steps > 0:
            per_step = seconds / steps
            self.decode_s = per_step if self.decode_s == 0 else (1 - EMA) * self.decode_s + EMA * per_step

    def sliced(self, seconds: float, decoding: bool) -> None:
        """A slice took `seconds`: the decoders, if any, get as long before the next, and one decode step
        more (the first step after a slice is about a step slower: the pipeline starts again), after
        what they are owed already (a short prompt's slice may run before their share is over, `urgent`)."""
        if decoding:
            self.ready_at = max(self.ready_at, time.perf_counter()) + seconds + self.decode_s
        else:
            self.ready_at = 0.0

    def urgent(self, work: Work) -> bool:
        """A new prompt of at most a prefill step is prefilled at once, in one slice, even before the
        decoders' share is over (they get its time back after): a short turn that arrives while a long
        one is prefilled waits neither for it nor for the decoders' turn."""
        return not work.begun and work.remaining <= self.step_size


class PrefillGroup:
    """Turns whose last prompt segment (to all but the last token) is prefilled together as one padded
    batch, a slice at a time: mlx-lm's `PromptProcessingBatch` over their merged caches. While a turn
    is in the group its cache lives in the group's; `take` gives it back as a cache of its own."""

    def __init__(self, model: Any, turns: Sequence[Turn], step_size: int) -> None:
        from mlx_lm.generate import PromptProcessingBatch

        self.turns = list(turns)
        self.token_s = 0.0  # the last slice's seconds per token and row
        self._batch = PromptProcessingBatch(
            model,
            uids=list(range(len(self.turns))),
            caches=[t.prefill.cache for t in self.turns],
            tokens=[list(t.ids[: t.prefill.pos]) for t in self.turns],
            prefill_step_size=step_size,
            # Per-row lists it keeps in step with its rows; it never samples here (the batch decodes).
            samplers=[None] * len(self.turns),
            logits_processors=[[] for _ in self.turns],
            max_tokens=[1] * len(self.turns),
        )
        for turn in self.turns:  # the group's merged cache holds them now (a copy): let the old ones go
            turn.prefill.cache = turn.state.prompt_cache = None
            turn.prefill.group = self

    @property
    def remaining(self) -> int:
        """Tokens until the group's first turn is ready to decode."""
        return min(t.prefill.stops[0][0] - t.prefill.pos for t in self.turns)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._batch.prompt_cache)

    def feed(self, n_tokens: int) -> list[Turn]:
        """Feed each turn up to `n_tokens` more of its prompt (none past its stop); the turns now at it."""
        rows = [t.ids[t.prefill.pos : min(t.prefill.pos + n_tokens, t.prefill.stops[0][0])] for t in self.turns]
        tic = time.perf_counter()
        self._batch.prompt(rows)  # evaluates
        fed = sum(len(r) for r in rows)
        if fed:
            self.token_s = (time.perf_counter() - tic) / fed
        for turn, row in zip(self.turns, rows, strict=True):
            turn.prefill.pos += len(row)
        return [t for t in self.turns if t.prefill.pos >= t.prefill.stops[0][0]]

    def take(self, turn: Turn) -> list[Any]:
        """Take `turn` out of the group with its own cache (the left padding cut off)."""
        i = self.turns.index(turn)
        cache = self._batch.extract_cache(i)
        del self.turns[i]
        self._batch.filter([j for j in range(len(self.turns) + 1) if j != i])
        turn.prefill.group = None
        return cache


@dataclass(frozen=True)
class Work:
    """What the next slice feeds: one turn on its own cache, a group, or ready turns to group first."""

    turn: Turn | None = None
    group: PrefillGroup | None = None
    together: tuple[Turn, ...] = ()

    @property
    def turns(self) -> Sequence[Turn]:
        """The turns it feeds."""
        if self.group is not None:
            return self.group.turns
        return (self.turn,) if self.turn is not None else self.together

    @property
    def remaining(self) -> int:
        """Tokens until its first turn decodes."""
        if self.group is not None:
            return self.group.remaining
        return min(_left(t) for t in self.turns)

    @property
    def begun(self) -> bool:
        """Whether a slice fed it before (a new arrival has not been)."""
        return (self.group.token_s if self.group is not None else self.turn.prefill.token_s if self.turn else 0.0) > 0


def _left(turn: Turn) -> int:
    """Tokens until `turn` decodes: its prompt but the last token, less what its cache holds."""
    return len(turn.ids) - 1 - turn.prefill.pos


def pick(
    opened: Sequence[Turn],
    groups: Sequence[PrefillGroup],
    decoding: bool,
    step_size: int,
    batchable: Any,
    batching: bool = True,
) -> Work | None:
    """The next slice's work among the opened turns (arrival order) and the groups.

    The oldest first, but a turn with at most a prefill step left before those with more (a short turn
    is not behind a long prefill). While nothing decodes, turns ready to decode but for their last
    segment (and not fed any of it yet: `fresh`) join the first one's slice as a group when each has at
    most `GROUP_ROW_TOKENS` left, after any turn as short that is one slice from being ready too (a
    hybrid model's turn saving its snapshot): rows that short cost about one row together.

    Args:
        batchable: whether a cache can join a batch (a turn whose cache cannot stays on its own).
        batching: whether turns may be grouped at all (not when serialized).
    """
    solo = [t for t in opened if t.prefill.group is None]
    units = [Work(group=g) for g in groups] + [Work(turn=t) for t in solo]
    if not units:
        return None
    order = {id(t): i for i, t in enumerate(opened)}
    first = min(units, key=lambda w: (w.remaining > step_size, min(order.get(id(t), len(order)) for t in w.turns)))
    head = first.turn
    if not batching or decoding or head is None or not _joins(head, batchable):
        return first
    short = [t for t in solo if t is not head and 0 < _left(t) <= GROUP_ROW_TOKENS and batchable(t.prefill.cache)]
    soon = [t for t in short if t.prefill.stops[0][1] != "end"]
    if soon:
        return Work(turn=soon[0])
    mates = [t for t in short if _joins(t, batchable)]
    return Work(together=tuple(t for t in solo if t is head or t in mates)) if mates else first


def _joins(turn: Turn, batchable: Any) -> bool:
    """Whether `turn` may be grouped: at its last segment, none of it fed yet, at most `GROUP_ROW_TOKENS`."""
    return (
        turn.prefill.stops[0][1] == "end"
        and turn.prefill.fresh
        and 0 < _left(turn) <= GROUP_ROW_TOKENS
        and batchable(turn.prefill.cache)
    )
