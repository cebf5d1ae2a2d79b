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
from mlx_subagents.host.mlx.verify import Sampling, verdict

# A prompt that repeats itself, as an agent's context does (a file read, then quoted): long enough that
# the decode crosses a dense buffer's step (256 tokens) and the tiny sliding window (64).
LINE = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
PROMPT = [(i * 37) % 300 + 30 for i in range(200)] + LINE * 4 + LINE[:5]


def test_lookup_drafts_what_followed_the_latest_match_and_pauses_when_refused() -> None:
    drafter = LookupDrafter(draft=4)  # drafts of 4 to start (8 by default), n-grams of 2 to 4
    tokens = [5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 1, 2]
    assert drafter.propose(tokens) == [3, 7, 7, 1]  # after the latest "1 2"
    assert LookupDrafter().propose([1, 2, 3, 4]) == []  # nothing repeats
    assert LookupDrafter(draft=4).propose([9, 5, 6, 5, 6]) == [5, 6, 5, 6]  # a repeating run goes on
    drafter.observe(4, 4)  # a whole draft kept: the next is twice as long
    tokens += [3, 7, 7, 1, 2]
    assert drafter.draft == 8 and drafter.propose(tokens) == [3, 7, 7, 1, 2, 3, 7, 7]  # after "7 7 1 2"
    drafter.observe(8, 5)  # refused at its sixth token: two more than were kept
    assert drafter.draft == 7
    for _ in range(6):
        drafter.observe(7, 0)
    assert drafter.draft == 2 and drafter.min_ngram == 4 and drafter.paused == 16
    assert [drafter.propose(tokens) for _ in range(17)][-2:] == [[], [3, 7]]  # 16 skipped, then drafts again
    for _ in range(5):
        drafter.observe(2, 0)
    assert drafter.paused == 32  # failing again pauses twice as long


def replayed(drafter: LookupDrafter, prompt: list[int], reply: list[int]) -> tuple[int, int, int]:
    """`reply` decoded greedily after `prompt` with `drafter`'s drafts, without the model: a draft is
    accepted up to its first token that differs from the reply (what greedy verdicts keep), each forward
    adds one token more, and a draft is cut to what is left, as `DraftedStream.next` cuts it. The
    forwards run, the tokens drafted and the tokens accepted."""
    tokens, done, forwards, drafted, accepted = list(prompt), 0, 0, 0, 0
    while done < len(reply):
        draft = drafter.propose(tokens)[: len(reply) - done - 1]
        kept = next((i for i, t in enumerate(draft) if t != reply[done + i]), len(draft))
        drafter.observe(len(draft), kept)
        tokens += reply[done : done + kept + 1]
        done, forwards, drafted, accepted = done + kept + 1, forwards + 1, drafted + len(draft), accepted + kept
    return forwards, drafted, accepted


def test_a_recorded_reply_replays_through_the_drafter_in_the_forwards_it_was_tuned_for() -> None:
    """SmolLM2's greedy reply to the benchmark's edit workload (recorded with drafts off: 256 tokens, the
    function never quoted, a docstring said again and again) takes 63 verifying forwards with the
    drafter's settings, 4.06 tokens per forward (the settings before them, drafts of 4 growing by 2 up to
    8, took 74)."""
    import json

    recorded = json.loads((Path(__file__).parent / "smollm2_edit_reply.json").read_text())
    prompt, reply = recorded["prompt"], recorded["reply"]
    assert len(reply) == 256
    assert replayed(LookupDrafter(), prompt, reply) == (63, 214, 193)


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
    return row_cache(model, bits, shared, PROMPT)


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
        stream = DraftedStream(model, fresh(model, bits, shared), PROMPT, Sampling(0.0), drafter)
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
        stream = DraftedStream(model, fresh(model, 16, None), PROMPT, Sampling(0.0), Foreseen(expected, right=True))
        assert stream.next() == expected[:6]
        stream.end(used)
        assert stream.tokens == PROMPT + expected[:used] and stream.cache[0].offset == len(PROMPT) + used
        assert cache_nbytes(stream.cache) == sizes[used]
    cache = fresh(model, 16, None)
    model(mx.array([PROMPT[-1:]]), cache=cache)
    stream = DraftedStream(model, cache, PROMPT, Sampling(0.0), Foreseen(expected, right=True), pending=expected[0])
    assert stream.next() == expected[:1] and stream.next() == expected[1:7]


def test_a_recurrent_layer_refuses_drafts_in_one_line(tiny_qwen35: tuple[Any, Any]) -> None:
    model, _ = tiny_qwen35
    cache = model.make_cache()
    assert refusal(cache) == "drafts off: a recurrent layer's state cannot be rewound past a rejected draft"
    with pytest.raises(ValueError, match="recurrent layer"):
        DraftedStream(model, cache, [1, 2, 3], Sampling(0.0), LookupDrafter())


