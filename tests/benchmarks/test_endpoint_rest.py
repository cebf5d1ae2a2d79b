"""`endpoint.py`'s split of a later turn's time to first token: the tokens a reply decoded before its first
streamed text (each a decode step the client waits for, such as a leading newline a server strips), told
from the usage and the text, and the rest less those steps."""

from __future__ import annotations

from pathlib import Path

from benchmarks.endpoint import Prefill, rest_parts


def test_the_tokens_before_the_first_text_are_the_generated_ones_the_streamed_text_lacks(tiny_qwen3_path: Path) -> None:
    prefill = Prefill(str(tiny_qwen3_path))
    text = "Question 3: Update service session line path read read"
    n_text = len(prefill.tokenizer.encode(text, add_special_tokens=False))

    def done(generated: int, finish: str = "length", calls: bool = False) -> dict:
        reply = {"role": "assistant", "content": text, **({"tool_calls": [{"id": "c"}]} if calls else {})}
        return {"generated": generated, "finish": finish, "reply": reply}

    assert prefill.unseen(done(n_text + 1)) == 1  # a "\n" stripped before the answer
    assert prefill.unseen(done(n_text)) == 0
    assert prefill.unseen(done(n_text + 1, finish="stop")) is None  # an end token may be counted
    assert prefill.unseen(done(n_text + 1, calls=True)) is None


def test_the_rest_less_the_steps_before_the_first_text_is_what_is_left_of_it() -> None:
    rows = [
        {"ttft": 5.0, "prefill": 4.0, "unseen": 1, "step": 0.3},
        {"ttft": 7.0, "prefill": 6.5, "unseen": 0, "step": 0.2},
        {"ttft": 9.0, "prefill": 8.0, "unseen": None, "step": 0.2},  # a call: left out
    ]
    assert rest_parts(rows) == {"unseen_later": 0.5, "step_later_s": 0.25, "other_later_s": 0.6}
    assert rest_parts(rows[2:]) == {}
