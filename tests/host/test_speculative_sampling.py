"""Sampled drafts in the host's batch keep the sampler's distribution (issue 67): a chi-square over many
rows of mlx-lm's real generation batch, verifying drafts with `drafted_batch.drafted_step`, against the
exact distribution that decoding one token at a time samples from (drafts off)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_subagents.host.mlx.drafted_batch import drafted_step
from mlx_subagents.host.mlx.verify import Sampling

VOCABULARY = 6
PROMPT = [3, 1, 4, 1, 5, 2, 6, 5]


class SixTokens:
    """The tiny model, its logits cut to its first six tokens (a vocabulary small enough to count every
    pair of tokens) and scaled to depend on the context visibly; its caches are the model's own."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        return self.model(inputs, cache=cache, **kwargs)[..., :VOCABULARY] * 0.5

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def exact(model: SixTokens, sampling: Sampling, depth: int) -> dict[tuple[int, ...], float]:
    """The probability of each reply of `depth` tokens to PROMPT, one token at a time: each token's
    log-probabilities cut as the sampler cuts them (mlx-lm's `apply_top_p`), at its temperature."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(depth):
        replies = list(probs)
        logits = model(mx.array([PROMPT + list(r) for r in replies]))[:, -1]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        step = mx.softmax(sampling.cut(logprobs) * (1 / sampling.temperature), axis=-1).tolist()
        probs = {r + (t,): probs[r] * step[k][t] for k, r in enumerate(replies) for t in range(VOCABULARY)}
    return probs


def sampled_rows(
    model: SixTokens, sampling: Sampling, rows: int, drafts: list[list[int]], plain: int
) -> tuple[list[list[int]], list[list[int]]]:
    """`rows` replies of four tokens, decoded together in one mlx-lm batch with one sampler: the batch
    samples each row's first two tokens, then one forward verifies a two-token draft in each row but every
    `plain`-th (`drafts` in turn), and plain steps end them. The drafting rows' replies, and the others'."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    drafting = [i % plain != plain - 1 for i in range(rows)]
    batch = BatchGenerator(model, stop_tokens=[], completion_batch_size=rows, prefill_batch_size=rows)
    # One sampler object for every row: mlx-lm samples rows of different samplers one by one (seconds here).
    sampler = make_sampler(temp=sampling.temperature, top_p=sampling.top_p)
    batch.insert([PROMPT] * rows, max_tokens=[4] * rows, samplers=[sampler] * rows)
    tokens: dict[int, list[int]] = {}
    drafted = False
    while len(tokens) < rows or any(len(t) < 4 for t in tokens.values()):
        g = batch._generation_batch
        if tokens and not drafted:
            drafted = True
            own = [drafts[u % len(drafts)] if drafting[u] else [] for u in g.uids]
            samplings = [sampling if d else None for d in own]
            out = [(r.uid, r.tokens) for r in drafted_step(g, own, samplings)]
        else:
            out = [(r.uid, [r.token]) for r in batch.next()[1]]
        for uid, got in out:
            tokens.setdefault(uid, []).extend(got)
    assert drafted
    return [tokens[u] for u in range(rows) if drafting[u]], [tokens[u] for u in range(rows) if not drafting[u]]


def test_sampled_rows_of_the_batch_keep_the_distribution_of_drafts_off(tiny_qwen3: tuple[Any, Any]) -> None:
    """Rows sampling with a top_p cut in one batch, over a vocabulary of six: 360 drafting and 120 not
    (drafts off: mlx-lm's sampler). Each kind's third and fourth tokens (the drafted positions and the
    verdict's own token) are distributed as one token at a time samples them: a chi-square of each token
    and of the pair (those expected fewer than 5 times pooled), and a token the cut rules out never
    comes. (`test_sampled_verdicts_keep_the_samplers_distribution` covers the temperature alone and top_k.)"""
    model = SixTokens(tiny_qwen3[0])
    sampling = Sampling(0.9, top_p=0.8)
    mx.random.seed(11)
    probs = exact(model, sampling, 4)
    third = [sum(p for reply, p in probs.items() if reply[2] == t) for t in range(VOCABULARY)]
    likeliest, next_one, *_, cut = sorted(range(VOCABULARY), key=lambda t: -third[t])
    # Drafts of the likeliest token (a verdict keeps it as often as its probability, and what it samples
    # instead shows a residual that would still hold it), of the next, and of the least likely (one the
    # top_p cut leaves out: always refused).
    drafts = [[likeliest, likeliest], [likeliest, likeliest], [likeliest, next_one], [cut, likeliest]]
    for got in sampled_rows(model, sampling, 480, drafts, plain=4):
        for place in (slice(2, 3), slice(3, 4), slice(2, 4)):  # the third token, the fourth, the pair
            counts: dict[tuple[int, ...], int] = {}
            for reply in got:
                counts[tuple(reply[place])] = counts.get(tuple(reply[place]), 0) + 1
            expected: dict[tuple[int, ...], float] = {}
            for reply, p in probs.items():
                expected[reply[place]] = expected.get(reply[place], 0.0) + p
            assert all(expected[tokens] > 0 for tokens in counts)
            statistic, freedom = chi_square(counts, expected)
            assert freedom >= 2 and statistic < LIMITS[freedom], (place, statistic, freedom)


def chi_square(counts: dict[tuple[int, ...], int], probs: dict[tuple[int, ...], float]) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `probs` and its degrees of freedom, the cells expected fewer
    than 5 times pooled into one."""
    total = sum(counts.values())
    statistic, cells, pooled, seen = 0.0, 0, 0.0, 0
    for key, p in probs.items():
        if total * p >= 5:
            statistic += (counts.get(key, 0) - total * p) ** 2 / (total * p)
            cells += 1
        else:
            pooled, seen = pooled + total * p, seen + counts.get(key, 0)
    if pooled > 0:
        statistic, cells = statistic + (seen - pooled) ** 2 / pooled, cells + 1
    return statistic, cells - 1


# The chi-square distribution's 0.999 quantile by degrees of freedom (p = 0.001).
LIMITS = {
    1: 10.8,
    2: 13.8,
    3: 16.3,
    4: 18.5,
    5: 20.5,
    6: 22.5,
    7: 24.3,
    8: 26.1,
    9: 27.9,
    10: 29.6,
    11: 31.3,
    12: 32.9,
    13: 34.5,
    14: 36.1,
    15: 37.7,
    16: 39.3,
    17: 40.8,
    18: 42.3,
    19: 43.8,
    20: 45.3,
    21: 46.8,
    22: 48.3,
    23: 49.7,
    24: 51.2,
    25: 52.6,
    26: 54.1,
    27: 55.5,
    28: 56.9,
    29: 58.3,
    30: 59.7,
    31: 61.1,
    32: 62.5,
    33: 63.9,
    34: 65.2,
    35: 66.6,
}
