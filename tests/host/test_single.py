"""A single session: several tokens per scheduler step on the single-sequence path, token-identical to mlx-lm.

The scheduler is driven here step by step on the test's thread (where the tiny model was loaded), so
what each step does is counted exactly: the tokens each turn holds after every `step()`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.host import GenerateArgs, MlxModelHost
from mlx_subagents.host.kv.kv_pool import CacheState, KVPool, KVShape
from mlx_subagents.host.mlx import scheduler as scheduler_module
from mlx_subagents.host.mlx.mlx_thread import MlxThread
from mlx_subagents.host.mlx.prefill import SlicePolicy
from mlx_subagents.host.mlx.scheduler import SINGLE_BURST_TOKENS, Scheduler, SchedulerConfig
from mlx_subagents.host.mlx.single import SingleStream, take_from_batch
from mlx_subagents.host.mlx.turn import OutputSink, Request, Turn, TurnOutput
from mlx_subagents.host.protocol import Reply
from mlx_subagents.testing import ForcedScripts
from tests.host.test_batching import task

SCRIPT = " ".join(f"word{n}" for n in range(60))  # far more tokens than any turn here decodes


@pytest.fixture(autouse=True)
def no_time_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bursts end by count here, not by the clock (a loaded machine would cut them short); and a
    prompt prefilled while others decode gets a slice every step, each decoder one token between
    slices (the decoders' share of the time, also a clock's, is tested in test_prefill.py)."""
    monkeypatch.setattr(scheduler_module, "SINGLE_SLICE_S", 60.0)
    monkeypatch.setattr(SlicePolicy, "sliced", lambda self, seconds, decoding: None)


def scheduler(
    tiny: tuple[Any, Any],
    *,
    batching: bool = True,
    factory: Any = None,
    jobs_waiting: Callable[[], bool] | None = None,
    prefill_slice: int | str = 16,
) -> Scheduler:
    model, tokenizer = tiny
    config = SchedulerConfig(batching=batching, prefill_slice=prefill_slice)
    return Scheduler(model, tokenizer, config, KVPool(None), KVShape(0, 0), True, factory, jobs_waiting)


def make_turn(name: str, i: int, max_tokens: int, results: dict[str, Any]) -> Turn:
    def deliver(output: TurnOutput) -> None:
        if output.ended:
            results[name] = output.reply if output.error is None else output.error

    request = Request(task(i), None, max_tokens, 0.0)
    return Turn(name, CacheState(), request, threading.Event(), OutputSink(None, deliver, streams=False))


def run(
    sch: Scheduler, turns: list[Turn], on_step: Callable[[int], None] = lambda n: None, watch: list[Turn] | None = None
) -> list[list[int]]:
    """Submit `turns`, step until done (`on_step(n)` after step n); the tokens each turn of `watch`
    (default: `turns`) holds after every step."""
    for turn in turns:
        sch.submit(turn)
    held: list[list[int]] = []
    while sch.has_work():
        sch.step()
        held.append([len(t.generated) for t in watch or turns])
        on_step(len(held))
    return held


def forced(tiny: tuple[Any, Any], *names: str) -> ForcedScripts:
    return ForcedScripts(tiny[1], {name: [SCRIPT] for name in names})


