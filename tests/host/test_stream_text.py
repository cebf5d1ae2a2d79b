"""Streamed text: the same text a per-token detokenizer gives, in one piece per turn per wake-up.

The scheduler queues a turn's tokens and detokenizes them when it hands text to the caller's loop
(`Outbox.flush`), so a caller gets one callback per wake-up however many tokens came in between;
a turn's first text still goes out at the end of the step that made it. Driven step by step on the
test's thread, as in test_single.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mlx_subagents.host.mlx import outbox as outbox_module
from mlx_subagents.host.mlx import scheduler as scheduler_module
from mlx_subagents.host.mlx.turn import OutputSink, Turn, TurnOutput
from mlx_subagents.host.protocol import Reply
from mlx_subagents.testing import ForcedScripts
from tests.host.test_single import SCRIPT, forced, make_turn, run, scheduler

SHORT = "alpha beta gamma"  # then EOS: the turn stops on it


@pytest.fixture(autouse=True)
def no_time_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bursts end by count, not by the clock (a loaded machine would cut them short)."""
    monkeypatch.setattr(scheduler_module, "SINGLE_SLICE_S", 60.0)


def per_token_text(tokenizer: Any, generated: tuple[int, ...]) -> str:
    """What streaming one detokenizer segment per token gives (the end-of-turn token is not text)."""
    detokenizer, text = tokenizer.detokenizer, ""
    for token in generated:
        if token in tokenizer.eos_token_ids:
            break
        detokenizer.add_token(token)
        text += detokenizer.last_segment
    return text


def streaming(turn: Turn, loop: asyncio.AbstractEventLoop, pieces: list[str]) -> Turn:
    then = turn.sink.receive if turn.sink is not None else None

    def receive(output: TurnOutput) -> None:
        if output.prefill is None and (
            output.text or not output.ended
        ):  # its text; a prefill begun or an end says none
            pieces.append(output.text)
        if then is not None:
            then(output)

    turn.sink = OutputSink(loop, receive)
    return turn


def drive(
    tiny: tuple[Any, Any], factory: Any, turns: list[tuple[str, int, int]]
) -> tuple[dict[str, Reply], dict[str, list[str]]]:
    """Run (name, task, max_tokens) turns together, each streaming; the results and the pieces each got."""
    loop = asyncio.new_event_loop()
    try:
        results: dict[str, Reply] = {}
        pieces: dict[str, list[str]] = {name: [] for name, _, _ in turns}
        made = [streaming(make_turn(name, i, n, results), loop, pieces[name]) for name, i, n in turns]
        run(scheduler(tiny, factory=factory), made)
        loop.run_until_complete(asyncio.sleep(0))  # the callbacks the mlx thread queued
    finally:
        loop.close()
    return results, pieces


def test_a_single_turn_streams_its_first_text_at_once_then_the_rest_in_one_piece(
    tiny_qwen3: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no interval elapsing, the only wake-ups are the first text's and the turn's end."""
    monkeypatch.setattr(outbox_module, "DEFAULT_STREAM_INTERVAL_S", 60.0)
    results, pieces = drive(tiny_qwen3, forced(tiny_qwen3, "a"), [("a", 0, 30)])
    text = per_token_text(tiny_qwen3[1], results["a"].token_ids)
    assert len(results["a"].token_ids) == 30
    assert text.startswith(pieces["a"][0])
    assert pieces["a"] == [pieces["a"][0], text[len(pieces["a"][0]) :]]
    assert pieces["a"][0] == per_token_text(tiny_qwen3[1], results["a"].token_ids[:1]) != ""


def test_batched_turns_stream_the_per_token_text_one_piece_per_wake_up(
    tiny_qwen3: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two turns decoding in step from their first token: their first texts go out at once, and then
    the only wake-up before a's end is b's end (a turn's result comes after all streamed text)."""
    monkeypatch.setattr(outbox_module, "DEFAULT_STREAM_INTERVAL_S", 60.0)
    results, pieces = drive(tiny_qwen3, forced(tiny_qwen3, "a", "b"), [("a", 0, 24), ("b", 1, 16)])
    a, b = results["a"].token_ids, results["b"].token_ids
    assert (len(a), len(b)) == (24, 16)

    def cut(generated: tuple[int, ...], *ends: int) -> list[str]:
        texts = [per_token_text(tiny_qwen3[1], generated[:end]) for end in ends]
        return [text[len(before) :] for before, text in zip(["", *texts], texts)]

    assert pieces["b"] == cut(b, 1, 16)
    assert pieces["a"] == cut(a, 1, 16, 24)


def test_every_step_a_wake_up_streams_the_same_text(
    tiny_qwen3: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interval of zero: a piece per turn per step that made text, joined the per-token text."""
    monkeypatch.setattr(outbox_module, "DEFAULT_STREAM_INTERVAL_S", 0.0)
    results, pieces = drive(tiny_qwen3, forced(tiny_qwen3, "a", "b"), [("a", 0, 24), ("b", 1, 16)])
    for name in ("a", "b"):
        assert "".join(pieces[name]) == per_token_text(tiny_qwen3[1], results[name].token_ids)
        assert all(pieces[name])
    assert len(pieces["b"]) > 1


def test_the_end_of_turn_token_is_not_streamed(tiny_qwen3: tuple[Any, Any]) -> None:
    _, tokenizer = tiny_qwen3
    script = ForcedScripts(tokenizer, {"a": [SHORT], "b": [SCRIPT]})
    results, pieces = drive(tiny_qwen3, script, [("a", 0, 40), ("b", 1, 20)])
    generated = results["a"].token_ids
    assert results["a"].finish_reason == "stop"
    assert generated[-1] in tokenizer.eos_token_ids
    assert list(generated[:-1]) == tokenizer.encode(SHORT, add_special_tokens=False)
    assert "".join(pieces["a"]) == per_token_text(tokenizer, generated) == SHORT
