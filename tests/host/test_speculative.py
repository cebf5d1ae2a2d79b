"""Speculative decoding's pieces (issue 67): prompt-lookup drafts (`host/mlx/drafts.py`), the exact verdict
(`host/mlx/verify.py`) and the rewind of rejected positions from each cache kind (`host/kv/rewind.py`),
together in `DraftedStream`: the same greedy tokens and the same KV bytes as decoding one token at a time."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlx_subagents.host.kv.kv_bits import kv_setting
from mlx_subagents.host.kv.kv_pool import cache_nbytes
from mlx_subagents.host.kv.prefixed_cache import PrefixedKVCache, SharedPrefix
from mlx_subagents.host.kv.rewind import refusal
from mlx_subagents.host.mlx.drafted import DraftedStream
from mlx_subagents.host.mlx.drafts import LookupDrafter
from mlx_subagents.host.mlx.verify import verdict

# A prompt that repeats itself, as an agent's context does (a file read, then quoted): long enough that
# the decode crosses a dense buffer's step (256 tokens) and the tiny sliding window (64).
LINE = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
PROMPT = [(i * 37) % 300 + 30 for i in range(200)] + LINE * 4 + LINE[:5]


def test_lookup_drafts_what_followed_the_latest_match_and_pauses_when_refused() -> None:
    drafter = LookupDrafter()  # drafts of 4 to start, n-grams of 2 to 4
    tokens = [5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 1, 2]
    assert drafter.propose(tokens) == [3, 7, 7, 1]  # after the latest "1 2"
    assert LookupDrafter().propose([1, 2, 3, 4]) == []  # nothing repeats
    assert LookupDrafter().propose([9, 5, 6, 5, 6]) == [5, 6, 5, 6]  # a repeating run goes on
    drafter.observe(4, 4)  # a whole draft kept: the next is longer
    tokens += [3, 7, 7, 1, 2]
    assert drafter.draft == 6 and drafter.propose(tokens) == [3, 7, 7, 1, 2, 3]  # after "7 7 1 2", copying on
    for _ in range(4):
        drafter.observe(6, 0)
    assert drafter.draft == 1 and drafter.min_ngram == 4 and drafter.paused == 16
    assert [drafter.propose(tokens) for _ in range(17)][-2:] == [[], [3]]  # 16 skipped, then drafts again
    for _ in range(4):
        drafter.observe(1, 0)
    assert drafter.paused == 32  # failing again pauses twice as long


def reference(model: Any, cache: list[Any], prompt: list[int], n: int) -> tuple[list[int], list[int]]:
    """`n` greedy tokens decoded one at a time on `cache` (holding `prompt[:-1]`), and the cache's bytes
    after each token was fed."""
    tokens, sizes, last = [], [], prompt[-1]
    for _ in range(n):
        logits = model(mx.array([[last]]), cache=cache)[0, -1]
        mx.eval(logits)
        sizes.append(cache_nbytes(cache))
        last = int(mx.argmax(logits).item())
        tokens.append(last)
    return tokens, sizes


def fresh(model: Any, bits: int, shared: SharedPrefix | None) -> list[Any]:
    """A cache of the model's kind under `bits` holding `PROMPT[:-1]` (over `shared`, holding its start)."""
    if shared is not None:
        cache: list[Any] = [PrefixedKVCache(shared, layer) for layer in range(len(model.layers))]
        model(mx.array([PROMPT[shared.length : -1]]), cache=cache)
    else:
        setting, problem = kv_setting(model, bits)
        assert problem is None
        cache = setting.make_cache(model)
        model(mx.array([PROMPT[:-1]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def prefix_of(model: Any) -> SharedPrefix:
    cache = [PrefixedKVCache() for _ in model.layers]
    model(mx.array([PROMPT[:150]]), cache=cache)
    return SharedPrefix([c.frozen() for c in cache], 150)


class Foreseen:
    """A drafter that knows the reply (`expected`): its drafts, 1 to 6 tokens long in turn, are right up
    to a wrong token at a place that moves each time (none every few drafts), so every verdict happens:
    a whole draft kept, refused at its first token, at its last, in between."""

    def __init__(self, expected: list[int], right: bool = False) -> None:
        self.expected, self.n, self.right = expected, 0, right  # right: every draft is 5 right tokens

    def propose(self, tokens: list[int]) -> list[int]:
        self.n += 1
        done, length = len(tokens) - len(PROMPT), 5 if self.right else self.n % 6 + 1
        draft = self.expected[done : done + length]
        wrong = length if self.right else self.n % (length + 1)
        if wrong < len(draft):
            draft[wrong] += 1
        return draft

    def observe(self, drafted: int, accepted: int) -> None:
        pass


@pytest.mark.parametrize(
    ("arch", "bits", "prefixed"),
    [
        ("qwen3", 16, False),
        ("qwen3", 8, False),
        ("qwen3", 16, True),
        ("gemma3_text", 16, False),
        ("gemma3_text", 8, False),
    ],
    ids=["dense", "quantized", "over-a-shared-prefix", "sliding-window", "quantized-sliding-window"],
)
def test_greedy_drafts_give_the_tokens_and_the_kv_bytes_of_one_token_at_a_time(
    quantizable: Callable[[str], Path], arch: str, bits: int, prefixed: bool
) -> None:
    """Dense, quantized, over a shared prefix and sliding-window caches (past the window and a dense
    step's end): every token is the one-at-a-time greedy token, and after each forward, whatever the
    verdict, the cache holds the bytes of a cache that never drafted (compared at the same tokens).
    The dense model drafts by prompt lookup too (its random reply repeats itself)."""
    import mlx_lm

    model, _ = mlx_lm.load(str(quantizable(arch)))
    shared = prefix_of(model) if prefixed else None
    n = 90
    expected, sizes = reference(model, fresh(model, bits, shared), PROMPT, n)
    drafters = [Foreseen(expected)] + ([LookupDrafter()] if (arch, bits, prefixed) == ("qwen3", 16, False) else [])
    for drafter in drafters:
        stream = DraftedStream(model, fresh(model, bits, shared), PROMPT, 0.0, drafter)
        got: list[int] = []
        while len(got) < n:
            got += stream.next(limit=n - len(got))
            # The cache holds every kept token but the last: the reference's bytes after feeding the same.
            assert cache_nbytes(stream.cache) == sizes[len(got) - 1]
        assert got == expected
        counts = stream.counts
        assert counts.accepted > 0 and counts.drafted > counts.accepted and counts.forwards < n


def test_a_sequence_that_ends_inside_a_forward_holds_what_one_token_at_a_time_holds(
    quantizable: Callable[[str], Path],
) -> None:
    """A reply that ends at the first, a middle or the last token a forward kept (an end-of-turn token,
    a stop): the cache holds every token up to it and no more, in the bytes of a cache that never drafted.
    Given the token a batch computed (`pending`), the stream returns it first and goes on from there."""
    import mlx_lm

    model, _ = mlx_lm.load(str(quantizable("qwen3")))
    expected, sizes = reference(model, fresh(model, 16, None), PROMPT, 8)
    for used in (1, 3, 6):
        stream = DraftedStream(model, fresh(model, 16, None), PROMPT, 0.0, Foreseen(expected, right=True))
        assert stream.next() == expected[:6]
        stream.end(used)
        assert stream.tokens == PROMPT + expected[:used] and stream.cache[0].offset == len(PROMPT) + used
        assert cache_nbytes(stream.cache) == sizes[used]
    cache = fresh(model, 16, None)
    model(mx.array([PROMPT[-1:]]), cache=cache)
    stream = DraftedStream(model, cache, PROMPT, 0.0, Foreseen(expected, right=True), pending=expected[0])
    assert stream.next() == expected[:1] and stream.next() == expected[1:7]


def test_a_recurrent_layer_refuses_drafts_in_one_line(tiny_qwen35: tuple[Any, Any]) -> None:
    model, _ = tiny_qwen35
    cache = model.make_cache()
    assert refusal(cache) == "drafts off: a recurrent layer's state cannot be rewound past a rejected draft"
    with pytest.raises(ValueError, match="recurrent layer"):
        DraftedStream(model, cache, [1, 2, 3], 0.0, LookupDrafter())


def test_sampled_verdicts_keep_the_models_distribution() -> None:
    """Over a vocabulary of 6, each kept token is distributed as the model's probabilities at the
    temperature, whatever the draft (a chi-square test on 2,500 verdicts): the first kept token, and the
    second, given that the first was the drafted one."""
    logits = mx.array(
        [[2.0, 1.0, 0.5, 0.0, -0.5, -1.0], [0.0, 1.5, -1.0, 1.0, 0.2, 0.4], [1.0, 0.0, 0.0, 1.0, 2.0, -2.0]]
    )
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.random.seed(7)
    probs = mx.softmax(logprobs * (1 / 0.8), axis=-1).tolist()
    firsts, seconds = [0] * 6, [0] * 6
    for _ in range(2500):
        kept = verdict(logprobs, [1, 3], 0.8)
        firsts[kept[0]] += 1
        if kept[0] == 1:
            seconds[kept[1]] += 1
    assert chi_square(firsts, probs[0]) < 20.5  # 5 degrees of freedom, p = 0.001
    assert chi_square(seconds, probs[1]) < 20.5


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))


async def replies(path: Path, n: int, draft: str) -> tuple[list[list[tuple[int, ...]]], list[tuple[int, int]]]:
    """Each of `n` sessions' two turns (the second over the first's cache), started together, session i's
    replies 48 tokens long at most, less 16 for each session after it (so they end one after the other);
    and each reply's (drafted, accepted) tokens."""
    import asyncio

    from mlx_subagents.host import GenerateArgs, MlxModelHost
    from tests.host.test_batching import result, task

    counts: list[tuple[int, int]] = []

    async def conversation(host: MlxModelHost, i: int) -> list[tuple[int, ...]]:
        session, messages, out = host.session(f"s{i}"), task(i), []
        for turn in range(2):
            reply = await session.generate(messages, GenerateArgs(max_tokens=48 - 16 * (n - 1 - i)))
            counts.append((reply.usage.drafted_tokens, reply.usage.accepted_tokens))
            out.append(reply.token_ids)
            messages = messages + [reply.to_message(), result(i, turn)]
        return out

    async with MlxModelHost(str(path), draft=draft) as host:
        return list(await asyncio.gather(*(conversation(host, i) for i in range(n)))), counts


@pytest.mark.parametrize("n", [1, 3])
def test_the_host_drafts_for_the_single_turn_with_the_same_tokens(quantizable: Callable[[str], Path], n: int) -> None:
    """A session decoding on its own drafts (its usage counts the drafted and kept tokens) and gives the
    tokens it gives with drafts off, over two turns (the second reusing the first's cache); three
    sessions do too, as each moves from the batch to the single path when the others end and back."""
    import asyncio

    path = quantizable("qwen3")
    off, none = asyncio.run(replies(path, n, "off"))
    on, counts = asyncio.run(replies(path, n, "lookup"))
    assert on == off and none == [(0, 0)] * 2 * n
    assert sum(d for d, _ in counts) >= sum(a for _, a in counts) > 0
