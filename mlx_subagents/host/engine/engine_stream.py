"""One engine reply as it streams: server-sent events read and checked against the protocol, within bounds.

The `openai` client's own stream reader raises whatever breaks first (a JSON error, an attribute
error on a chunk of the wrong shape) and has no bound on a line. Here every way an engine (or a
proxy in front of it) can answer wrongly is a `WrongReply` that says what came back, and what one
reply may hold is bounded: a line, the text per token, the tokens (`max_tokens`, counted here too).
`EngineHost` names the engine and the fix.
"""

from __future__ import annotations

import html
import json
import re
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..calls.toolcalls import VisibleText
from ..protocol import OnHostEvent, ReasoningDelta, TokensSoFar

# One event line: a chunk is a few hundred bytes; a line this long is not an engine's.
MAX_LINE_BYTES = 1 << 20
# What is read of a body that is not an event stream, to say what it is.
PEEK_BYTES = 64 << 10
EXCERPT_CHARS = 120
# A streamed reply is counted as at least one token per delta and at least one per this many
# characters (tokenizers average about 4): past `max_tokens` either way, the reply is cut here.
MAX_CHARS_PER_TOKEN = 8


class WrongReply(Exception):
    """The engine answered, but not as the chat-completions protocol says; the text says what came back."""


class EngineFailed(Exception):
    """The engine reported an error inside the stream (an `error` event)."""


def excerpt(text: str) -> str:
    """`text` on one line, quoted, cut at `EXCERPT_CHARS` with a mark."""
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= EXCERPT_CHARS else flat[:EXCERPT_CHARS] + "...")


def page_summary(text: str) -> str:
    """An HTML page's title, else its first words."""
    title = re.search(r"<title[^>]*>(.*?)</title", text[:PEEK_BYTES], re.IGNORECASE | re.DOTALL)
    words = title.group(1) if title and title.group(1).strip() else re.sub(r"<[^>]*>", " ", text[:PEEK_BYTES])
    return excerpt(html.unescape(words))


def looks_like_html(content_type: str, text: str) -> bool:
    return "html" in content_type.lower() or text.lstrip()[:15].lower().startswith(("<!doctype html", "<html"))


def not_a_stream(status: int, content_type: str, body: bytes) -> str:
    """What an engine answered instead of the event stream that was asked for (status `status`)."""
    text = body.decode("utf-8", "replace")
    kind = content_type.split(";")[0].strip().lower()
    what = f"(status {status}), not an event stream"
    if looks_like_html(kind, text):
        return f"the engine answered with an HTML page {what}: {page_summary(text)}"
    try:
        data = json.loads(text) if "json" in kind or text.lstrip()[:1] in ("{", "[") else None
    except ValueError:
        data = None
    if isinstance(data, dict) and data.get("object") == "chat.completion":
        return f'the engine answered with one whole JSON completion {what}: it ignored "stream": true'
    if isinstance(data, dict) and data.get("error"):
        error = data["error"]
        message = error.get("message") if isinstance(error, dict) else error
        return f"the engine answered with a JSON error {what}: {excerpt(str(message or error))}"
    if data is not None:
        return f"the engine answered with a JSON body {what}: {excerpt(text)}"
    if not text.strip():
        return f"the engine answered with an empty {kind or 'untyped'} body {what}"
    return f"the engine answered with a {kind or 'untyped'} body {what}: {excerpt(text)}"


async def read_some(chunks: AsyncIterator[bytes], limit: int = PEEK_BYTES) -> bytes:
    """Up to `limit` bytes of a body (whatever arrived, if the body breaks off)."""
    body = bytearray()
    try:
        async for chunk in chunks:
            body += chunk
            if len(body) >= limit:
                break
    except Exception:  # only describing a wrong answer: what arrived is enough
        pass
    return bytes(body[:limit])


def transport_errors(response: Any) -> tuple[type[Exception], type[Exception]]:
    """(timeout, broken connection) exception classes of the HTTP library the client uses (`httpx`, or
    `httpx2` in newer `openai` releases): the body is read here, below the client's own mapping."""
    library = sys.modules[type(response).__module__.partition(".")[0]]
    return library.TimeoutException, library.TransportError


async def event_data(chunks: AsyncIterator[bytes], ignored: list[str]) -> AsyncIterator[str]:
    """The `data` of each server-sent event in `chunks`; comments, `event:`, `id:` and `retry:` lines are
    skipped, and the first line that is no SSE field at all is kept in `ignored` (to say what came back)."""
    buffer = b""
    data: list[str] = []
    async for chunk in chunks:
        *lines, buffer = (buffer + chunk).split(b"\n")
        if len(buffer) > MAX_LINE_BYTES:
            raise WrongReply(
                f"the engine sent a line of over {MAX_LINE_BYTES >> 20} MiB: {excerpt(_text(buffer[:200]))}"
            )
        for raw in lines:
            line = _text(raw.rstrip(b"\r"))
            if not line:
                if data:
                    yield "\n".join(data)
                data = []
                continue
            name, _, value = line.partition(":")
            if name == "data":
                data.append(value[1:] if value.startswith(" ") else value)
            elif name not in ("", "event", "id", "retry") and not ignored:
                ignored.append(line)
    if data:  # the last event, without its blank line
        yield "\n".join(data)


