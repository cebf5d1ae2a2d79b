"""The scheduler's stages hand data back: `Scheduler.step()` returns each turn's outputs of that step
(its prefill begun, its new text with its tokens so far, its reply at its end), the same outputs its
caller's sink receives. Driven step by step on the test's thread, as in test_single.py."""

from __future__ import annotations

from typing import Any

import pytest

from mlx_subagents.host.kv.kv_pool import KVPool, KVShape
from mlx_subagents.host.mlx import outbox as outbox_module
from mlx_subagents.host.mlx.scheduler import Scheduler, SchedulerConfig
from mlx_subagents.host.mlx.turn import OutputSink, Turn, TurnOutput
from tests.host.test_single import forced, make_turn, scheduler
from tests.host.test_stream_text import per_token_text


def test_step_returns_the_outputs_of_the_turns_it_advanced(
    tiny_qwen3: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """a and b decode together: what the steps return, joined per turn, is its prefill begun (tokens to
    compute, tokens cached), the per-token text of its reply, its token count and the reply itself; each
    step returns only turns in flight in it, and the sink got the same outputs."""
    monkeypatch.setattr(outbox_module, "DEFAULT_STREAM_INTERVAL_S", 0.0)  # text every step
    results: dict[str, Any] = {}
    received: dict[str, TurnOutput] = {}
    turns = [make_turn("a", 0, 12, results), make_turn("b", 1, 8, results)]
    for turn in turns:
        collect = turn.sink.receive if turn.sink is not None else None

        def receive(output: TurnOutput, name: str = turn.name, then: Any = collect) -> None:
            received[name] = received[name].then(output) if name in received else output
            then(output)

        turn.sink = OutputSink(None, receive)  # streams: its text and prefill too
    sch = scheduler(tiny_qwen3, factory=forced(tiny_qwen3, "a", "b"))
    returned: dict[str, TurnOutput] = {}
    steps = [sch.submit(turn) for turn in turns]
    while sch.has_work():
        in_flight = {t.name for t in turns if t.name not in results}
        outputs = sch.step()
        assert {t.name for t in outputs} <= in_flight
        for turn, output in outputs.items():
            assert output.text == "" or output.tokens == len(turn.generated) or output.ended
        steps.append(outputs)
    for outputs in steps:
        for turn, output in outputs.items():
            returned[turn.name] = returned[turn.name].then(output) if turn.name in returned else output
    tokenizer = tiny_qwen3[1]
    for turn in turns:
        reply, out = results[turn.name], returned[turn.name]
        assert out.reply is reply and out.error is None
        assert out.text == per_token_text(tokenizer, reply.token_ids) != ""
        assert out.tokens == len(reply.token_ids) == turn.request.max_tokens
        assert out.prefill == (len(turn.ids) - turn.n_cached, turn.n_cached)
        assert received[turn.name] == out


def test_a_turn_that_cannot_start_returns_its_error(tiny_qwen3: tuple[Any, Any]) -> None:
    """A prompt over the context window never waits: `submit` returns the error, one line that says how to fix it."""
    results: dict[str, Any] = {}
    model, tokenizer = tiny_qwen3
    sch = Scheduler(model, tokenizer, SchedulerConfig(context_window=8), KVPool(None), KVShape(0, 0), True)
    turn: Turn = make_turn("a", 0, 8, results)
    outputs = sch.submit(turn)
    error = outputs[turn].error
    assert outputs == {turn: TurnOutput(error=error)} and results["a"] is error
    assert str(error).startswith("the prompt is ") and "raise --context-window" in str(error)
    assert not sch.has_work() and sch.step() == {}
