"""What ends a session's loop besides a final answer: its `Limits` (turns, tokens, thinking, the
grammar's hold on its calls and answer), and `LimitReached`, which carries the limit that ended it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..host.protocol import DEFAULT_THINKING_TOKENS, Reply
from ..results import StopReason

DEFAULT_MAX_TURNS = 30
DEFAULT_MAX_REPLY_TOKENS = 2048


@dataclass(frozen=True)
class Limits:
    """What ends a run besides a final answer."""

    max_turns: int = DEFAULT_MAX_TURNS
    max_output_tokens: int | None = None
    max_reply_tokens: int = DEFAULT_MAX_REPLY_TOKENS
    # Tokens a reply may think before the host closes the thought (0: off), on top of `max_reply_tokens`.
    thinking: int = DEFAULT_THINKING_TOKENS
    # Whether a started tool call is constrained to a known tool and valid arguments (`host/calls/grammar.py`).
    grammar: bool = True
    # The JSON schema the final answer is held to by the grammar (with `grammar`; validated either way).
    answer_schema: dict[str, Any] | None = None
    # Turns earlier generations already took of `max_turns` (a continued child's budget is cumulative).
    turns_before: int = 0


class LimitReached(Exception):
    """A limit ended the loop; carries which one."""

    def __init__(self, stop_reason: StopReason, message: str) -> None:
        super().__init__(message)
        self.stop_reason = stop_reason


def cut_answer(reply: Reply, window: int, limits: Limits) -> LimitReached:
    """Why a final answer was cut: the context window ran out (the host stops a reply there), or the
    per-reply limit."""
    u = reply.usage
    if u.prompt_tokens + u.generated_tokens >= window:
        return LimitReached(
            "context_window",
            f"the context window of {window:,} tokens ran out during the final answer (the conversation took "
            f"{u.prompt_tokens:,} of them); the output holds the partial text; give the task less to read or "
            "fewer turns, or a model with a longer window (--context-window, as far as the KV budget allows)",
        )
    return LimitReached(
        "max_tokens",
        f"the final answer was cut at the per-reply limit of {limits.max_reply_tokens} tokens; "
        "the output holds the partial text",
    )


def over_token_budget(limits: Limits, output_tokens: int) -> bool:
    """Whether a session that generated `output_tokens` has used its token limit."""
    cap = limits.max_output_tokens
    return cap is not None and output_tokens >= cap


def out_of_tokens(limits: Limits) -> LimitReached:
    return LimitReached("max_tokens", f"reached the limit of {limits.max_output_tokens} generated tokens")
