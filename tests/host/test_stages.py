"""The scheduler's stages hand data back: `Scheduler.step()` returns each turn's outputs of that step
(its prefill begun, its new text with its tokens so far, its reply at its end), the same outputs its
caller's sink receives. Driven step by step on the test's thread, as in test_single.py."""

from __future__ import annotations

import ast
from pathlib import Path
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
        assert out.prefill == (len(turn.ids) - turn.prefill.n_cached, turn.prefill.n_cached)
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


def test_a_turn_in_each_stage_has_that_stages_state(tiny_qwen3: tuple[Any, Any]) -> None:
    """a decodes while b (a long prompt, prefilled in slices) and c arrive: after every step, a waiting
    turn has neither a prefill nor a decode state, a prefilling one its prefill state only, a decoding
    one its decode state with the cache handed over (its prefill state keeps none), an ended one no
    cache in either; each turn goes through the stages in order, b (long) seen in every one."""
    results: dict[str, Any] = {}
    sch = scheduler(tiny_qwen3, factory=forced(tiny_qwen3, "a", "b", "c"))
    a, b, c = make_turn("a", 0, 40, results), make_turn("b", 1, 4, results), make_turn("c", 2, 4, results)
    b.request.messages[-1]["content"] += " Context: " + "lorem ipsum dolor sit amet " * 60
    seen: dict[str, list[str]] = {"a": [], "b": [], "c": []}

    def check() -> None:
        for turn in (a, b, c):
            stage = sch.stage_of(turn)
            if turn.name in results or turn in sch.waiting or stage != "ended":
                if not seen[turn.name] or seen[turn.name][-1] != stage:
                    seen[turn.name].append(stage)
            prefill, decode = turn.prefill, turn.decode
            if stage == "waiting":
                assert prefill is None and decode is None
            elif stage == "prefilling":
                assert prefill is not None and decode is None
            elif stage == "decoding":
                assert decode is not None and prefill is not None and (prefill.cache, prefill.shared) == (None, None)
            elif decode is not None:
                assert (decode.cache, decode.shared) == (None, None) and turn.name in results

    sch.submit(a)
    check()
    while not a.generated:
        sch.step()
        check()
    sch.submit(b)
    sch.submit(c)
    check()
    while sch.has_work():
        sch.step()
        check()
    order = ["waiting", "prefilling", "decoding", "ended"]
    assert seen["a"] == seen["b"] == order  # c, short, may be prefilled within the step that admits it
    assert all(stages == sorted(stages, key=order.index) and stages[-1] == "ended" for stages in seen.values())
    assert [len(results[n].token_ids) for n in "abc"] == [40, 4, 4]


def _part_written(target: ast.expr, parts: set[str]) -> str | None:
    """The part of a turn an assignment to `target` writes: `turn.prefill = ...`, `turn.prefill.pos = ...`
    or, through a local name for it, `prefill.cache = ...` (a stage's own `self.prefill` is not a turn's)."""

    def part(node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return node.id if node.id in parts else None
        if isinstance(node, ast.Attribute) and node.attr in parts:
            return None if isinstance(node.value, ast.Name) and node.value.id == "self" else node.attr
        return None

    if isinstance(target, ast.Attribute):
        return (None if isinstance(target.value, ast.Name) and target.value.id == "self" else part(target)) or part(
            target.value
        )
    return None


def test_each_part_of_a_turn_is_written_by_one_stage() -> None:
    """No field of a turn is written by two stages: in the host's mlx room, the prefill state is made and
    its fields assigned (or appended to, popped) only in the prefill stage and its groups, the decode
    state only in the decode stage, the outbox state only in the outbox."""
    import mlx_subagents.host.mlx as room

    owners = {"prefill": {"prefill_stage.py", "prefill.py"}, "decode": {"decode_stage.py"}, "out": {"outbox.py"}}
    writers: dict[str, set[str]] = {part: set() for part in owners}
    for path in Path(room.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = [
                    t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])
                ]
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("append", "pop")
            ):
                targets = [node.func.value]
            for target in targets:
                if (part := _part_written(target, set(owners))) is not None:
                    writers[part].add(path.name)
    assert writers == owners
