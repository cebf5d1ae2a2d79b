"""Thinking budgets: a thought that runs past its budget is closed, and the model answers.

One logits processor per request watches the tokens it is shown: it notices the
thought opening (in the prompt, as Qwen3.5's template does, or in the reply), counts
its tokens, and once the budget is spent forces the end marker's token(s), one per
step. Being a logits processor, it works the same in the batched and the serialized
decode path; the scheduler's loop is not touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# The generation prompt that opens a thought is short (`<|im_start|>assistant\n<think>\n`).
_PROMPT_TAIL = 32


class ThoughtBudget:
    """Forces `end` once `budget` tokens were thought; serves one request (like every processor).

    Both decode paths pass the context plus the tokens generated so far, so the first call
    sees the prompt and each later call one new token.
    """

    def __init__(self, budget: int, start: Sequence[int], end: Sequence[int], opened: bool) -> None:
        self.budget = max(0, budget)
        self.start, self.end = tuple(start), tuple(end)
        self.thinking = opened
        self.spent = 0
        self._forced = 0  # end-marker tokens emitted so far while forcing
        self._seen: int | None = None
        self._tail: list[int] = []

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx

        n = len(tokens)
        if self._seen is not None and n > self._seen:
            for token in tokens[self._seen :].tolist():
                self._advance(int(token))
        self._seen = n
        if not (self.thinking and self.spent >= self.budget):
            return logits
        keep = mx.arange(logits.shape[-1]) == self.end[self._forced]
        # A fresh mask, not on top of `logits`: it must win over processors that ran before it.
        forced = mx.where(keep, mx.array(0.0, dtype=logits.dtype), mx.array(-mx.inf, dtype=logits.dtype))
        return mx.broadcast_to(forced, logits.shape)

    def _advance(self, token: int) -> None:
        self._tail = [*self._tail, token][-max(len(self.start), len(self.end)) :]
        if not self.thinking:
            if _ends_with(self._tail, self.start):
                self.thinking, self.spent, self._forced = True, 0, 0
            return
        self.spent += 1
        if self.spent > self.budget and self._forced < len(self.end) and token == self.end[self._forced]:
            self._forced += 1
        if _ends_with(self._tail, self.end):
            self.thinking, self._forced = False, 0


def _ends_with(tail: list[int], marker: tuple[int, ...]) -> bool:
    return bool(marker) and tuple(tail[-len(marker) :]) == marker


def prompt_opens_thought(tokenizer: Any, prompt_ids: Sequence[int]) -> bool:
    """Whether the prompt ends inside a thought (its generation prompt wrote the start marker)."""
    if not getattr(tokenizer, "has_thinking", False):
        return False
    ids = list(prompt_ids[-_PROMPT_TAIL:])
    return tokenizer.rfind_think_start(ids) > tokenizer.rfind_think_end(ids)


def thought_budget(tokenizer: Any, budget: int, prompt_ids: Sequence[int]) -> ThoughtBudget | None:
    """The processor for one request of a thinking model, or None for a model that does not think."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    opened = prompt_opens_thought(tokenizer, prompt_ids)
    return ThoughtBudget(budget, tokenizer.think_start_tokens, tokenizer.think_end_tokens, opened)
