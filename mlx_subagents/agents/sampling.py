"""A server's sampling request answered on the local model: what `McpCaller.sample` runs.

An MCP server may ask its client for a completion (`sampling/createMessage`: its messages, a system
prompt, `maxTokens`, model hints). Here the calling agent's resident host answers it, on a host
session of its own (closed after, so the agent's KV cache is untouched), without tools, thinking or
grammar: the server gets plain text. The model is the agent's own unless a hint names (as a
substring, as the spec says) another model already resident in the run. The reply is bounded by the
request's `maxTokens`, the agent's per-reply limit and what is left of its `--max-tokens`; the
tokens count in the agent's usage. A local server's sampling costs nothing but the machine's time.

Only text is read and written: a request with images, audio or tools is refused in one line. Stop
sequences cut the text where they first appear.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import McpRequestError, SubagentError
from ..host.protocol import GenerateArgs, Message, ModelHost, Usage

if TYPE_CHECKING:
    import mcp_types as types


def sampling_messages(params: types.CreateMessageRequestParams) -> list[Message]:
    """The request's system prompt and messages as chat messages; refuses what is not text."""
    if params.tools:
        raise McpRequestError("sampling refused: tools in a sampling request are not supported by this client")
    messages: list[Message] = []
    if params.system_prompt:
        messages.append({"role": "system", "content": params.system_prompt})
    for message in params.messages:
        texts = []
        for block in message.content_as_list:
            if block.type != "text":
                raise McpRequestError(f"sampling refused: the request holds {block.type} content; the model reads text")
            texts.append(block.text)  # type: ignore[union-attr]
        messages.append({"role": message.role, "content": "\n".join(texts)})
    if not any(m["role"] == "user" for m in messages):
        raise McpRequestError("sampling refused: the request has no user message")
    return messages


def choose_host(params: types.CreateMessageRequestParams, own: ModelHost, resident: Sequence[ModelHost]) -> ModelHost:
    """The first resident model a hint names (a substring of its id, in the hints' order), else `own`."""
    preferences = params.model_preferences
    for hint in (preferences.hints or []) if preferences is not None else []:
        wanted = (hint.name or "").strip().lower()
        for host in (own, *resident):
            if wanted and wanted in host.model_id.lower():
                return host
    return own


async def sample(
    host: ModelHost, session_name: str, agent: str, params: types.CreateMessageRequestParams, max_tokens: int
) -> tuple[types.CreateMessageResult, Usage]:
    """One completion on `host` in a host session of its own, at most `max_tokens` long."""
    import mcp_types as types

    messages = sampling_messages(params)
    args = GenerateArgs(max_tokens=max_tokens, temperature=params.temperature or 0.0, thinking=0, grammar=False)
    session = host.session(session_name, agent=agent)
    try:
        reply = await session.generate(messages, args)
    except SubagentError as exc:  # the prompt does not fit, the engine refused
        raise McpRequestError(f"sampling failed: {exc}") from None
    finally:
        await session.close()
    text, stop = reply.text, "maxTokens" if reply.finish_reason == "length" else "endTurn"
    cuts = [text.index(s) for s in params.stop_sequences or [] if s and s in text]
    if cuts:
        text, stop = text[: min(cuts)], "stopSequence"
    content = types.TextContent(type="text", text=text)
    return types.CreateMessageResult(
        role="assistant", content=content, model=host.model_id, stop_reason=stop
    ), reply.usage


__all__ = ["choose_host", "sample", "sampling_messages"]