@pytest.mark.parametrize(
    ("sampling", "draft"),
    [(Sampling(0.8), [1, 3]), (Sampling(0.8, top_p=0.7), [1, 3]), (Sampling(1.2, top_k=3), [1, 4])],
    ids=["temperature", "top_p", "top_k-cuts-the-draft"],
)
def test_sampled_verdicts_keep_the_samplers_distribution(sampling: Sampling, draft: list[int]) -> None:
    """Over a vocabulary of 6, each kept token is distributed as the session's sampler draws it (mlx-lm's
    `make_sampler`: its top_p or top_k cut, then the temperature), whatever the draft, a drafted token
    the cut leaves out too (a chi-square test on 1,200 verdicts): the first kept token, and the second,
    given that the first was the drafted one."""
    from mlx_lm.sample_utils import make_sampler

    logits = mx.array(
        [[2.0, 1.0, 0.5, 0.0, -0.5, -1.0], [0.0, 1.5, -1.0, 1.0, 0.2, 0.4], [1.0, 0.0, 0.0, 1.0, 2.0, -2.0]]
    )
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.random.seed(7)
    top_p = sampling.top_p if sampling.top_p < 1 else 0.0  # make_sampler's "no cut"
    sampler = make_sampler(temp=sampling.temperature, top_p=top_p, top_k=sampling.top_k)
    probs = [frequencies(sampler(mx.repeat(row[None], 50000, axis=0)).tolist()) for row in logprobs]
    firsts, seconds = [0] * 6, [0] * 6
    for _ in range(1200):
        kept = verdict(logprobs, draft, sampling)
        firsts[kept[0]] += 1
        if kept[0] == draft[0]:
            seconds[kept[1]] += 1
    assert sum(seconds) > 100
    assert chi_square(firsts, probs[0]) < 20.5  # 5 degrees of freedom at most, p = 0.001
    assert chi_square(seconds, probs[1]) < 20.5


def frequencies(tokens: list[int], vocabulary: int = 6) -> list[float]:
    """Each token's share of `tokens` (the sampler's own draws: what a verdict must match)."""
    return [tokens.count(t) / len(tokens) for t in range(vocabulary)]


def chi_square(counts: list[int], probs: list[float]) -> float:
    """Pearson's statistic of `counts` against `probs`; a token of probability 0 must never come."""
    total = sum(counts)
    assert all(c == 0 for c, p in zip(counts, probs, strict=True) if p == 0)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True) if p > 0)


async def replies(path: Path, n: int, draft: str) -> tuple[list[list[tuple[int, ...]]], list[tuple[int, int]]]:
    """Each of `n` sessions' two turns (the second over the first's cache), started together, session i's
    replies 48 tokens long at most, less 16 for each session after it (so they end one after the other);
    and each reply's (drafted, accepted) tokens."""
    import asyncio

    from mlx_subagents.host import GenerateArgs, MlxModelHost
    from tests.host.test_batching import result, task
    from tests.host.test_draft_costs import fix_costs

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
        fix_costs(host)  # drafts pay in the batch, whatever this machine's steps take
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


class RowForeseen:
    """A batch row's drafter that knows its reply (`expected`, after `prompt`): drafts of 1 to 6 tokens,
    wrong at a moving place (`Foreseen`'s pattern), or none where `quiet` (a row that does not draft)."""

    def __init__(self, expected: list[int], quiet: bool = False) -> None:
        self.expected, self.quiet, self.n = expected, quiet, 0

    def propose(self, done: int) -> list[int]:
        self.n += 1
        if self.quiet:
            return []
        length = self.n % 6 + 1
        draft = self.expected[done + 1 : done + 1 + length]  # after the pending token
        wrong = self.n % (length + 1)
        if wrong < len(draft):
            draft[wrong] += 1
        return draft


def batch_of(model: Any, caches: list[list[Any]], prompts: list[list[int]], limits: list[int]) -> Any:
    """mlx-lm's batch generator decoding greedily from `caches` (each holding its prompt but the last token)."""
    from mlx_lm.generate import BatchGenerator

    batch = BatchGenerator(model, stop_tokens=[], completion_batch_size=8, prefill_batch_size=8)
    batch.insert([p[-1:] for p in prompts], max_tokens=limits, caches=caches, all_tokens=[p[:-1] for p in prompts])
    return batch


def rows_prompts() -> list[list[int]]:
    """Four prompts of different lengths (rows left-padded apart), all starting with PROMPT's first 150."""
    return [PROMPT[: 150 + 31 * i] + LINE * (i + 1) for i in range(4)]


