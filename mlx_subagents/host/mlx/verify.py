"""Verification: which drafted tokens a session keeps, given the model's logits at each drafted position,
so that its output is exactly what decoding one token at a time gives.

A verifying forward feeds the token before the draft and the draft's k tokens; its k + 1 rows of
logits are the model's next-token distributions after each prefix of the draft. The verdict keeps a
prefix of the draft and adds one token of the model's own:

- greedy (temperature 0): the longest prefix the model's argmax agrees with, then the argmax at the
  first disagreement (or after the whole draft). Each kept token is the one a step would have chosen.
- sampled: speculative sampling (Leviathan et al., 2023; Chen et al., 2023) with a draft from lookup,
  whose distribution puts all its mass on the drafted token d: keep d with the model's probability
  p(d); at the first refusal sample from the residual, p with d removed and renormalized; after a
  whole draft, sample the next token from p. Each token is then distributed exactly as p, so the
  output distribution is unchanged (tests/host/test_speculative.py checks it with a chi-square).

With a `top_p` or `top_k` cut, p is the distribution the session's sampler draws from: mlx-lm's own
cuts (`apply_top_p`, then `apply_top_k`, as `make_sampler` chains them) over the log-probabilities at
every verified position, then the temperature. A drafted token the cut leaves out has p(d) = 0: it is
refused, and the residual is the cut distribution itself.

The candidates are drawn on the device for every row at once (a uniform per drafted token, one
residual sample per row, the last row's sample plain), and one read brings the verdict back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sampling:
    """How a session samples, as `make_sampler(temp=, top_p=, top_k=)`: 0 for greedy; `top_p` 1 and
    `top_k` 0 for no cut."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0

    @classmethod
    def of(cls, request: Any) -> Sampling:
        """How a turn's `request` samples (its temperature, top_p and top_k)."""
        return cls(request.temperature, request.top_p, request.top_k)

    def cut(self, logprobs: Any) -> Any:
        """`logprobs` (one row per position) with the sampler's cuts: what it leaves out at minus infinity."""
        from mlx_lm.sample_utils import apply_top_k, apply_top_p

        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return logprobs


def verdict(logprobs: Any, draft: Sequence[int], sampling: Sampling) -> list[int]:
    """The tokens to keep: an accepted prefix of `draft`, then one of the model's.

    Args:
        logprobs: shape (len(draft) + 1, vocabulary): the model's log-probabilities after the token
            before the draft and after each drafted token, any logits processors applied.
        draft: the drafted tokens.
        sampling: greedy, or the temperature and cuts of the session's sampler.
    """
    n, token = judged(logprobs, draft, sampling).tolist()
    return [*draft[:n], token]


def judged(logprobs: Any, draft: Sequence[int], sampling: Sampling) -> Any:
    """`verdict` on the device, not read back: `[how many drafted tokens it keeps, the model's token after
    them]` (int32), so that a batch reads every row's in one evaluation."""
    import mlx.core as mx

    k = len(draft)
    drafted = mx.array(list(draft), dtype=mx.uint32)
    if sampling.temperature == 0:
        picks = mx.argmax(logprobs, axis=-1)
        agree = picks[:k] == drafted
    elif k == 0:
        scaled = sampling.cut(logprobs) * (1 / sampling.temperature)
        picks, agree = mx.random.categorical(scaled, axis=-1), mx.array([], dtype=mx.bool_)
    else:
        scaled = sampling.cut(logprobs) * (1 / sampling.temperature)
        probs = mx.softmax(scaled[:k], axis=-1)
        agree = mx.random.uniform(shape=(k,)) < mx.take_along_axis(probs, drafted[:, None], axis=-1)[:, 0]
        residual = mx.put_along_axis(scaled[:k], drafted[:, None], mx.array(-mx.inf, scaled.dtype), axis=-1)
        picks = mx.random.categorical(mx.concatenate([residual, scaled[k:]]), axis=-1)
    # The first refusal, or k when there is none: argmin finds the first 0 of agree followed by a 0.
    kept = mx.argmin(mx.concatenate([agree, mx.array([False])]).astype(mx.int32))
    return mx.stack([kept.astype(mx.int32), picks[kept].astype(mx.int32)])
