"""A grammar-held row's draft: walked through its grammar before the verifying forward, cut at the first
token the grammar refuses, and the grammar taken back to what the verdict kept.

A row held by a grammar (`calls.constrainer.Constrainer`: a call to a known tool, an answer to its schema)
is masked at each step by what its grammar allows after the tokens so far. Verifying a draft in one
forward needs that mask at every verified position: after the token in flight, and after each drafted
token. So before the forward the grammar takes the token in flight and then each drafted token while
the mask before it allows it, and the mask after each is kept (`HeldDraft.masks`, the ones a step
would have applied: the grammar's first mask where the token completes a call's start marker, the
running matcher's with its closing near the reply's limit, none while the reply is free); the draft
stops at the first token the grammar refuses (its probability is 0: it could never be kept). The
verdict then reads the masked distributions, so it stays exact. After it, the grammar comes back to
where the kept tokens leave it (`settle`): its own state as it was then, and each llguidance matcher
rolled back past the tokens it consumed after them (`LLMatcher.rollback`), so the next mask is the
one a row that never drafted would get.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from ..calls.constrainer import Constrainer


class HeldDraft:
    """A row's draft walked through its grammar (`grammar`, caught up to the tokens before `flight`).

    Args:
        grammar: the row's grammar.
        flight: the token in flight (the row's next token to feed, before the draft).
        draft: the drafted tokens.
        vocab: the width of the model's logits.
    """

    def __init__(self, grammar: Constrainer, flight: int, draft: Sequence[int], vocab: int) -> None:
        self.grammar = grammar
        self.masks: list[np.ndarray | None] = []  # after each position's token: what may come next (None: all)
        self._states: list[dict[str, Any]] = []  # the grammar's state after each position
        self._takers: list[Any] = []  # each position's matcher that consumed its token (None: none did)
        for j, token in enumerate([flight, *draft]):
            if j and (mask := self.masks[-1]) is not None and not mask[token]:
                break  # the grammar refuses it: the draft stops before it
            running = grammar.running
            self._takers.append(grammar.take(token))
            self.masks.append(_next_mask(grammar, running, vocab))
            self._states.append(grammar.snapshot())
        self.draft = list(draft[: len(self.masks) - 1])

    def settle(self, fed: int) -> None:
        """The row fed the first `fed` positions (the token in flight and the drafted tokens it kept):
        the grammar's state after them, what its matchers consumed after them rolled back."""
        self.grammar.restore(self._states[fed - 1])
        for taker in reversed(self._takers[fed:]):
            if taker is not None:
                taker.rollback(1)


def _next_mask(grammar: Constrainer, running: bool, vocab: int) -> np.ndarray | None:
    """What the grammar lets come after the token it just took, as a step's mask would be: none while the
    reply is free; the grammar's first mask where that token started it (`MaskBatch`'s armed rows); else
    the running matcher's (with the closing of what is open near the reply's limit)."""
    if not grammar.running:
        return None
    if not running:
        return grammar.prototype.first_row(vocab)  # type: ignore[union-attr]
    return grammar.allowed(vocab)


def masked(logits: Any, held: dict[int, HeldDraft]) -> Any:
    """`logits` (`[B, W, V]`) with each held row's masks at its positions (by row index); the other rows
    and the positions past a row's draft as they are."""
    import mlx.core as mx
    import numpy as np

    if all(mask is None for walked in held.values() for mask in walked.masks):
        return logits  # free text everywhere: nothing to mask, no array of the logits' size to build
    allow = np.ones(logits.shape, dtype=bool)
    for i, walked in held.items():
        for j, mask in enumerate(walked.masks):
            if mask is not None:
                allow[i, j] = mask
    return mx.where(mx.array(allow), logits, mx.array(-mx.inf, dtype=logits.dtype))


def walk(turns: Sequence[Any], pending: Sequence[int], drafts: list[list[int]], vocab: int) -> dict[int, HeldDraft]:
    """Each grammar-held row's draft walked through its grammar (`turns`: each row's `Turn`, or None), by
    row index; `drafts` cut where the grammars refuse. A row whose grammar fails drafts nothing (its turn fails)."""
    held: dict[int, HeldDraft] = {}
    for i, turn in enumerate(turns):
        if turn is None or turn.decode.grammar is None or not drafts[i]:
            continue
        try:
            turn.decode.grammar.to_step()  # the tokens the host has read: all but the one in flight
            held[i] = HeldDraft(turn.decode.grammar, pending[i], drafts[i], vocab)
        except Exception as exc:
            turn.decode.failed(exc)
            drafts[i] = []
            continue
        drafts[i] = held[i].draft
    return held