def _text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", "replace")
        raise WrongReply(f"the engine sent a line that is not UTF-8 text: {excerpt(text)}") from None


def _chunk_error(data: str) -> WrongReply:
    return WrongReply(f"the engine sent an event that is not a chat-completion chunk: {excerpt(data)}")


@dataclass
class Partial:
    """One streamed reply being assembled from its chunks; `visible` streams its text without call markup,
    `on_event` gets its reasoning and the chunks taken so far (about one token each).

    `add` returns False once the reply is over `max_tokens` (the chunk that would pass it is not taken).
    """

    max_tokens: int
    visible: VisibleText | None = None
    on_event: OnHostEvent | None = None
    text: str = ""
    reasoning: str = ""
    calls: dict[int | None, dict[str, str]] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    n_chunks: int = 0
    n_tokens: int = 0
    n_chars: int = 0
    over_limit: bool = False
    first_delta: float | None = None

    def add(self, data: str, now: float) -> bool:
        """Take one event's data (`[DONE]` included: it changes nothing)."""
        if data.strip() == "[DONE]":
            return True
        try:
            event = json.loads(data)
        except ValueError:
            raise WrongReply(f"the engine sent an event that is not JSON: {excerpt(data)}") from None
        if not isinstance(event, dict):
            raise _chunk_error(data)
        if event.get("error"):
            error = event["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise EngineFailed(" ".join(str(message or error).split()))
        choices = event.get("choices", [] if "usage" in event else None)
        if not isinstance(choices, list):
            raise _chunk_error(data)
        deltas = [_delta(choice, data) for choice in choices]
        self.n_chunks += 1
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        for delta, finish in deltas:
            if not self._take(delta, now):
                return False
            self.finish_reason = finish or self.finish_reason
        return True

    def _take(self, delta: dict[str, Any], now: float) -> bool:
        content = delta.get("content") or ""
        # vLLM and llama.cpp send `reasoning_content`, mlx-lm's server `reasoning`.
        thought = delta.get("reasoning_content") or delta.get("reasoning") or ""
        parts = delta.get("tool_calls") or []
        n_chars = (
            len(content)
            + len(thought)
            + sum(len(f.get("name") or "") + len(f.get("arguments") or "") for _, f in parts)
        )
        if not (content or thought or parts):
            return True
        if self.n_tokens + 1 > self.max_tokens or self.n_chars + n_chars > self.max_tokens * MAX_CHARS_PER_TOKEN:
            self.over_limit = True
            return False
        self.n_tokens += 1
        self.n_chars += n_chars
        self.first_delta = self.first_delta or now
        if self.on_event is not None:
            self.on_event(TokensSoFar(self.n_tokens))
        if thought:
            self.reasoning += thought
            if self.on_event is not None:
                self.on_event(ReasoningDelta(thought))
        if content:
            self.text += content
            if self.visible is not None:
                self.visible(content)
        for part, function in parts:
            call = self.calls.setdefault(part.get("index"), {"id": "", "name": "", "arguments": ""})
            call["id"] = part.get("id") or call["id"]
            call["name"] += function.get("name") or ""
            call["arguments"] += function.get("arguments") or ""
        return True


def _delta(choice: Any, data: str) -> tuple[dict[str, Any], str | None]:
    """A choice's delta, its text fields checked and its tool-call parts as (part, function) pairs."""
    delta = choice.get("delta") if isinstance(choice, dict) else None
    delta = {} if isinstance(choice, dict) and delta is None else delta
    finish = choice.get("finish_reason") if isinstance(choice, dict) else None
    if not isinstance(delta, dict) or not isinstance(finish, (str, type(None))):
        raise _chunk_error(data)
    texts = [delta.get(key) for key in ("content", "reasoning_content", "reasoning")]
    parts = delta.get("tool_calls") or []
    if not all(isinstance(t, (str, type(None))) for t in texts) or not isinstance(parts, list):
        raise _chunk_error(data)
    pairs = []
    for part in parts:
        function = part.get("function") if isinstance(part, dict) else None
        function = {} if isinstance(part, dict) and function is None else function
        if not isinstance(function, dict) or not all(
            isinstance(v, (str, type(None))) for v in (part.get("id"), function.get("name"), function.get("arguments"))
        ):
            raise _chunk_error(data)
        if not isinstance(part.get("index"), (int, type(None))) or isinstance(part.get("index"), bool):
            raise _chunk_error(data)
        pairs.append((part, function))
    return {**delta, "tool_calls": pairs}, finish
