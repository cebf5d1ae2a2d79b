"""Rows of the batch verifying their drafts together: one forward for every row of mlx-lm's generation
batch, the rows that drafted and the rows that did not, each keeping its own tokens.

The batched counterpart of `drafted.DraftedStream`. mlx-lm's `GenerationBatch` is a step ahead: each
row's next token is computed but not yet fed (`_next_tokens`). A drafted step feeds every row that
token and its draft, padded on the right to the longest draft (causal attention keeps the padding out
of every real position's logits), so row i's input is `[y, d1 .. dk, pad ..]`. A row that drafted
keeps the verdict's tokens (its agreeing prefix, then the model's own token: greedy rows read together
in one argmax, sampled ones by `verify.judged`, all evaluated at once); a row
that did not samples its token after `y` as mlx-lm's step does (its logits processors, then its
sampler). Every row then holds `y` and its accepted drafts, its last kept token is its next token still
to feed, and the positions it rejected (its refused draft and its padding) come off its own row of the
cache (`kv.rewind.rewind_rows`). A row stops at the first token that ends it (its limit, an
end-of-turn token), as mlx-lm's `next` does, and its cache then holds the tokens up to that one.

It reads mlx-lm's generation batch (0.32-0.33): the pipelined tokens, the token contexts and the
stop matchers are not part of its public API.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..kv.rewind import rewind_rows
from .drafted_grammar import HeldDraft, masked
from .verify import Sampling, judged


@dataclass
class RowTokens:
    """What a drafted step gave one row: its tokens in order, why it ended (None: it goes on), and
    then its cache as a single sequence's."""

    uid: int
    tokens: list[int]
    accepted: int
    finish_reason: str | None = None
    prompt_cache: list[Any] | None = None


def drafted_step(
    generation: Any,
    drafts: Sequence[list[int]],
    samplings: Sequence[Sampling | None],
    held: dict[int, HeldDraft] | None = None,
) -> list[RowTokens]:
    """One forward of `generation` (mlx-lm's `GenerationBatch`) verifying each row's draft.

    Args:
        generation: the batch's generation batch, its rows' next tokens computed.
        drafts: each row's draft ([] for none).
        samplings: a drafting row's sampling (its verdict's: temperature, top_p, top_k); None for a row
            that samples its one token with its own sampler and processors.
        held: the grammar-held rows' drafts walked through their grammars (`drafted_grammar.py`), by row
            index: each position of theirs is masked as a step would have masked it (the batch's masks
            leave these rows out), and each verifies with a sampling, even a draft the grammar cut to none;
            after the verdict each grammar comes back to the tokens its row kept.
    """
    import mlx.core as mx

    g = generation
    pending = g._next_tokens
    ys = pending.tolist()
    width = 1 + max(len(d) for d in drafts)
    inputs = mx.array([[y, *d, *[y] * (width - 1 - len(d))] for y, d in zip(ys, drafts, strict=True)], dtype=mx.uint32)
    g._current_tokens, g._current_logprobs = pending, g._next_logprobs
    logits = g.model(inputs, cache=g.prompt_cache)  # the batch's masks apply (`masks.py`)
    if held:
        logits = masked(logits, held)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    plain = _sampled(g, pending, logits, samplings)
    kept = _verdicts(logprobs, drafts, samplings, plain)
    nexts: list[Any] = [None] * len(ys)
    for i, k in enumerate(kept):
        if k is not None:
            nexts[i] = logprobs[i, len(k) - 1]
    for i, (token, row) in plain.items():
        kept[i], nexts[i] = [int(token.item())], row
    rows = _settle(g, ys, width, kept, nexts)  # type: ignore[arg-type]
    for i, walked in (held or {}).items():
        walked.settle(len(rows[i].tokens))  # each grammar back to the tokens its row kept
    return rows


def _verdicts(
    logprobs: Any, drafts: Sequence[list[int]], samplings: Sequence[Sampling | None], plain: dict[int, tuple[Any, Any]]
) -> list[list[int] | None]:
    """Each drafting row's kept tokens (None for a row that did not draft): its draft's agreeing prefix,
    then the model's own token. Greedy rows are read together in one argmax, sampled ones by
    `verify.judged`, all evaluated at once with the `plain` rows' tokens."""
    import mlx.core as mx

    greedy = [i for i, s in enumerate(samplings) if s is not None and s.temperature == 0]
    picks = mx.argmax(logprobs, axis=-1) if greedy else None
    sampled = {
        i: judged(logprobs[i, : len(drafts[i]) + 1], drafts[i], s)
        for i, s in enumerate(samplings)
        if s is not None and s.temperature != 0
    }
    mx.eval([t for t, _ in plain.values()], picks, list(sampled.values()))  # one evaluation for every row
    picked = picks.tolist() if picks is not None else []
    kept: list[list[int] | None] = [None] * len(samplings)
    for i, sampling in enumerate(samplings):
        if sampling is None:
            continue
        if sampling.temperature == 0:
            n = next((j for j, d in enumerate(drafts[i]) if picked[i][j] != d), len(drafts[i]))
            kept[i] = [*drafts[i][:n], picked[i][n]]
        else:
            n, token = sampled[i].tolist()
            kept[i] = [*drafts[i][:n], token]
    return kept


def _sampled(g: Any, pending: Any, logits: Any, samplings: Sequence[Sampling | None]) -> dict[int, tuple[Any, Any]]:
    """The rows that did not draft: each one's token after its `y` and its log-probabilities, as mlx-lm's
    step makes them (its processors over its token context, then its sampler)."""
    import mlx.core as mx

    out = {}
    for i, sampling in enumerate(samplings):
        if sampling is not None:
            continue
        row = logits[i : i + 1, 0]
        processors = g.logits_processors[i] or ()
        if processors:
            context = g._token_context[i].update_and_fetch(pending[i : i + 1])
            for processor in processors:
                row = processor(context, row)
        row = row - mx.logsumexp(row, axis=-1, keepdims=True)
        sampler = g.samplers[i] if g.samplers and g.samplers[i] is not None else g.fallback_sampler
        out[i] = (sampler(row)[0], row[0])
    return out


def _settle(g: Any, ys: list[int], width: int, kept: list[list[int]], nexts: list[Any]) -> list[RowTokens]:
    """Each row's tokens up to the first that ends it, its rejected positions rewound, the rows that
    ended taken out of the batch with their caches."""
    import mlx.core as mx

    rows, rejected, keep = [], [], []
    for i, (y, verdict_tokens) in enumerate(zip(ys, kept, strict=True)):
        fed = [y, *verdict_tokens[:-1]]
        row = RowTokens(g.uids[i], [], len(verdict_tokens) - 1)
        for token in fed:
            row.tokens.append(token)
            g._num_tokens[i] += 1
            if g._num_tokens[i] >= g.max_tokens[i]:
                row.finish_reason = "length"
            if g._matchers[i].advance(token):
                row.finish_reason = "stop"
            if row.finish_reason is not None:
                break
        g.tokens[i].extend(row.tokens)
        rejected.append(width - len(row.tokens))
        rows.append(row)
        if row.finish_reason is None:
            keep.append(i)
    rewind_rows(g.prompt_cache, rejected)
    g._next_tokens = mx.array([t[-1] for t in kept], dtype=mx.uint32)
    g._next_logprobs = nexts
    for i, row in enumerate(rows):
        if row.finish_reason is not None:
            row.prompt_cache = g.extract_cache(i)
    if len(keep) < len(rows):
        g.filter(keep)
    return rows
