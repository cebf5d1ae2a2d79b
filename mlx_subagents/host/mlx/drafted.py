"""One sequence decoding with drafts: each forward verifies a session's draft and keeps one or more tokens.

The drafted counterpart of `single.SingleStream`: the same model, cache and sampling, but each call
feeds the token before the draft and the draft itself (`drafts.py`), keeps the verdict's tokens
(`verify.py`) and rewinds the cache past the rejected ones (`kv/rewind.py`), so the tokens are the
ones decoding one at a time gives, a forward yielding as many as the draft got right plus one. A
forward with no draft is a plain decode step. It is not pipelined: the next draft depends on the
verdict, which is read back before the next forward is built.

A sequence held by a grammar (a call to its tools, an answer to its schema) drafts too: its grammar
masks its first forward as a processor would, and each forward after it walks its draft through the
grammar while the forward runs (`drafted_grammar.py`: each verified position masked, the draft cut at
the first token the grammar refuses, the grammar brought back to the kept tokens). Sequences with
other logits processors (a thought budget, a forcing script) do not draft: those read every token in
order and keep state that a rejected draft would have to undo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..kv.rewind import Mark, mark, refusal, rewind
from .drafted_grammar import HeldDraft, masked
from .drafts import Drafter
from .single import Tail
from .verify import Sampling, verdict

if TYPE_CHECKING:
    from ..calls.constrainer import Constrainer


@dataclass
class DraftCounts:
    """A sequence's drafting so far: forwards run, tokens drafted, drafted tokens accepted, tokens kept."""

    forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0

    @property
    def per_forward(self) -> float:
        """Tokens kept per verifying forward (1.0 without drafts)."""
        return self.tokens / self.forwards if self.forwards else 0.0


class DraftedStream:
    """Decodes from a cache holding `context[:-1]`, feeding `context[-1]` first; or, given `pending` (the
    token already computed after `context`, as a batch has it), from a cache holding all of it.

    After each `next()` the cache holds every token but the last one returned (`tokens[:-1]`), and
    `end` settles it where the sequence stops.

    Raises:
        ValueError: a layer of `cache` cannot be rewound (`kv.rewind.refusal` says which).
    """

    def __init__(
        self,
        model: Any,
        cache: list[Any],
        context: list[int],
        sampling: Sampling,
        drafter: Drafter,
        pending: int | None = None,
        counts: DraftCounts | None = None,
        grammar: Constrainer | None = None,
    ) -> None:
        problem = refusal(cache)
        if problem is not None:
            raise ValueError(problem)
        self.model, self.cache, self.sampling, self.drafter = model, cache, sampling, drafter
        self.tokens = list(context)
        self.counts = counts if counts is not None else DraftCounts()  # a turn's, across its streams
        self._pending = pending
        self._last: tuple[int, Mark] | None = None  # the last forward's tokens kept, and its mark
        self.grammar = grammar  # its `known` the tokens returned so far
        self._first = pending is None  # the next forward feeds the context's last token, not a reply's

    def next(self, limit: int | None = None) -> list[int]:
        """The tokens of one forward, in order (at most `limit`); the last is not yet in the cache."""
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        if self._pending is not None:
            kept, self._pending, self._last = [self._pending], None, None
            self.tokens += kept
            return kept
        draft = self.drafter.propose(self.tokens)[: None if limit is None else max(0, limit - 1)]
        if self.grammar is not None and self._first:
            draft = []  # the grammar reads the reply's first token as a processor does (`_held`)
        before, fed = mark(self.cache), len(draft) + 1
        with mx.stream(generation_stream):
            logits = self.model(mx.array([self.tokens[-1:] + draft], dtype=mx.uint32), cache=self.cache)[0]
        logits, draft, walked = self._held(logits, draft)
        with mx.stream(generation_stream):
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        kept = verdict(logprobs[: len(draft) + 1], draft, self.sampling)
        rewind(self.cache, fed - len(kept), before)
        if walked is not None:
            walked.settle(len(kept))
        self._first = False
        self.drafter.observe(len(draft), len(kept) - 1)
        self.tokens += kept
        self._last = (len(kept), before)
        counts = self.counts
        counts.forwards, counts.drafted = counts.forwards + 1, counts.drafted + len(draft)
        counts.accepted, counts.tokens = counts.accepted + len(kept) - 1, counts.tokens + len(kept)
        return kept

    def _held(self, logits: Any, draft: list[int]) -> tuple[Any, list[int], HeldDraft | None]:
        """`logits` (`[positions, V]`) as the grammar masks them, the draft cut where it refuses, and the
        walk to settle after the verdict. The first forward's token is the context's own: the grammar
        masks it as a processor (its context's length and last token, as `SingleStream` shows it)."""
        import mlx.core as mx

        grammar = self.grammar
        if grammar is None:
            return logits, draft, None
        if self._first:
            return grammar(Tail(len(self.tokens), mx.array(self.tokens[-1:], dtype=mx.uint32)), logits), [], None
        mx.async_eval(logits)  # the forward runs while llguidance walks the draft
        grammar.catch_up(len(grammar.known))  # every token returned but the last, which this forward fed
        walked = HeldDraft(grammar, self.tokens[-1], draft, logits.shape[-1])
        return masked(logits[None], {0: walked})[0], walked.draft, walked

    def handover(self) -> int | None:
        """Stop here: the token computed but not yet returned, when there is one (`pending`, not in the
        cache). Otherwise None: the cache holds `tokens[:-1]` and the last token is still to feed."""
        pending, self._pending = self._pending, None
        return pending

    def feed(self, token: int) -> None:
        """Put a last token into the cache (when the sequence ends on the token `handover` gave)."""
        import mlx.core as mx

        mx.eval(self.model(mx.array([[token]], dtype=mx.uint32), cache=self.cache))
        self.tokens.append(token)

    def end(self, used: int | None = None) -> None:
        """The sequence stops after the first `used` tokens the last `next()` returned (an end-of-turn
        token, the limit; None: all of them, a cancel): the cache then holds every token up to that one
        and nothing after, as a sequence decoded one token at a time would (its bytes too)."""
        import mlx.core as mx

        if self._pending is not None:
            return  # the cache holds the context, and the pending token was never returned
        got = self._last[0] if self._last is not None else 1
        used = got if used is None else used
        assert 1 <= used <= got
        if used == got:  # the last token is not in the cache yet: feed it
            mx.eval(self.model(mx.array([self.tokens[-1:]], dtype=mx.uint32), cache=self.cache))
        else:
            assert self._last is not None
            rewind(self.cache, got - 1 - used, self._last[1])
            del self.tokens[len(self.tokens) - got + used :]
        self._last = None