def stream_generate_ids(tiny: tuple[Any, Any], name: str, prompt: list[int], max_tokens: int) -> tuple[int, ...]:
    """`mlx_lm.stream_generate` on the same prompt, greedy, forced by the same script."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = tiny
    processors = forced(tiny, name)(name, prompt)
    sampler = make_sampler(temp=0.0)
    replies = stream_generate(model, tokenizer, prompt, max_tokens, sampler=sampler, logits_processors=processors)
    return tuple(r.token for r in replies)


def assert_holds_exactly(turn: Turn, generated: tuple[int, ...]) -> None:
    """The parked cache holds the prompt and every generated token, no more, in every layer."""
    from mlx_lm.models.cache import KVCache

    assert turn.state.token_ids == turn.ids + list(generated)
    offsets = [c.offset for c in turn.state.prompt_cache if isinstance(c, KVCache)]  # a hybrid's attention layers
    assert offsets and set(offsets) == {len(turn.ids) + len(generated)}


def test_single_turn_decodes_a_burst_per_step_token_identical_to_serialized_and_stream_generate(
    tiny_qwen3: tuple[Any, Any],
) -> None:
    results: dict[str, Reply] = {}
    single = make_turn("a", 0, 20, results)
    sch = scheduler(tiny_qwen3, factory=forced(tiny_qwen3, "a"))
    held = run(sch, [single])
    # Prefill: the shared system prompt, then the rest; then 8 + 8 + 4 tokens in three steps.
    assert SINGLE_BURST_TOKENS == 8
    assert held == [[0], [0], [8], [16], [20]]
    assert results["a"].finish_reason == "length"
    assert sch.decode.most_decoding == 1  # one decoded, on its own (`serve --status`: "at most 1 decoding")

    serial: dict[str, Reply] = {}
    serialized = scheduler(tiny_qwen3, batching=False, factory=forced(tiny_qwen3, "a"))
    assert run(serialized, [make_turn("a", 0, 20, serial)]) == []  # the turn ran to its end inside `submit`
    reference = stream_generate_ids(tiny_qwen3, "a", single.ids, 20)
    assert results["a"].token_ids == serial["a"].token_ids == reference
    assert list(reference) == tiny_qwen3[1].encode(SCRIPT, add_special_tokens=False)[:20]
    assert_holds_exactly(single, reference)


def test_the_time_slice_ends_a_burst(tiny_qwen3: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler_module, "SINGLE_SLICE_S", 0.0)
    held = run(scheduler(tiny_qwen3, factory=forced(tiny_qwen3, "a")), [make_turn("a", 0, 5, {})])
    assert held == [[0], [0], [1], [2], [3], [4], [5]]


@pytest.mark.slow
def test_unforced_single_turn_matches_stream_generate(tiny_qwen3: tuple[Any, Any]) -> None:
    """Greedy sampling from the random model, EOS included: same ids, same end."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = tiny_qwen3
    for i in range(3):
        results: dict[str, Reply] = {}
        turn = make_turn(f"s{i}", i, 40, results)
        run(scheduler(tiny_qwen3), [turn])
        reference = []
        for r in stream_generate(model, tokenizer, turn.ids, max_tokens=40, sampler=make_sampler(temp=0.0)):
            reference.append(r.token)
        assert results[f"s{i}"].token_ids == tuple(reference)


def test_cancel_is_honoured_between_the_tokens_of_a_burst(tiny_qwen3: tuple[Any, Any]) -> None:
    """Cancelled as its 11th token comes out (mid-burst), the turn ends with exactly 11 tokens."""
    results: dict[str, Reply] = {}
    turn = make_turn("a", 0, 40, results)
    script = forced(tiny_qwen3, "a")

    def factory(name: str, prompt_ids: list[int]) -> list[Any]:
        def cancel_at_11(tokens: Any, logits: Any) -> Any:
            if len(tokens) == len(prompt_ids) + 11:  # token 11 is fed: it is the one `next()` returns
                turn.cancel.set()
            return logits

        return [*script(name, prompt_ids), cancel_at_11]

    held = run(scheduler(tiny_qwen3, factory=factory), [turn])
    assert held == [[0], [0], [8], [11], [11]]
    assert results["a"].finish_reason == "cancelled"
    assert len(results["a"].token_ids) == 11
    assert turn.state.token_ids == turn.ids + list(results["a"].token_ids)


def test_a_queued_job_ends_the_burst(tiny_qwen3: tuple[Any, Any]) -> None:
    """The mlx thread says a job waits after the 5th token: the burst stops there, the next one goes on."""
    queued = threading.Event()
    results: dict[str, Reply] = {}
    turn = make_turn("a", 0, 24, results)
    script = forced(tiny_qwen3, "a")

    def factory(name: str, prompt_ids: list[int]) -> list[Any]:
        def job_at_5(tokens: Any, logits: Any) -> Any:
            if len(tokens) == len(prompt_ids) + 5:
                queued.set()
            return logits

        return [*script(name, prompt_ids), job_at_5]

    held = run(scheduler(tiny_qwen3, factory=factory, jobs_waiting=queued.is_set), [turn], lambda n: queued.clear())
    assert held == [[0], [0], [5], [13], [21], [24]]
    assert results["a"].token_ids == tuple(tiny_qwen3[1].encode(SCRIPT, add_special_tokens=False)[:24])


