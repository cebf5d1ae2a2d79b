"""What went wrong with an engine, in one line naming it and the fix: a request that failed (time-out,
connection, refusal by status), a stream cut or not in the protocol, a model it does not serve."""

from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import openai

from ...errors import EngineError, PromptTooLongError, SubagentError
from .engine_stream import excerpt, looks_like_html, page_summary

API_KEY_ENV = "MLX_SUBAGENTS_API_KEY"
# What to do when the URL answers, but not as an engine does.
NOT_AN_ENGINE = "check that --engine is the engine's API root (usually ending in /v1), not a proxy's login page"
GARBLED = "the engine (or a proxy in between) does not speak the chat-completions protocol; check its logs"


@dataclass(frozen=True)
class EngineErrors:
    """The errors of one engine host: its URL and model, and the time-out and retries a request had."""

    url: str
    model_id: str
    timeout: float
    max_retries: int

    def failed(self, exc: Exception, *, streamed: int | None = None) -> SubagentError:
        """One line naming the engine and what to do, for a failed request.

        Args:
            streamed: characters received when the stream broke (None: before it started).
        """
        where = f"engine {self.url}"
        retried = f"after {self.max_retries} {'retry' if self.max_retries == 1 else 'retries'}"
        if isinstance(exc, openai.APITimeoutError):
            if streamed is None:
                waited = f"no reply within {self.timeout:g} s {retried}"
            else:
                waited = f"the engine sent nothing for {self.timeout:g} s mid-reply"
            return EngineError(f"{where}: {waited}; check that it is not overloaded or stuck (its logs), then retry")
        if isinstance(exc, openai.APIConnectionError):
            if streamed is not None:
                return self.cut(streamed)
            return EngineError(f"{where}: {_connection_problem(exc, self.url)}")
        if not isinstance(exc, openai.APIStatusError):  # e.g. an error event in the stream
            when = "mid-reply" if streamed is not None else "before replying"
            message = " ".join(str(getattr(exc, "message", exc)).split())
            return EngineError(f"{where}: the engine failed {when} ({message}); check its logs, then retry")
        status, message = exc.status_code, _status_message(exc)
        if status == 401:
            return EngineError(
                f"{where}: the API key was refused (401: {message}); pass the engine's key with --api-key or "
                f"${API_KEY_ENV}"
            )
        if status == 403:
            return EngineError(
                f"{where}: access to model '{self.model_id}' was denied (403: {message}); use a key that may "
                f"use it (--api-key or ${API_KEY_ENV})"
            )
        if status == 429:
            return EngineError(f"{where}: still rate limited (429) {retried}; lower --concurrency or retry later")
        if status == 400 and "context" in message.lower():
            return PromptTooLongError(
                f"{where}: the prompt does not fit model '{self.model_id}' ({message}); lower --context-window "
                "so that compaction starts earlier"
            )
        if status >= 500:
            return EngineError(
                f"{where}: unavailable ({status}: {message}) {retried}; wait until the engine is up, or lower "
                "--concurrency"
            )
        return EngineError(f"{where}: the request was refused ({status}: {message})")

    def cut(self, streamed: int, ignored: Sequence[str] = (), *, n_chunks: int = 1) -> SubagentError:
        """The stream ended before the reply did; `ignored`: a line in it that was no event (what came instead)."""
        where = f"engine {self.url}: " + (
            "the event stream ended before the reply began"
            if n_chunks == 0
            else f"the stream was cut mid-reply after {streamed} characters"
        )
        if ignored:
            return EngineError(f"{where}; instead of events it held lines like {excerpt(ignored[0])}; {NOT_AN_ENGINE}")
        return EngineError(f"{where}; the engine may have crashed or restarted (check its logs), then retry")

    def wrong(self, what: str, *, streamed: int | None = None) -> SubagentError:
        """An answer that is not what the protocol says; `what` says what came back."""
        if streamed is None:
            return EngineError(f"engine {self.url}: {what}; {NOT_AN_ENGINE}")
        return EngineError(f"engine {self.url}: {what}, after {streamed} characters of the reply; {GARBLED}")

    def not_found(self, exc: openai.NotFoundError, served: list[str]) -> SubagentError:
        """A 404: the model is not served (list what is: `served`), or the URL has no chat endpoint."""
        if served:
            return EngineError(
                f"engine {self.url}: model '{self.model_id}' not found; it serves {', '.join(served)}; pass one "
                "with --model"
            )
        return EngineError(
            f"engine {self.url}: model '{self.model_id}' not found ({_status_message(exc)}) and the engine "
            "lists no models; check --model, and that the URL is the API root (usually ending in /v1)"
        )


def _connection_problem(exc: Exception, url: str) -> str:
    host = urlsplit(url).hostname
    for cause in _causes(exc):
        if isinstance(cause, socket.gaierror):
            return f"cannot resolve the host name '{host}'; check the host in --engine"
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused; start the engine, or check the host and port in --engine"
    return f"cannot connect ({_last_words(exc)}); check that the engine runs and --engine points at it"


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _last_words(exc: BaseException) -> str:
    *_, deepest = _causes(exc)
    return " ".join(str(deepest).split()) or type(deepest).__name__


def _status_message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        detail = body.get("message") or body.get("error") or body.get("detail")
        if isinstance(detail, dict):
            detail = detail.get("message")
        if detail:
            return " ".join(str(detail).split())[:500]
    text = body if isinstance(body, str) else ""
    if looks_like_html(exc.response.headers.get("content-type", ""), text):  # a proxy's error page
        return f"an HTML page: {page_summary(text)}"
    return " ".join(str(exc.message).split())[:500]
