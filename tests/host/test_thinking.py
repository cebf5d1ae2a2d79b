"""The thought budget (`host/calls/thinking.py`): which tokens it forces and when, without ever reading a token on the host.

Its state lives on the device, so a decode step only builds a graph: the tests drive it the way both decode
paths do, one step ahead (each step's context holds the previous step's still-pending token), and check that
nothing was evaluated. Its picks are compared with the host-side algorithm it replaced, which read each new
token with `.tolist()` (a sync per step).
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from mlx_subagents.host.calls.thinking import ThoughtBudget
from mlx_subagents.host.mlx.mlx_host import MlxModelHost
from mlx_subagents.host.mlx.single import SingleStream
from mlx_subagents.host.protocol import GenerateArgs
from mlx_subagents.testing import ForcedScripts
from tests.helpers import unevaluated

VOCAB = 12


class HostThoughtBudget:
    """The algorithm before the state moved to the device (reads the new tokens on the host), kept as
    the reference the device version must match pick for pick."""

    def __init__(self, budget: int, start: tuple[int, ...], end: tuple[int, ...], opened: bool) -> None:
        self.budget, self.start, self.end = max(0, budget), start, end
        self.thinking, self.spent, self._forced = opened, 0, 0
        self._seen: int | None = None
        self._tail: list[int] = []

    def pick(self, tokens: list[int]) -> int | None:
        """The token forced after `tokens`, or None."""
        if self._seen is not None:
            for token in tokens[self._seen :]:
                self._advance(token)
        self._seen = len(tokens)
        return self.end[self._forced] if self.thinking and self.spent >= self.budget else None

    def _advance(self, token: int) -> None:
        self._tail = [*self._tail, token][-max(len(self.start), len(self.end)) :]
        if not self.thinking:
            if self.start and tuple(self._tail[-len(self.start) :]) == self.start:
                self.thinking, self.spent, self._forced = True, 0, 0
            return
        self.spent += 1
        if self.spent > self.budget and self._forced < len(self.end) and token == self.end[self._forced]:
            self._forced += 1
        if tuple(self._tail[-len(self.end) :]) == self.end:
            self.thinking, self._forced = False, 0


def decode(processor: ThoughtBudget, prompt: list[int], wishes: list[int]) -> tuple[list[int], list[int | None]]:
    """Decode one step ahead as mlx-lm does, evaluating nothing until the end: each step the model
    "wants" `wishes[i]` (the only nonzero logit), the processor may override it, and the argmax is fed
    back still pending. Every output and the processor's state must still be pending after its call.
    Returns the emitted tokens and, per step, the token the processor forced (None: it let the logits be)."""
    context = mx.array(prompt, dtype=mx.uint32) + 0
    outputs = []
    for wish in wishes:
        logits = (mx.arange(VOCAB) == wish).astype(mx.float32)[None] + 0
        advanced = processor.state is not None  # the state will take the newest token one step at a time
        out = processor(context, logits)
        # Evaluating anything made from the context would have evaluated the context too.
        pending = [context, out]
        state = processor.state  # made once something could be forced, from the tokens so far
        if state is not None:
            pending.append(state.at)
            if advanced:
                pending.append(state.over)
        assert unevaluated(*pending)
        outputs.append(out)
        context = mx.concatenate([context, mx.argmax(out, axis=-1).astype(mx.uint32)])
    mx.eval(context, outputs)
    forced = []
    for out, wish in zip(outputs, wishes, strict=True):
        row = out[0].tolist()
        if row.count(float("-inf")) == 0:
            assert row == [float(i == wish) for i in range(VOCAB)]  # the logits untouched
            forced.append(None)
        else:
            assert row.count(0.0) == 1 and row.count(float("-inf")) == VOCAB - 1
            forced.append(row.index(0.0))
    return context[len(prompt) :].tolist(), forced


def reference(
    budget: int, start: tuple[int, ...], end: tuple[int, ...], opened: bool, prompt: list[int], wishes: list[int]
) -> tuple[list[int], list[int | None]]:
    """What the host-side algorithm emits and forces for the same decode."""
    old = HostThoughtBudget(budget, start, end, opened)
    tokens, forced = list(prompt), []
    for wish in wishes:
        pick = old.pick(tokens)
        forced.append(pick)
        tokens.append(wish if pick is None else pick)
    return tokens[len(prompt) :], forced


START, END = (7,), (8,)
# Ids: 7 opens a thought, 8 closes it; 1-4 are words.
SCRIPTED = [
    # Opened in the prompt, budget 3: three thought tokens, the forced close, then the answer; the model
    # thinks again in its reply (7), and that thought is cut at 3 too.
    (3, START, END, True, [1, 1, 1, 1, 1, 2, 7, 3, 3, 3, 3, 3, 2], [1, 1, 1, 8, 1, 2, 7, 3, 3, 3, 8, 3, 2]),
    # Budget 0, opened in the prompt: the close comes first.
    (0, START, END, True, [1, 2, 7, 3], [8, 2, 7, 8]),
    # The model closes its thought itself within the budget; nothing is forced until it reopens.
    (4, START, END, True, [1, 8, 2, 2, 2, 2, 2, 7, 1, 1, 1, 1, 1], [1, 8, 2, 2, 2, 2, 2, 7, 1, 1, 1, 1, 8]),
    # Not opened: words, then a thought opens in the reply at budget 0; 8 outside a thought does nothing.
    (0, START, END, False, [8, 1, 7, 1, 1], [8, 1, 7, 8, 1]),
    # The model says the end marker itself exactly when the budget runs out.
    (2, START, END, True, [1, 1, 8, 2], [1, 1, 8, 2]),
    # Multi-token markers: start 7 9, end 8 10 11. A 7 by itself opens nothing; a model-said 8 10 then a word is
    # no close; at the budget the whole end marker is forced, one token a step.
    (2, (7, 9), (8, 10, 11), False, [7, 1, 7, 9, 8, 1, 1, 1, 1, 2], [7, 1, 7, 9, 8, 1, 8, 10, 11, 2]),
    (3, (7, 9), (8, 10, 11), True, [8, 10, 1, 2, 2, 2, 2, 2], [8, 10, 1, 8, 10, 11, 2, 2]),
    # A model-said first marker token as the budget runs out is not taken as forced: the whole marker follows
    # (8 8 10), as it always did.
    (2, (7,), (8, 10), True, [1, 8, 1, 1, 7, 1, 8, 1, 1], [1, 8, 8, 10, 7, 1, 8, 8, 10]),
]


@pytest.mark.parametrize(("budget", "start", "end", "opened", "wishes", "emitted"), SCRIPTED)
def test_the_budget_forces_the_end_marker_without_evaluating(
    budget: int, start: tuple[int, ...], end: tuple[int, ...], opened: bool, wishes: list[int], emitted: list[int]
) -> None:
    prompt = [5, 6, 7] if opened else [5, 6]
    got = decode(ThoughtBudget(budget, start, end, opened), prompt, wishes)
    assert got[0] == emitted
    assert got == reference(budget, start, end, opened, prompt, wishes)


@pytest.mark.slow
def test_random_streams_force_what_the_host_side_algorithm_forced() -> None:
    # Streams dense in marker tokens (partial markers, markers inside and outside thoughts, overlapping
    # start and end, one a suffix of the other), budgets from 0 to 12 (thoughts open and close several
    # times before the first one could be forced), opened or not: the same picks at every step.
    rng = random.Random(12)
    markers = [((7,), (8,)), ((7, 9), (8, 10, 11)), ((7, 8), (8, 7)), ((), (8,)), ((9, 9), (9,)), ((7,), (7,))]
    n_forced = 0
    for start, end in markers:
        for budget in (0, 1, 2, 3, 4, 7, 12):
            for opened in (True, False):
                wishes = [rng.choice([1, 2, 7, 8, 9, 10, 11]) for _ in range(40)]
                got = decode(ThoughtBudget(budget, start, end, opened), [5], wishes)
                assert got == reference(budget, start, end, opened, [5], wishes), (start, end, budget, opened)
                n_forced += sum(f is not None for f in got[1])
    assert n_forced == 164  # the streams do reach their budgets


def test_several_new_tokens_in_one_call_are_taken_in_order() -> None:
    processor = ThoughtBudget(2, (7,), (8, 10), opened=False)
    old = HostThoughtBudget(2, (7,), (8, 10), opened=False)
    context = mx.array([5, 5], dtype=mx.uint32) + 0
    logits = mx.zeros((1, VOCAB)) + 0
    outs, tokens, expected = [processor(context, logits)], [5, 5], [old.pick([5, 5])]
    for new in ([1, 7, 1], [], [1], [8, 3]):  # opens, thinks two tokens, is closed (8 then 10 forced)
        context = mx.concatenate([context, mx.array(new, dtype=mx.uint32)]) if new else context
        outs.append(processor(context, logits))
        assert unevaluated(context, outs[-1])
        tokens += new
        expected.append(old.pick(tokens))
    mx.eval(outs)
    picks = [row.index(0.0) if float("-inf") in row else None for row in (out[0].tolist() for out in outs)]
    assert picks == expected == [None, None, None, 8, 10]  # 8 3: the marker's second token is still due
    with pytest.raises(RuntimeError, match="fresh one per request"):
        processor(context[:-1], logits)


def test_until_a_thought_could_reach_its_budget_a_call_adds_nothing() -> None:
    # Budget 3: until three tokens were generated no thought can be 3 long, so the logits come back as
    # they were given (no graph, no state); the call after the third works the state out (the prompt's
    # thought went on: 1 1 1) and forces.
    processor = ThoughtBudget(3, (7,), (8,), opened=True)
    contexts = [mx.array([5, 7] + [1] * k, dtype=mx.uint32) + 0 for k in range(5)]
    logits = [mx.zeros((1, VOCAB)) + k for k in range(5)]
    outs = [processor(context, x) for context, x in zip(contexts, logits, strict=True)]
    assert [out is x for out, x in zip(outs, logits, strict=True)] == [True, True, True, False, False]
    assert processor.state is not None
    for out in outs[3:]:
        assert out[0].tolist() == [0.0 if i == 8 else float("-inf") for i in range(VOCAB)]


class Watched:
    """A processor wrapper that counts the calls that left their context evaluated: the context is still
    pending when a decode path calls its processors, so evaluating it means waiting for the step in flight."""

    def __init__(self, processor: ThoughtBudget) -> None:
        self.processor, self.calls, self.waits = processor, 0, 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        pending = unevaluated(tokens)
        out = self.processor(tokens, logits)
        self.calls += 1
        self.waits += pending and not unevaluated(tokens)
        return out


def test_neither_decode_path_waits_for_the_step_in_flight(tiny_thinking_path: Path) -> None:
    """mlx-lm's batch and the host's single-sequence path (both one step ahead) decode 32 tokens of the
    tiny thinking model with a budget of 16 (the prompt opens the thought): the 17th token is the forced
    `</think>` (1544) and no call of the processor evaluated its context (the host-side version waited in
    every call but the first)."""
    model, tokenizer = mlx_lm.load(str(tiny_thinking_path))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "where?"}], add_generation_prompt=True)

    def budget() -> Watched:
        return Watched(ThoughtBudget(16, tokenizer.think_start_tokens, tokenizer.think_end_tokens, opened=True))

    single = budget()
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    stream = SingleStream(model, cache, prompt, make_sampler(temp=0.0), [single])
    single_ids = [stream.next() for _ in range(32)]

    batched = budget()
    generator = BatchGenerator(model, stop_tokens=set())
    generator.insert([prompt], max_tokens=[32], logits_processors=[[batched]])
    batch_ids: list[int] = []
    while len(batch_ids) < 32:
        batch_ids += [response.token for response in generator.next()[1]]

    assert single_ids == batch_ids and single_ids[16] == 1544 and single_ids.count(1544) == 1
    assert (single.calls, single.waits) == (batched.calls, batched.waits) == (33, 0)


def test_an_empty_end_marker_is_refused() -> None:
    with pytest.raises(ValueError, match="end marker"):
        ThoughtBudget(3, (7,), (), opened=True)


# Reply ids recorded from the host-side algorithm (before the state moved to the device).
LONG = "the file may be in src or in tests or in docs and I should look at all of them first"
SCRIPT = f"short\n</think>\n\nAnswer <think>\n{LONG}\n</think>\n\ndone."
RECORDED = {
    "a": [82, 310, 81, 1544, 198, 198, 1308, 670, 220, 1543, 198, 83, 326, 1544, 198, 198, 67, 380, 13, 1538],
    "b": [82, 310, 81, 83, 198, 1544, 198, 198, 1308, 670, 220, 1543, 198, 83, 326, 710, 353, 64, 88, 799, 341, 1544]
    + [198, 198, 67, 380, 13, 1538],
    "free": [411, 411, 411, 1544] + [411] * 24,  # cut at its limit: 24 + the budget + the marker
}


@pytest.mark.parametrize("batching", [False, True])
def test_a_host_run_gives_the_recorded_token_ids(batching: bool, tiny_thinking_path: Path) -> None:
    """Three sessions at once on the tiny thinking model (`<think>` 1543, `</think>` 1544; the prompt opens
    the thought): two follow a script that closes its first thought itself, reopens one in its answer and
    is cut there at its budget; one decodes greedily and is cut at 3. Batched, they share mlx-lm's batch."""
    _, tokenizer = mlx_lm.load(str(tiny_thinking_path))
    budgets = {"a": 3, "b": 9, "free": 3}

    async def go() -> tuple[dict[str, list[int]], bool]:
        scripts = ForcedScripts(tokenizer, {"a": [SCRIPT], "b": [SCRIPT]})
        async with MlxModelHost(str(tiny_thinking_path), processor_factory=scripts, batching=batching) as host:
            user = [{"role": "user", "content": "where?"}]
            replies = await asyncio.gather(
                *(
                    host.session(name).generate(user, GenerateArgs(thinking=b, max_tokens=24))
                    for name, b in budgets.items()
                )
            )
            batched = host._scheduler.decode.batch is not None  # made when a turn joins the batch
        return {name: list(r.token_ids) for name, r in zip(budgets, replies, strict=True)}, batched

    ids, batched = asyncio.run(go())
    assert ids == RECORDED
    assert batched == batching