def row_cache(model: Any, bits: int, shared: SharedPrefix | None, prompt: list[int]) -> list[Any]:
    """A cache of the model's kind under `bits` holding `prompt[:-1]` (over `shared`, holding its start)."""
    if shared is not None:
        cache: list[Any] = [PrefixedKVCache(shared, layer) for layer in range(len(model.layers))]
        model(mx.array([prompt[shared.length : -1]]), cache=cache)
    else:
        setting, problem = kv_setting(model, bits)
        assert problem is None
        cache = setting.make_cache(model)
        model(mx.array([prompt[:-1]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def run_batch(model: Any, bits: int, shared: SharedPrefix | None, drafters: list[RowForeseen] | None) -> Any:
    """Each row's greedy tokens and its cache when it ended, its rows' limits 40, 70, 25 and 90: with
    mlx-lm's plain steps (`drafters` None), or with drafted steps wherever a row drafted."""
    from mlx_subagents.host.mlx.drafted_batch import drafted_step

    prompts = rows_prompts()
    limits = [40, 70, 25, 90]
    batch = batch_of(model, [row_cache(model, bits, shared, p) for p in prompts], prompts, limits)
    tokens: dict[int, list[int]] = {uid: [] for uid in range(4)}
    caches: dict[int, list[Any]] = {}
    drafted = 0
    while len(caches) < 4:
        g = batch._generation_batch
        drafts = [drafters[uid].propose(len(tokens[uid])) for uid in g.uids] if drafters and g.uids else []
        if any(drafts) and not batch._unprocessed_sequences:
            drafted += 1
            rows = drafted_step(g, drafts, [Sampling(0.0) if d else None for d in drafts])
            out = [(r.uid, r.tokens, r.finish_reason, r.prompt_cache) for r in rows]
        else:
            out = [(r.uid, [r.token], r.finish_reason, r.prompt_cache) for r in batch.next()[1]]
        for uid, got, finish, cache in out:
            tokens[uid] += got
            if finish is not None:
                caches[uid] = cache
    return tokens, caches, drafted


@pytest.mark.parametrize(
    ("bits", "prefixed"), [(16, False), (8, False), (16, True)], ids=["dense", "quantized", "over-a-shared-prefix"]
)
def test_rows_of_the_batch_draft_with_the_tokens_and_kv_bytes_of_rows_that_never_drafted(
    quantizable: Callable[[str], Path], bits: int, prefixed: bool
) -> None:
    """Four rows of ragged lengths in one batch, three drafting (every verdict: whole, refused at its first,
    last or a middle token) and one not, ending at different tokens (a row ends inside a forward): each
    row's tokens are its greedy tokens without drafts, and its cache when it ends holds the same keys and
    values in the same bytes as the cache of a batch that never drafted."""
    import mlx_lm

    model, _ = mlx_lm.load(str(quantizable("qwen3")))
    shared = prefix_of(model) if prefixed else None
    expected, plain, _ = run_batch(model, bits, shared, None)
    drafters = [RowForeseen(expected[i], quiet=i == 1) for i in range(4)]
    got, caches, drafted = run_batch(model, bits, shared, drafters)
    assert got == expected and drafted > 10
    for uid in range(4):
        assert len(got[uid]) == [40, 70, 25, 90][uid]
        assert cache_nbytes(caches[uid]) == cache_nbytes(plain[uid])
        for a, b in zip(caches[uid], plain[uid], strict=True):
            assert a.offset == b.offset
            for x, y in zip(held(a), held(b), strict=True):
                assert x.shape == y.shape and mx.allclose(x, y, atol=2e-2).item()


def held(layer: Any) -> tuple[Any, Any]:
    """A layer's keys and values over its tokens, as floats (a quantized layer's dequantized)."""
    keys, values = layer.state[:2]
    if isinstance(keys, (tuple, list)):
        return tuple(mx.dequantize(*t, group_size=layer.group_size, bits=layer.bits) for t in (keys, values))
    return keys, values


@pytest.mark.parametrize(("arch", "kind"), [("gemma3_text", "sliding window"), ("qwen3_5", "ArraysCache")])
def test_a_batch_whose_rows_cannot_rewind_alone_says_so_in_one_line(
    quantizable: Callable[[str], Path], arch: str, kind: str
) -> None:
    import mlx_lm

    from mlx_subagents.host.kv.rewind import rows_refusal

    model, _ = mlx_lm.load(str(quantizable(arch)))
    cache = model.make_cache()
    model(mx.array([[1, 2, 3]]), cache=cache)
    problem = rows_refusal([type(c).merge([c]) for c in cache])
    assert problem is not None and problem.startswith("drafts off in the batch: ") and kind in problem
    assert "\n" not in problem


async def mixed(path: Path, draft: str) -> tuple[dict[str, Any], dict[str, int]]:
    """Four sessions decoding together over a KV budget that spills and restores them (three turns each),
    s3 held to a forced script (a logits processor: it never drafts), then a fork of s0 beside s0
    itself: each reply by session and turn, and the pool's counters. The model's `serve --status` entry
    sums every reply's drafted and accepted tokens."""
    import asyncio

    import mlx_lm

    from mlx_subagents.host import GenerateArgs, MlxModelHost
    from mlx_subagents.serve.service import model_summary
    from mlx_subagents.testing import ForcedScripts
    from tests.host.test_batching import result, task
    from tests.host.test_draft_costs import fix_costs

    _, tokenizer = mlx_lm.load(str(path))
    scripts = ForcedScripts(tokenizer, {"s3": ["the same words " * 8, "the same words again " * 6]})
    replies: dict[str, Any] = {}

    async def conversation(host: MlxModelHost, i: int) -> list[dict[str, Any]]:
        session, messages = host.session(f"s{i}"), task(i)
        for turn in range(3):
            replies[f"s{i}/{turn}"] = reply = await session.generate(messages, GenerateArgs(max_tokens=24 + 8 * i))
            messages = messages + [reply.to_message(), result(i, turn)]
        return messages

    settings = {"kv_budget": 1024 * 1024, "max_sessions": 1, "share_prefix": False, "processor_factory": scripts}
    async with MlxModelHost(str(path), draft=draft, **settings) as host:
        fix_costs(host)  # drafts pay in the batch, whatever this machine's steps take
        messages = await asyncio.gather(*(conversation(host, i) for i in range(4)))
        fork = host.session("f0", fork_of="s0")
        replies["f0"], replies["s0/3"] = await asyncio.gather(
            fork.generate(messages[0], GenerateArgs(max_tokens=48)),
            host.session("s0").generate(messages[0] + [task(5)[1]], GenerateArgs(max_tokens=48)),
        )
        stats = await host.memory_stats()
        summary = await model_summary(path, host)  # type: ignore[arg-type]
    drafted, accepted = (
        sum(getattr(r.usage, k) for r in replies.values()) for k in ("drafted_tokens", "accepted_tokens")
    )
    assert summary["drafts"] == {"mode": draft, "on": draft == "lookup", "drafted": drafted, "accepted": accepted}
    return replies, stats.pool


@pytest.mark.slow
def test_rows_of_the_batch_draft_with_the_tokens_of_drafts_off(tiny_qwen3_path: Path) -> None:
    """Greedy replies with drafts on are the replies with drafts off, four sessions batched (one that
    cannot draft), spilled and restored under a small KV budget, then a fork decoding beside its parent;
    the rows that drafted kept some of their drafts, and s3 (a logits processor reads its tokens) none."""
    import asyncio

    off, _ = asyncio.run(mixed(tiny_qwen3_path, "off"))
    on, pool = asyncio.run(mixed(tiny_qwen3_path, "lookup"))
    assert {k: r.token_ids for k, r in on.items()} == {k: r.token_ids for k, r in off.items()}
    assert {r.usage.drafted_tokens for r in off.values()} == {0}
    assert pool["spills"] > 0 and pool["restores"] > 0
    kept = {k: r.usage.accepted_tokens for k, r in on.items()}
    assert kept["s3/0"] == kept["s3/1"] == 0 and kept["s0/0"] > 0 and kept["f0"] > 0


def test_a_constrained_row_drafts_beside_drafting_rows_and_stays_the_same_valid_call(tiny_qwen3_path: Path) -> None:
    """A row held to its tools by the grammar decodes in the batch beside two rows that draft, and drafts
    itself (its drafts walked through its grammar, each verified position masked: `drafted_grammar.py`):
    its reply is the same valid call as with drafts off, token for token, and the other rows' replies
    are theirs too."""
    import asyncio

    import jsonschema

    from mlx_subagents.host import GenerateArgs, MlxModelHost
    from tests.host.test_batching import task
    from tests.host.test_draft_costs import fix_costs
    from tests.host.test_grammar import TASK, TOOLS

    async def go(draft: str) -> list[Any]:
        async with MlxModelHost(str(tiny_qwen3_path), draft=draft) as host:
            fix_costs(host)
            free = [host.session(f"s{i}").generate(task(i), GenerateArgs(max_tokens=64)) for i in range(2)]
            held = host.session("held").generate(TASK, GenerateArgs(max_tokens=64, tool_choice="required"), tools=TOOLS)
            return list(await asyncio.gather(*free, held))

    off, on = asyncio.run(go("off")), asyncio.run(go("lookup"))
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert sum(r.usage.accepted_tokens for r in on[:2]) > 0 and on[2].usage.accepted_tokens > 0
    held = on[2]
    assert held.tool_calls and held.constrained == "calls" and held.malformed_tool_calls == []
    for call in held.tool_calls:
        schema = next(t for t in TOOLS if t["function"]["name"] == call.name)["function"]["parameters"]
        jsonschema.validate(call.arguments, schema)