def test_a_second_turn_ends_the_bursts_and_both_match_serialized(tiny_qwen3: tuple[Any, Any]) -> None:
    """With slicing off, b arrives after a's first burst: a goes one token per step while b prefills, then
    both in the batch."""
    results: dict[str, Reply] = {}
    a, b = make_turn("a", 0, 30, results), make_turn("b", 1, 12, results)
    sch = scheduler(tiny_qwen3, factory=forced(tiny_qwen3, "a", "b"), prefill_slice="off")

    def arrive(n: int) -> None:
        if n == 3:
            sch.submit(b)

    held = run(sch, [a], arrive, watch=[a, b])
    assert sch.decode.most_decoding == 2
    # Step 4: b is admitted, a decodes one token and hands the next over; then one token per step for
    # each in the batch (mlx-lm's: b's prompt first, its first token a step after a's next one); b
    # ends (a at 23), and a, single again, decodes its last 7 tokens in the same step, one burst.
    assert held[:6] == [[0, 0], [0, 0], [8, 0], [10, 0], [10, 0], [11, 0]]
    assert held[6:] == [[11 + n, n] for n in range(1, 12)] + [[30, 12]]
    serial: dict[str, Reply] = {}
    serialized = scheduler(tiny_qwen3, batching=False, factory=forced(tiny_qwen3, "a", "b"))
    run(serialized, [make_turn("a", 0, 30, serial), make_turn("b", 1, 12, serial)])
    assert results["a"].token_ids == serial["a"].token_ids
    assert results["b"].token_ids == serial["b"].token_ids


# -- the mlx thread survives a step that raises ---------------------------------------------------


class RaisingOnce:
    """The host's scheduler, except that its `at`-th step raises before doing anything."""

    def __init__(self, inner: Scheduler, at: int) -> None:
        self.inner, self.at, self.steps = inner, at, 0

    def has_work(self) -> bool:
        return self.inner.has_work()

    def step(self) -> None:
        self.steps += 1
        if self.steps == self.at:
            raise RuntimeError("a step failed")
        self.inner.step()

    def fail_all(self, exc: BaseException) -> None:
        self.inner.fail_all(exc)


def test_a_raising_step_fails_the_turns_in_flight_and_the_mlx_thread_lives_on(tiny_qwen3_path: Path) -> None:
    async def go() -> tuple[Any, Any, tuple[int, ...]]:
        async with MlxModelHost(str(tiny_qwen3_path), share_prefix=False) as host:
            host._mlx.stepper = RaisingOnce(host._scheduler, at=3)
            failed = await asyncio.gather(
                *(host.session(f"s{i}").generate(task(i), GenerateArgs(max_tokens=8)) for i in range(2)),
                return_exceptions=True,
            )
            alive = host._mlx._thread.is_alive()
            again = await host.session("s0").generate(task(0), GenerateArgs(max_tokens=8))
            return failed, (alive, again.usage.cached_tokens), again.token_ids

    async def reference() -> tuple[int, ...]:
        async with MlxModelHost(str(tiny_qwen3_path), batching=False, share_prefix=False) as host:
            return (await host.session("s0").generate(task(0), GenerateArgs(max_tokens=8))).token_ids

    failed, (alive, cached), again = asyncio.run(go())
    assert [type(f) for f in failed] == [RuntimeError, RuntimeError]
    assert [str(f) for f in failed] == ["a step failed"] * 2
    assert alive
    assert cached == 0  # the failed session starts over from an empty cache
    assert again == asyncio.run(reference())


def test_a_bug_in_a_serialized_step_fails_every_turn_inside_submit(tiny_qwen3: tuple[Any, Any]) -> None:
    """Serialized, `submit` steps the turn itself (the mlx thread does not see those steps): a step that
    raises outside any one turn fails it there and leaves nothing behind."""
    results: dict[str, Reply] = {}
    sch = scheduler(tiny_qwen3, batching=False)
    turn = make_turn("a", 0, 8, results)

    def broken() -> None:
        raise RuntimeError("a bug")

    sch._observe = broken  # type: ignore[method-assign]
    sch.submit(turn)
    assert isinstance(results["a"], RuntimeError) and str(results["a"]) == "a bug"
    assert not sch.has_work()
    assert (turn.state.prompt_cache, turn.state.token_ids) == (None, [])


