"""Compaction: keep a long conversation inside the context window.

When the context nears the window, the older turns are summarised by the model
itself and replaced by one user message. Two things shape the design:

- the budgets scale with the window (a 32k-token model cannot keep 20k tokens
  of recent history *and* reserve 16k for the reply), see `scale_compaction`;
- the head (system prompt + task) stays byte-identical and the summary request
  goes through the conversation's own host session with the same tools, so the
  KV prefix the session already holds is reused rather than prefilled again.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from mlx_subagents.host.protocol import GenerateArgs, HostSession, Message, ToolSchema, Usage

SUMMARY_HEADER = "[Summary of earlier work]\n"
DEFAULT_SUMMARY_MAX_TOKENS = 2048
MIN_SUMMARY_MAX_TOKENS = 256
# Each message's text is clipped to this many characters in the summary transcript:
# tool outputs are the bulk of old turns, and their gist fits in a few lines.
DEFAULT_TRANSCRIPT_CHARS = 2000

SUMMARY_PROMPT = """\
The conversation has grown too long for the context window. Summarise the earlier \
work in the transcript above so that the task can be continued from your summary \
alone. Be concise and specific: keep exact file paths, names, commands, error \
messages and values that matter. Use exactly these sections:

## Goal
What the task asks for, in one or two sentences.
## Progress
What has been done and what was found.
## Decisions
Choices made, and why.
## Files read
One path per line, with what matters in it.
## Files modified
One path per line, with what changed.
## Next steps
What remains to be done, in order.

