"""A session decoding alone: several tokens per scheduler step, token-identical to mlx-lm.

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
from test_batching import task

from mlx_subagents.host import MlxModelHost
from mlx_subagents.host import scheduler as scheduler_module
from mlx_subagents.host.engine import Engine
from mlx_subagents.host.kv_pool import CacheState, KVPool, KVShape
from mlx_subagents.host.protocol import Generation
from mlx_subagents.host.scheduler import LONE_BURST_TOKENS, Request, Scheduler, SchedulerConfig, Turn
from mlx_subagents.testing import ForcedScripts

SCRIPT = " ".join(f"word{n}" for n in range(60))  # far more tokens than any turn here decodes


@pytest.fixture(autouse=True)
def no_time_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bursts end by count here, not by the clock (a loaded machine would cut them short)."""
    monkeypatch.setattr(scheduler_module, "LONE_SLICE_S", 60.0)


def scheduler(
    tiny: tuple[Any, Any], *, batching: bool = True, factory: Any = None, jobs_waiting: Callable[[], bool] | None = None
) -> Scheduler:
    model, tokenizer = tiny
    config = SchedulerConfig(batching=batching)
    return Scheduler(model, tokenizer, config, KVPool(None), KVShape(0, 0), True, factory, jobs_waiting)


def make_turn(name: str, i: int, max_tokens: int, results: dict[str, Any]) -> Turn:
    def deliver(ok: bool, value: Any) -> None:
        results[name] = value

    request = Request(task(i), None, max_tokens, 0.0)
    return Turn(name, CacheState(), request, threading.Event(), None, deliver)


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


def test_lone_turn_decodes_a_burst_per_step_token_identical_to_serialized_and_stream_generate(
    tiny_qwen3: tuple[Any, Any],
) -> None:
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    results: dict[str, Generation] = {}
    lone = make_turn("a", 0, 20, results)
    held = run(scheduler(tiny_qwen3, factory=forced(tiny_qwen3, "a")), [lone])
    # Prefill: the shared system prompt, then the rest; then 8 + 8 + 4 tokens in three steps.
    assert LONE_BURST_TOKENS == 8
    assert held == [[0], [0], [8], [16], [20]]
    assert results["a"].finish_reason == "length"

    serial: dict[str, Generation] = {}
    serialized = scheduler(tiny_qwen3, batching=False, factory=forced(tiny_qwen3, "a"))
    assert run(serialized, [make_turn("a", 0, 20, serial)]) == []  # the turn ran to its end inside `submit`
    model, tokenizer = tiny_qwen3
    processors = forced(tiny_qwen3, "a")("a", lone.ids)
    reference = [
        r.token
        for r in stream_generate(
            model, tokenizer, lone.ids, max_tokens=20, sampler=make_sampler(temp=0.0), logits_processors=processors
        )
    ]
    assert results["a"].token_ids == serial["a"].token_ids == tuple(reference)
    assert reference == tokenizer.encode(SCRIPT, add_special_tokens=False)[:20]
    # The parked cache holds the prompt and every generated token.
    assert lone.state.token_ids == lone.ids + list(reference)
    assert lone.state.prompt_cache[0].offset == len(lone.ids) + 20


def test_the_time_slice_ends_a_burst(tiny_qwen3: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler_module, "LONE_SLICE_S", 0.0)
    held = run(scheduler(tiny_qwen3, factory=forced(tiny_qwen3, "a")), [make_turn("a", 0, 5, {})])
    assert held == [[0], [0], [1], [2], [3], [4], [5]]


