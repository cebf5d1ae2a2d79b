"""Messages to prompt token ids, reusing the exact ids a session's cache holds.

Re-rendering an assistant reply through the chat template can tokenize
differently from what the model generated (a tool call re-serialized, other
token boundaries), and every token after the first difference must be
prefilled again. So when the new conversation extends the previous one by
that reply, the next prompt is built as: the ids the cache holds (prompt +
generated, including the end-of-turn token) + the tokens of the newly
rendered text after the reply. Otherwise the full rendering is tokenized and
the longest common prefix with the held ids is reused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import ChatTemplateError, PromptTooLongError
from ..protocol import Message, ToolSchema


@dataclass(frozen=True)
class RenderState:
    """What the previous turn rendered, to recognise an extension of it."""

    messages_json: str
    tools_json: str
    n_messages: int
    prompt_text: str
    ended_with_eos: bool


def _dump(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def render(
    tokenizer: Any,
    messages: list[Message],
    tools: list[ToolSchema] | None,
    *,
    generation_prompt: bool,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The chat template's text for a conversation; a template that fails says so in one line.

    `template_kwargs` reach the template as variables (`enable_thinking=False`).
    """
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # jinja's raise_exception, or a template tripping over a message
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ChatTemplateError(f"the model's chat template refused the conversation: {reason}") from None


def encode(tokenizer: Any, text: str) -> list[int]:
    """Chat templates write their own special tokens: never add them again."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def split_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The added tokens a tokenizer always splits text at: where text has one at `i`, its tokens are those
    of `text[:i]` then those of `text[i:]` (none takes the whitespace before it, matches only between
    words, or is matched in normalized text). A chat template's turn markers are such tokens."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return tuple(
        t.content
        for t in added.values()
        if t.content and not any(getattr(t, flag, True) for flag in ("lstrip", "single_word", "normalized"))
    )


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _spliced(
    tokenizer: Any,
    messages: list[Message],
    tools: list[ToolSchema] | None,
    text: str,
    state: RenderState,
    held: list[int],
    template_kwargs: Mapping[str, Any] | None,
    given: Message | None = None,
) -> list[int] | None:
    """Held ids + the tokens after the previous reply, or None when not an extension. The cache holds
    the reply as generated: one the caller sent back edited (a chat client's "edit": it says other than
    `given`, the reply as the session gave it) is no extension, its prompt is rendered whole."""
    k = state.n_messages
    if len(messages) <= k or messages[k].get("role") != "assistant":
        return None
    if given is not None and _said(messages[k]) != _said(given):
        return None
    if _dump(tools) != state.tools_json or _dump(messages[:k]) != state.messages_json:
        return None
    with_reply = render(tokenizer, messages[: k + 1], tools, generation_prompt=False, template_kwargs=template_kwargs)
    if not with_reply.startswith(state.prompt_text) or not text.startswith(with_reply):
        return None
    reply = with_reply[len(state.prompt_text) :]
    end = reply.rfind(tokenizer.eos_token or "\x00")
    if end < 0:
        return None
    # After an EOS the cache already holds the end-of-turn token; after a cut
    # (length or cancel) the template's end-of-turn must still be fed.
    tail = reply[end + len(tokenizer.eos_token) :] if state.ended_with_eos else reply[end:]
    return held + encode(tokenizer, tail + text[len(with_reply) :])


def longest_token(tokenizer: Any) -> int:
    """The most characters one token of the vocabulary is written with (a byte-level BPE writes each
    byte as one character, SentencePiece a space as one): a text has at least its length over this
    many tokens."""
    return max(map(len, tokenizer.get_vocab()), default=1)


def build_prompt(
    tokenizer: Any,
    messages: list[Message],
    tools: list[ToolSchema] | None,
    state: RenderState | None,
    held: list[int],
    template_kwargs: Mapping[str, Any] | None = None,
    max_chars: int | None = None,
    given: Message | None = None,
) -> tuple[list[int], str, bool]:
    """Prompt ids for this turn, the rendered text (kept for the next turn) and whether the ids were
    spliced onto `held`. A text over `max_chars` is refused before it is tokenized: tokenizing megabytes
    takes seconds to minutes, only to learn the prompt does not fit."""
    text = render(tokenizer, messages, tools, generation_prompt=True, template_kwargs=template_kwargs)
    if max_chars is not None and len(text) > max_chars:
        raise PromptTooLongError(
            f"the prompt is {len(text):,} characters, more than the context window holds whatever their tokens "
            f"({max_chars:,} at most); shorten the task or the conversation (compaction), or raise --context-window"
        )
    if state is not None and held:
        ids = _spliced(tokenizer, messages, tools, text, state, held, template_kwargs, given)
        if ids is not None:
            return ids, text, True
    return encode(tokenizer, text), text, False


def _said(message: Message) -> tuple[str, list[Any]]:
    """What an assistant message says: its text without whitespace, its calls' names and arguments.
    Whitespace and reasoning are not compared: a client may strip them, and the tokens generated are
    then what the model did write."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return "".join(str(message.get("content") or "").split()), calls


def make_render_state(
    messages: list[Message], tools: list[ToolSchema] | None, text: str, ended_with_eos: bool
) -> RenderState:
    return RenderState(_dump(messages), _dump(tools), len(messages), text, ended_with_eos)


def generation_prompt_length(
    tokenizer: Any,
    messages: list[Message],
    tools: list[ToolSchema] | None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> int:
    """Tokens the template appends to open the reply (`<|im_start|>assistant\n`).

    A hybrid cache is snapshotted just before them: a retry or a new user
    message diverges exactly there.
    """
    with_prompt = render(tokenizer, messages, tools, generation_prompt=True, template_kwargs=template_kwargs)
    without = render(tokenizer, messages, tools, generation_prompt=False, template_kwargs=template_kwargs)
    if not with_prompt.startswith(without) or len(with_prompt) == len(without):
        return 1
    return max(1, len(encode(tokenizer, with_prompt[len(without) :])))