def test_the_mlx_thread_runs_jobs_after_a_step_raised() -> None:
    """A stepper of plain Python (no mlx): the failing step's work is failed once, jobs keep running."""

    class Flaky:
        def __init__(self) -> None:
            self.left, self.calls, self.failed = 3, 0, []

        def has_work(self) -> bool:
            return self.left > 0

        def step(self) -> None:
            self.calls += 1
            if self.calls == 2:
                raise ValueError("step 2 broke")
            self.left -= 1

        def fail_all(self, exc: BaseException) -> None:
            self.failed.append(str(exc))
            self.left = 0

    async def go() -> tuple[str, Flaky]:
        thread = MlxThread()
        thread.start()
        flaky = Flaky()
        try:
            thread.stepper = flaky
            await thread.run(lambda: None)  # wakes the thread: it steps until the stepper has no work
            while flaky.has_work():
                await asyncio.sleep(0.01)
            return await thread.run(lambda: "still here"), flaky
        finally:
            thread.stop()

    answer, flaky = asyncio.run(go())
    assert answer == "still here"
    assert (flaky.calls, flaky.left, flaky.failed) == (2, 0, ["step 2 broke"])


# -- the last turn left in the batch goes on as the single turn -----------------------------------


def where(sch: Scheduler, turn: Turn) -> str:
    """Which path decodes `turn` now: "single" (single-sequence), "batch", or "-" (neither)."""
    return "single" if sch.decode.single is turn else "batch" if turn in sch.decode.decoding.values() else "-"


def follow_up(turn: Turn, reply: Reply, results: dict[str, Any]) -> Turn:
    """The session's next turn: its reply and a new user message, on the same cache state."""
    messages = [*turn.request.messages, reply.to_message(), {"role": "user", "content": "Go on."}]

    def deliver(output: TurnOutput) -> None:
        if output.ended:
            results[turn.name + "2"] = output.reply if output.error is None else output.error

    return Turn(
        turn.name,
        turn.state,
        Request(messages, None, 12, 0.0),
        threading.Event(),
        OutputSink(None, deliver, streams=False),
    )


def straggler_run(
    tiny: tuple[Any, Any], lengths: dict[str, int], on_step: Callable[[Scheduler, int, str], None] = lambda *_: None
) -> tuple[Scheduler, dict[str, Reply], list[Turn], list[list[int]], list[str]]:
    """Turns of `lengths` (name -> max_tokens) started together, the first the longest: the tokens
    each holds after every step, and the first one's path after every step (`on_step(sch, n, path)`
    after step n)."""
    results: dict[str, Reply] = {}
    turns = [make_turn(name, i, n, results) for i, (name, n) in enumerate(lengths.items())]
    sch = scheduler(tiny, factory=forced(tiny, *lengths))
    paths: list[str] = []

    def record(n: int) -> None:
        paths.append(where(sch, turns[0]))
        on_step(sch, n, paths[-1])

    held = run(sch, turns, record)
    return sch, results, turns, held, paths


def follow_ups(sch: Scheduler, turns: list[Turn], results: dict[str, Reply]) -> None:
    """Each session's next turn, all started together: `results` gets them as "a2", "b2"..."""
    run(sch, [follow_up(t, results[t.name], results) for t in turns])


def serialized_run(tiny: tuple[Any, Any], lengths: dict[str, int]) -> dict[str, Reply]:
    """The same turns and follow-ups on the serialized scheduler: the reference."""
    results: dict[str, Reply] = {}
    sch = scheduler(tiny, batching=False, factory=forced(tiny, *lengths))
    turns = [make_turn(name, i, n, results) for i, (name, n) in enumerate(lengths.items())]
    run(sch, turns)
    follow_ups(sch, turns, results)
    return results


def ids_of(results: dict[str, Reply]) -> dict[str, tuple[int, ...]]:
    return {name: r.token_ids for name, r in sorted(results.items())}