Reply with the summary only; do not call any tools."""

CountTokens = Callable[[list[Message]], Awaitable[int]]


@dataclass(frozen=True)
class CompactionSettings:
    """Compaction budgets in tokens; scale them to the model with `scale_compaction`.

    `reserve_tokens` is kept free for the summary and the next reply;
    `keep_recent_tokens` of the latest history are kept verbatim. `enabled` is
    read by `should_compact`; `compact` itself always runs when called.
    """

    reserve_tokens: int = 16384
    keep_recent_tokens: int = 20000
    enabled: bool = True

    def __post_init__(self) -> None:
        for name in ("reserve_tokens", "keep_recent_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"compaction {name} must be an int >= 0, got {value!r}")


@dataclass(frozen=True)
class CompactionResult:
    """The compacted conversation and what it cost."""

    messages: list[Message]
    summary: str
    n_summarized: int
    tokens_before: int
    tokens_after: int
    usage: Usage = field(default_factory=Usage)


def scale_compaction(context_window: int, settings: CompactionSettings = CompactionSettings()) -> CompactionSettings:
    """Fit the budgets to a window: reserve <= 25%, keep_recent <= 50% (so <= 75% together).

    Configured values already below their cap are kept; nothing is scaled up.
    Raises `ValueError` for a window that is not a positive whole number.
    """
    window = _check_window(context_window)
    return replace(
        settings,
        reserve_tokens=min(settings.reserve_tokens, window // 4),
        keep_recent_tokens=min(settings.keep_recent_tokens, window // 2),
    )


def _check_window(context_window: Any) -> int:
    if isinstance(context_window, bool) or not isinstance(context_window, (int, float)):
        raise ValueError(f"context window must be a positive whole number of tokens, got {context_window!r}")
    if isinstance(context_window, float) and not (math.isfinite(context_window) and context_window.is_integer()):
        raise ValueError(f"context window must be a whole number of tokens, got {context_window!r}")
    if context_window <= 0:
        raise ValueError(f"context window must be positive, got {context_window!r}")
    return int(context_window)


def should_compact(context_tokens: int, context_window: int, settings: CompactionSettings) -> bool:
    """True when the context leaves less than `reserve_tokens` free (pass scaled settings)."""
    return settings.enabled and context_tokens > context_window - settings.reserve_tokens


def split_for_compaction(
    messages: list[Message], token_counts: list[int], keep_recent_tokens: int
) -> tuple[list[Message], list[Message], list[Message]]:
    """Split a conversation into (head, to_summarize, kept); their concatenation is `messages`.

    `head` is the leading system message(s) plus the first user message (the
    task), kept so the cached prefix survives. `kept` is the latest messages
    within `keep_recent_tokens` (at least the last one), extended backwards so a
    cut falls only before a user or assistant message and never separates an
    assistant tool call from its tool results. `to_summarize` is the rest, often
    empty.

    Args:
        token_counts: token count of each message, `token_counts[i]` for `messages[i]`.
    """
    if len(token_counts) != len(messages):
        raise ValueError(f"{len(token_counts)} token counts for {len(messages)} messages: need one per message")
    n_head = head_length(messages)
    head, rest, counts = messages[:n_head], messages[n_head:], token_counts[n_head:]
    if not rest:
        return list(head), [], []
    # Budget first: the earliest start whose suffix fits, but never past the last message.
    start, total = len(rest) - 1, counts[-1]
    while start > 0 and total + counts[start - 1] <= keep_recent_tokens:
        start -= 1
        total += counts[start]
    cut = _safe_cut(rest, start)
    return list(head), rest[:cut], rest[cut:]


def summary_max_tokens(settings: CompactionSettings) -> int:
    """The summary's length cap: half the reserve, within [MIN, DEFAULT]_SUMMARY_MAX_TOKENS."""
    return min(DEFAULT_SUMMARY_MAX_TOKENS, max(MIN_SUMMARY_MAX_TOKENS, settings.reserve_tokens // 2))


def fit_keep_recent(settings: CompactionSettings, context_window: int, head_tokens: int) -> CompactionSettings:
    """Cap the kept history so head + summary + kept history lands below the trigger.

    Without this, a head (system prompt + tools + task) that is a large part of
    a small window leaves the compacted context above the trigger, and
    compaction would run again every turn.
    """
    room = context_window - settings.reserve_tokens - head_tokens - summary_max_tokens(settings)
    return replace(settings, keep_recent_tokens=max(0, min(settings.keep_recent_tokens, room)))


def head_length(messages: list[Message]) -> int:
    """The leading system message(s) plus the first user message (the task)."""
    n = 0
    while n < len(messages) and messages[n].get("role") == "system":
        n += 1
    if n < len(messages) and messages[n].get("role") == "user":
        n += 1
    return n


def _safe_cut(rest: list[Message], start: int) -> int:
    """The latest index <= `start` where cutting keeps every tool result with its call."""
    # needs[i]: the earliest index message i cannot be separated from (its call, for a result).
    needs = [_call_index(rest, i) for i in range(len(rest))]
    earliest_needed = len(rest)
    suffix_min = [0] * len(rest)
    for i in range(len(rest) - 1, -1, -1):
        earliest_needed = min(earliest_needed, needs[i])
        suffix_min[i] = earliest_needed
    for cut in range(start, 0, -1):
        if rest[cut].get("role") in ("user", "assistant") and suffix_min[cut] >= cut:
            return cut
    return 0


def _call_index(messages: list[Message], i: int) -> int:
    """For a tool result, the index of the assistant message that called it; else `i`.

    A result matches its call by `tool_call_id`; one without a matching id (such as
    the error for a malformed call) belongs to the nearest assistant message before it.
    """
    if messages[i].get("role") != "tool":
        return i
    call_id = messages[i].get("tool_call_id")
    nearest = None
    for j in range(i - 1, -1, -1):
        if messages[j].get("role") != "assistant":
            continue
        if nearest is None:
            nearest = j
        if call_id is None:
            break
        if any(c.get("id") == call_id for c in messages[j].get("tool_calls") or []):
            return j
    return nearest if nearest is not None else i


async def compact(
    messages: list[Message],
    session: HostSession,
    count_tokens: CountTokens,
    settings: CompactionSettings = CompactionSettings(),
    *,
    tools: list[ToolSchema] | None = None,
    max_tokens: int | None = None,
) -> CompactionResult:
    """Summarise the older turns with the model and replace them by one user message.

    The request is `head + [transcript of the older turns + SUMMARY_PROMPT]` on the
    conversation's own session with the conversation's `tools` passed unchanged,
    so the session's cached head (system prompt, tools, task) is reused. The
    result is `head + [summary message] + kept`, with head and kept untouched.

    Args:
        count_tokens: counts a message list, tools bound or not (e.g.
            `lambda ms: host.count_tokens(ms, tools)`). It is only ever given
            prefixes of `messages` and the new list; see `recent_token_counts`.
        settings: scaled settings; `keep_recent_tokens` sets what stays verbatim and
            `reserve_tokens` bounds the summary length.
        max_tokens: summary length cap; default half the reserve, within
            [MIN_SUMMARY_MAX_TOKENS, DEFAULT_SUMMARY_MAX_TOKENS].
    """
    tokens_before = await count_tokens(messages)
    token_counts = await recent_token_counts(messages, count_tokens, settings.keep_recent_tokens, total=tokens_before)
    head, to_summarize, kept = split_for_compaction(messages, token_counts, settings.keep_recent_tokens)
    if not to_summarize:
        return CompactionResult(list(messages), "", 0, tokens_before, tokens_before)
    if max_tokens is None:
        max_tokens = summary_max_tokens(settings)
    request = [*head, {"role": "user", "content": _summary_request(to_summarize)}]
    reply = await session.generate(request, GenerateArgs(max_tokens=max_tokens), tools=tools)
    # A model that answers with a tool call instead of text still must not lose the history.
    summary = reply.text.strip() or fallback_summary(to_summarize)
    new_messages = [*head, {"role": "user", "content": SUMMARY_HEADER + summary}, *kept]
    return CompactionResult(
        messages=new_messages,
        summary=summary,
        n_summarized=len(to_summarize),
        tokens_before=tokens_before,
        tokens_after=await count_tokens(new_messages),
        usage=reply.usage,
    )


async def recent_token_counts(
    messages: list[Message], count_tokens: CountTokens, budget: int, *, total: int | None = None
) -> list[int]:
    """Per-message token counts for the split, as differences of prefix counts.

    Counting `messages[:i + 1]` minus `messages[:i]` makes the template and tool
    overhead cancel out (counting `[m]` alone would charge the tool schemas to
    every message) and only renders real prefixes of the conversation, which
    strict templates accept. Counting stops, from the end, once the recent
    messages exceed `budget`: the split never looks further back, so earlier
    entries are `budget + 1` ("over budget") and the head's are 0.

    Args:
        total: `count_tokens(messages)` if the caller already has it.
    """
    n_head = head_length(messages)
    counts = [0] * n_head + [budget + 1] * (len(messages) - n_head)
    upper = await count_tokens(messages) if total is None else total
    spent = 0
    for i in range(len(messages) - 1, n_head - 1, -1):
        lower = await count_tokens(messages[:i]) if i else 0
        # Templates may render the last message differently; never count below zero.
        counts[i] = max(upper - lower, 0)
        spent += counts[i]
        upper = lower
        if spent > budget:
            break
    return counts


def _summary_request(to_summarize: list[Message]) -> str:
    return (
        "Transcript of the earlier turns of this task:\n\n<transcript>\n"
        + render_transcript(to_summarize)
        + "\n</transcript>\n\n"
        + SUMMARY_PROMPT
    )


def render_transcript(messages: list[Message], max_chars: int = DEFAULT_TRANSCRIPT_CHARS) -> str:
    """Plain-text transcript for the summary request; each message text clipped to `max_chars`."""
    blocks = []
    for message in messages:
        role = message.get("role", "?")
        name = message.get("name") if role == "tool" else None
        lines = [f"[tool {name}]" if name else f"[{role}]"]
        text = _text(message.get("content"))
        if text:
            lines.append(_clip(text, max_chars))
        lines += [_clip(f"tool call: {c}", max_chars) for c in _call_strings(message)]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def fallback_summary(messages: list[Message], max_chars: int = 200) -> str:
    """A mechanical summary (the tool calls made), used when the model gives no text."""
    calls = [_clip(c, max_chars) for m in messages for c in _call_strings(m)]
    body = "\n".join(f"- {c}" for c in calls) or "- (none)"
    return f"The model gave no summary; {len(messages)} earlier messages were dropped.\n## Tool calls made\n{body}"


def _call_strings(message: Message) -> list[str]:
    """`name({...})` for each tool call of an assistant message."""
    strings = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        arguments = function.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        strings.append(f"{function.get('name', '?')}({arguments})")
    return strings


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI-style content parts
        return "\n".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _clip(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters omitted ...]\n{text[-half:]}"
