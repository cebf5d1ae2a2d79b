"""Reading a request and writing an answer over ASGI, for the chat endpoints: a bounded JSON body, a
JSON answer, server-sent events, and the moment the client goes away.

The endpoints speak ASGI directly, not through a framework's response classes, because each needs
two things at once that those classes keep apart: to write events as the model makes them, and to
notice at once that the client left (the turn it asked for then stops and frees its place in the
batch, `Disconnect`).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from .api_errors import ApiError

# The largest body a chat request may have: a long conversation of a coding agent is a few MB of JSON.
MAX_BODY_BYTES = 32 * 2**20
# A surrogate's escape: JSON writes characters past U+FFFF as two; one alone is no text (a tokenizer fails on it).
SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


async def read_json(scope: Scope, receive: Receive, limit: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The request's body as a JSON object; what is over `limit`, not JSON or not an object is refused
    (413 or 400) with a line saying so. A body that says it is over the limit (its Content-Length) is
    refused before any of it is read (a client that asked `Expect: 100-continue` sends none); one that
    does not say (chunked) is refused as soon as what came is over it, never held whole."""
    declared = next((v for k, v in scope.get("headers", []) if k.lower() == b"content-length"), b"")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise asyncio.CancelledError  # nobody is left to answer
        body += message.get("body", b"")
        if len(body) > limit:
            raise too_large(limit)
        if not message.get("more_body", False):
            break
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc}); send one JSON object") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply; send one flat JSON object") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body is a JSON {type(data).__name__}, not an object; send one JSON object")
    if SURROGATE.search(body):  # paired ones decode to one character each; an unpaired one stays
        try:
            json.dumps(data, ensure_ascii=False).encode()
        except UnicodeEncodeError as exc:
            raise ApiError(
                400,
                f"the request body has an unpaired surrogate ({exc.object[exc.start]!r}) in a string; "
                "send text as UTF-8 or each surrogate with its pair",
            ) from None
    return data


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over {limit // 2**20} MiB; send a shorter conversation")


async def send_json(send: Send, status: int, data: Any, headers: dict[str, str] | None = None) -> None:
    """One whole JSON answer."""
    body = json.dumps(data, ensure_ascii=False).encode()
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra],
        }
    )
    await send({"type": "http.response.body", "body": body})


class EventStream:
    """Server-sent events: `data: JSON` (after `event: NAME` when named), each sent as it comes."""

    def __init__(self, send: Send) -> None:
        self._send = send

    async def open(self) -> None:
        headers = [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})

    async def event(self, data: Any, name: str | None = None) -> None:
        text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
        head = f"event: {name}\n" if name else ""
        await self._send({"type": "http.response.body", "body": f"{head}data: {text}\n\n".encode(), "more_body": True})

    async def close(self) -> None:
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})


class Disconnect:
    """Watches a request whose body was read for its client going away: `gone` is set then."""

    def __init__(self, receive: Receive) -> None:
        self.gone = asyncio.Event()
        self._task = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        message: Message = {}
        while message.get("type") != "http.disconnect":
            message = await receive()
        self.gone.set()

    def stop(self) -> None:
        self._task.cancel()


__all__ = ["MAX_BODY_BYTES", "Disconnect", "EventStream", "read_json", "send_json"]