def test_unforced_lone_turn_matches_stream_generate(tiny_qwen3: tuple[Any, Any]) -> None:
    """Greedy sampling from the random model, EOS included: same ids, same end."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = tiny_qwen3
    for i in range(3):
        results: dict[str, Generation] = {}
        turn = make_turn(f"s{i}", i, 40, results)
        run(scheduler(tiny_qwen3), [turn])
        reference = []
        for r in stream_generate(model, tokenizer, turn.ids, max_tokens=40, sampler=make_sampler(temp=0.0)):
            reference.append(r.token)
        assert results[f"s{i}"].token_ids == tuple(reference)


def test_cancel_is_honoured_between_the_tokens_of_a_burst(tiny_qwen3: tuple[Any, Any]) -> None:
    """Cancelled as its 11th token comes out (mid-burst), the turn ends with exactly 11 tokens."""
    results: dict[str, Generation] = {}
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


def test_a_queued_engine_job_ends_the_burst(tiny_qwen3: tuple[Any, Any]) -> None:
    """The engine says a job waits after the 5th token: the burst stops there, the next one goes on."""
    queued = threading.Event()
    results: dict[str, Generation] = {}
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
    """b arrives after a's first burst: a goes one token per step while b prefills, then both in the batch."""
    results: dict[str, Generation] = {}
    a, b = make_turn("a", 0, 30, results), make_turn("b", 1, 12, results)
    sch = scheduler(tiny_qwen3, factory=forced(tiny_qwen3, "a", "b"))

    def arrive(n: int) -> None:
        if n == 3:
            sch.submit(b)

    held = run(sch, [a], arrive, watch=[a, b])
    # Step 4: b is admitted, a decodes one token and hands the next over; then one token per step for
    # each in the batch (mlx-lm's: b's prompt first, its first token a step after a's next one); b
    # ends (a at 23), and a, alone again, decodes its last 7 tokens in the same step, one burst.
    assert held[:6] == [[0, 0], [0, 0], [8, 0], [10, 0], [10, 0], [11, 0]]
    assert held[6:] == [[11 + n, n] for n in range(1, 12)] + [[30, 12]]
    serial: dict[str, Generation] = {}
    alone = scheduler(tiny_qwen3, batching=False, factory=forced(tiny_qwen3, "a", "b"))
    run(alone, [make_turn("a", 0, 30, serial), make_turn("b", 1, 12, serial)])
    assert results["a"].token_ids == serial["a"].token_ids
    assert results["b"].token_ids == serial["b"].token_ids


# -- the engine survives a step that raises -------------------------------------------------------


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


def test_a_raising_step_fails_the_turns_in_flight_and_the_engine_lives_on(tiny_qwen3_path: Path) -> None:
    async def go() -> tuple[Any, Any, tuple[int, ...]]:
        async with MlxModelHost(str(tiny_qwen3_path), share_prefix=False) as host:
            host._engine.stepper = RaisingOnce(host._scheduler, at=3)
            failed = await asyncio.gather(
                *(host.session(f"s{i}").generate(task(i), max_tokens=8) for i in range(2)), return_exceptions=True
            )
            alive = host._engine._thread.is_alive()
            again = await host.session("s0").generate(task(0), max_tokens=8)
            return failed, (alive, again.usage.cached_tokens), again.token_ids

    async def reference() -> tuple[int, ...]:
        async with MlxModelHost(str(tiny_qwen3_path), batching=False, share_prefix=False) as host:
            return (await host.session("s0").generate(task(0), max_tokens=8)).token_ids

    failed, (alive, cached), again = asyncio.run(go())
    assert [type(f) for f in failed] == [RuntimeError, RuntimeError]
    assert [str(f) for f in failed] == ["a step failed"] * 2
    assert alive
    assert cached == 0  # the failed session starts over from an empty cache
    assert again == asyncio.run(reference())


def test_the_engine_runs_jobs_after_a_step_raised() -> None:
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
        engine = Engine()
        engine.start()
        flaky = Flaky()
        try:
            engine.stepper = flaky
            await engine.run(lambda: None)  # wakes the engine: it steps until the stepper has no work
            while flaky.has_work():
                await asyncio.sleep(0.01)
            return await engine.run(lambda: "still here"), flaky
        finally:
            engine.stop()

    answer, flaky = asyncio.run(go())
    assert answer == "still here"
    assert (flaky.calls, flaky.left, flaky.failed) == (2, 0, ["step 2 broke"])