@pytest.mark.slow
def test_the_last_turn_in_the_batch_goes_on_single_token_identical(tiny_qwen3: tuple[Any, Any]) -> None:
    """a (40 tokens) and b (10) start together; once b ends, a's remaining 30 come 8 per step from the
    single-sequence path, the same ids as serialized and as `stream_generate`, its cache reused whole."""
    lengths = {"a": 40, "b": 10}
    sch, results, (a, b), held, paths = straggler_run(tiny_qwen3, lengths)
    # The shared prefix, then both prompts' rest as one padded batch, and into mlx-lm's batch in that
    # step; their first tokens a step later; one token each per step in the batch.
    assert held[:12] == [[0, 0], [0, 0], [0, 0]] + [[n, n] for n in range(1, 10)]
    assert paths[:12] == ["-"] + ["batch"] * 11
    # b's last token: a moves out of the batch and decodes a burst in the same step.
    assert held[12:] == [[18, 10], [26, 10], [34, 10], [40, 10]]
    assert paths[12:] == ["single", "single", "single", "-"]
    assert sch.decode.decoding == {} and sch.decode.single is None
    assert results["a"].finish_reason == "length" and results["b"].finish_reason == "length"
    assert results["a"].token_ids == stream_generate_ids(tiny_qwen3, "a", a.ids, 40)
    assert_holds_exactly(a, results["a"].token_ids)
    assert_holds_exactly(b, results["b"].token_ids)
    # The next turn reuses all of it: prompt + 40 generated tokens (and b's prompt + 10).
    follow_ups(sch, [a, b], results)
    assert [results[n].usage.cached_tokens for n in ("a2", "b2")] == [len(a.ids) + 40, len(b.ids) + 10]
    serial = serialized_run(tiny_qwen3, lengths)
    assert ids_of(results) == ids_of(serial)
    assert [serial[n].usage.cached_tokens for n in ("a2", "b2")] == [len(a.ids) + 40, len(b.ids) + 10]


@pytest.mark.slow
def test_a_hybrid_straggler_goes_on_single_too(tiny_qwen35: tuple[Any, Any]) -> None:
    """qwen3_5: gated-delta state (`ArraysCache`) and attention layers leave the batch together."""
    lengths = {"a": 30, "b": 6}
    sch, results, (a, b), held, paths = straggler_run(tiny_qwen35, lengths)
    assert held[3:] == [[n, n] for n in range(1, 6)] + [[14, 6], [22, 6], [30, 6]]
    assert paths[3:] == ["batch"] * 5 + ["single", "single", "-"]
    assert results["a"].token_ids == stream_generate_ids(tiny_qwen35, "a", a.ids, 30)
    assert_holds_exactly(a, results["a"].token_ids)
    follow_ups(sch, [a, b], results)
    assert results["a2"].usage.cached_tokens == len(a.ids) + 30  # the whole cache: a hybrid's cannot be cut back
    serial = serialized_run(tiny_qwen35, lengths)
    assert ids_of(results) == ids_of(serial)
    assert serial["a2"].usage.cached_tokens == len(a.ids) + 30


def test_a_queued_job_keeps_the_last_turn_in_the_batch_for_that_step(tiny_qwen3: tuple[Any, Any]) -> None:
    """The job may be a new turn that would bring it straight back: it moves a step later instead."""
    queued = threading.Event()
    results: dict[str, Reply] = {}
    a, b = make_turn("a", 0, 40, results), make_turn("b", 1, 10, results)
    sch = scheduler(tiny_qwen3, factory=forced(tiny_qwen3, "a", "b"), jobs_waiting=queued.is_set)
    paths: list[str] = []

    def step_done(n: int) -> None:
        paths.append(where(sch, a))
        queued.set() if n == 12 else queued.clear()

    held = run(sch, [a, b], step_done)
    assert held[11:] == [[9, 9], [10, 10], [19, 10], [27, 10], [35, 10], [40, 10]]
    assert paths[11:] == ["batch", "batch", "single", "single", "single", "-"]
    assert results["a"].token_ids == stream_generate_ids(tiny_qwen3, "a", a.ids, 40)


def test_cancel_right_after_the_move(tiny_qwen3: tuple[Any, Any]) -> None:
    """Cancelled while the batch computes a's 11th token (in b's last step): a moves out, that token
    comes out of the single path, and the cancel ends a there with a cache of exactly what it holds."""
    results: dict[str, Reply] = {}
    a, b = make_turn("a", 0, 40, results), make_turn("b", 1, 10, results)
    script = forced(tiny_qwen3, "a", "b")

    def factory(name: str, prompt_ids: list[int]) -> list[Any]:
        def cancel_at_11(tokens: Any, logits: Any) -> Any:
            if name == "a" and len(tokens) == len(prompt_ids) + 10:  # token 10 fed: the 11th is computed
                a.cancel.set()
            return logits

        return [*script(name, prompt_ids), cancel_at_11]

    sch = scheduler(tiny_qwen3, factory=factory)
    paths: list[str] = []
    held = run(sch, [a, b], lambda n: paths.append(where(sch, a)))
    assert held[11:] == [[9, 9], [11, 10], [11, 10]]
    assert paths[11:] == ["batch", "single", "-"]
    assert results["a"].finish_reason == "cancelled"
    assert results["a"].token_ids == stream_generate_ids(tiny_qwen3, "a", a.ids, 11)
    assert_holds_exactly(a, results["a"].token_ids)
    follow_ups(sch, [a], results)
    assert results["a2"].usage.cached_tokens == len(a.ids) + 11


@pytest.mark.slow
def test_a_turn_arriving_right_after_the_move_brings_it_back_into_the_batch(tiny_qwen3: tuple[Any, Any]) -> None:
    """c arrives in the step after a went single: a returns to the batch while c decodes and goes
    single again when c ends; all three as serialized."""
    lengths = {"a": 60, "b": 10, "c": 6}
    results: dict[str, Reply] = {}
    a, b, c = (make_turn(name, i, n, results) for i, (name, n) in enumerate(lengths.items()))
    sch = scheduler(tiny_qwen3, factory=forced(tiny_qwen3, *lengths))
    paths: list[str] = []

    def arrive(n: int) -> None:
        paths.append(where(sch, a))
        if n == 13:
            sch.submit(c)

    held = run(sch, [a, b], arrive, watch=[a, b, c])
    assert held[11:13] == [[9, 9, 0], [18, 10, 0]] and paths[11:13] == ["batch", "single"]  # b ends, a single
    # c is admitted: a decodes a token, c's short prompt is prefilled at once, in one slice, and a hands
    # its next token over: both go into the batch, their tokens a step later.
    assert held[13:15] == [[20, 10, 0], [20, 10, 0]] and paths[13:15] == ["batch", "batch"]
    assert held[15:20] == [[20 + n, 10, n] for n in range(1, 6)] and paths[15:20] == ["batch"] * 5
    # c ends (a at 25): a goes single again, a burst in the same step.
    assert held[20:] == [[34, 10, 6], [42, 10, 6], [50, 10, 6], [58, 10, 6], [60, 10, 6]]
    assert paths[20:] == ["single"] * 4 + ["-"]
    serial = serialized_run(tiny_qwen3, lengths)
    assert ids_of(results) == {name: serial[name].token_ids for name in lengths}
    assert_holds_exactly(a, results["a"].token_ids)


def sliding_window_model() -> Any:
    """A tiny random gemma3 text model: every other layer a sliding window of 16 (`RotatingKVCache`)."""
    import mlx.core as mx
    from mlx_lm.models import gemma3_text

    mx.random.seed(0)
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=300,
        num_key_value_heads=2,
        sliding_window=16,
        sliding_window_pattern=2,
    )
    model = gemma3_text.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.mark.slow
@pytest.mark.parametrize(("lengths", "short"), [((40, 5), 3), ((5, 40), 3), ((12, 30), 20)])
def test_take_from_batch_continues_token_identically_on_sliding_window_layers(
    lengths: tuple[int, int], short: int
) -> None:
    """Prompts of different lengths (left padding), windows already rotated or not: the first
    sequence, taken out of the batch once the second ends, goes on as it would have in the batch."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import KVCache, RotatingKVCache
    from mlx_lm.sample_utils import make_sampler

    model = sliding_window_model()
    prompts = [[(7 * i + 3 * n) % 299 + 1 for i in range(n)] for n in lengths]

    def decode(move: bool) -> tuple[list[int], list[Any]]:
        batch = BatchGenerator(model, stop_tokens=[])
        first, second = batch.insert(prompts, max_tokens=[60, short])
        out: dict[int, list[int]] = {first: [], second: []}
        while len(out[second]) < short or (not move and len(out[first]) < 60):
            for r in batch.next_generated():
                out[r.uid].append(r.token)
        if not move:
            return out[first], []
        taken = take_from_batch(batch, first)
        assert taken is not None
        cache, held, pending = taken
        assert held == prompts[0] + out[first]
        stream = SingleStream(model, cache, held, make_sampler(temp=0.0), [], pending)
        out[first] += [stream.next() for _ in range(60 - len(out[first]))]
        return out[first], cache

    stayed, _ = decode(move=False)
    moved, cache = decode(move=True)
    assert moved == stayed
    assert len(set(stayed)) > 20  # the random model does not just repeat itself
    assert [type(c) for c in cache] == [RotatingKVCache, KVCache] * 2
    assert {c.offset for c in cache} == {lengths[0] + 60}
