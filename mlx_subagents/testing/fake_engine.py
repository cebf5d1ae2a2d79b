"""A small OpenAI-compatible engine for tests: scripted replies and faults over real HTTP.

It serves `GET /v1/models` and streamed `POST /v1/chat/completions` (server-sent events over
chunked HTTP/1.1, as vLLM and SGLang send them) on 127.0.0.1 from a thread, and records every
request. Tests drive `EngineHost` through the real `openai` client and real sockets, and inject
each fault a real engine (or a proxy in front of one) shows on demand: 401, 403, 404, 429, 503, a
stream cut mid-reply, a stall, an error event, garbage in the stream, a page that is not a stream
(a login page with status 200), a stream that never ends, a model listing that never answers.
Only loopback: the server binds 127.0.0.1 and nothing else.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

FAKE_MODEL = "fake-model"
# The longest a reply waits for `Reply.together` requests: a client that never sends them all fails its count.
GATE_WAIT_S = 60.0


@dataclass(frozen=True)
class Reply:
    """One streamed completion: text (sent in `chunk`-character pieces) and/or tool calls.

    Tool-call arguments are streamed as a JSON string split across several deltas, the way
    engines send them. `prompt_tokens` None counts four characters of the request as a token.
    """

    content: str = ""
    tool_calls: tuple[dict[str, Any], ...] = ()
    reasoning: str = ""  # streamed first, as `reasoning_content` deltas (as vLLM's reasoning parsers do)
    finish_reason: str = "stop"
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    completion_tokens: int | None = None
    chunk: int = 4
    pause: float = 0.0  # seconds between chunks
    # Streams nothing until this many chat requests have been in flight at once (at most `GATE_WAIT_S`; a
    # latch: once reached, every reply goes on): a test of concurrency counts requests held together, not
    # replies that happened to overlap in time on a machine fast enough.
    together: int = 0


@dataclass(frozen=True)
class Fault:
    """A failure instead of a reply.

    `status`: answer with that HTTP status and an OpenAI-style error body (plus `headers`).
    `cut`: stream `content`, then close the connection without finishing the reply.
    `stall`: stream `content`, then send nothing for `seconds`.
    `error`: stream `content`, then an error event carrying `message` (as vLLM does mid-stream).
    `body`: answer with `body` as it is, of `content_type`, with `status` (a proxy's login page).
    `events`: stream `content`, then the raw text `body` (SSE lines, garbage), then end the reply.
    `endless`: stream `content` again and again, ignoring `max_tokens`, every `seconds` (an empty
        `content` sends keep-alive comments), until the client closes the stream.
    """

    kind: Literal["status", "cut", "stall", "error", "body", "events", "endless"]
    status: int = 500
    message: str = "scripted fault"
    content: str = ""
    seconds: float = 0.0
    headers: tuple[tuple[str, str], ...] = ()
    body: str = ""
    content_type: str = "text/html; charset=utf-8"


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any] | None


@dataclass
class FakeEngine:
    """The server. Queue replies and faults with `queue(...)`; each chat request takes the next.

    `queue(..., when="text")` keeps a separate queue for requests whose messages contain
    "text", so concurrent sessions get their own script whatever order they arrive in.

    Args:
        models: the ids `/v1/models` lists; a chat request for another id gets vLLM's 404.
        api_key: when set, a request without `Authorization: Bearer <api_key>` gets a 401.
        listing: extra fields for each model in the listing (e.g. `{"max_model_len": 8192}`).
        listing_fault: what `/v1/models` answers instead of the listing: a `status`, a `body`, or a
            `stall` (nothing for `seconds`, or until the engine stops).
    """

    models: tuple[str, ...] = (FAKE_MODEL,)
    api_key: str | None = None
    listing: dict[str, Any] = field(default_factory=dict)
    listing_fault: Fault | None = None
    requests: list[Recorded] = field(default_factory=list)
    # The most chat requests the engine was serving at one time.
    peak_in_flight: int = 0

    def __post_init__(self) -> None:
        self._in_flight = 0
        self._scripts: dict[str | None, deque[Reply | Fault]] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        # serve_forever checks for shutdown() every poll_interval (0.5 s by default): each stop waited that long.
        serve = {"poll_interval": 0.02}
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs=serve, name="fake-engine", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def queue(self, *items: Reply | Fault, when: str | None = None) -> None:
        with self._lock:
            self._scripts.setdefault(when, deque()).extend(items)

    @property
    def in_flight(self) -> int:
        """Chat requests being served now (a stream the client closed ends at the next write)."""
        with self._lock:
            return self._in_flight

    def chat_requests(self) -> list[Recorded]:
        return [r for r in self.requests if r.path.endswith("/chat/completions")]

    def start(self) -> FakeEngine:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FakeEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _next(self, body: dict[str, Any]) -> Reply | Fault:
        messages = json.dumps(body.get("messages"))
        with self._lock:
            keyed = [s for key, s in self._scripts.items() if key is not None and key in messages and s]
            script = keyed[0] if keyed else self._scripts.get(None)
            if script:
                return script.popleft()
        return Fault("status", 500, "the fake engine has no scripted reply left")


def _handler_for(engine: FakeEngine) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        pass

    Handler.engine = engine
    return Handler


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    engine: FakeEngine

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass

    def do_GET(self) -> None:
        self._record(None)
        if not self._authorized():
            return
        if self.path.rstrip("/") != "/v1/models":
            return self._error(404, f"no route {self.path}")
        fault = self.engine.listing_fault
        if fault is not None and fault.kind == "stall":
            self.engine._closing.wait(fault.seconds or None)
            self.close_connection = True
            return None
        if fault is not None:
            return self._answer(fault)
        data = [{"id": m, "object": "model", "owned_by": "fake", **self.engine.listing} for m in self.engine.models]
        self._json(200, {"object": "list", "data": data})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        self._record(body)
        if not self._authorized():
            return
        if self.path != "/v1/chat/completions":
            return self._error(404, f"no route {self.path}")
        if body.get("model") not in self.engine.models:
            return self._error(404, f"The model `{body.get('model')}` does not exist.")
        item = self.engine._next(body)
        if isinstance(item, Fault) and item.kind in ("status", "body"):
            return self._answer(item)
        self._count_in_flight(+1)
        try:
            self._start_stream()
            if isinstance(item, Reply):
                self._stream(item, body)
            elif item.kind == "events":
                self._stream(Reply(item.content), body, raw=item.body)
            elif item.kind == "endless":
                self._endless(item, body)
            else:
                self._fail_midway(item, body)
        except OSError:  # the client closed the stream (as it does to stop an endless one)
            self.close_connection = True
        finally:
            self._count_in_flight(-1)

    def _count_in_flight(self, change: int) -> None:
        with self.engine._lock:
            self.engine._in_flight += change
            self.engine.peak_in_flight = max(self.engine.peak_in_flight, self.engine._in_flight)

    # -- replies ----------------------------------------------------------------------------

    def _stream(self, reply: Reply, body: dict[str, Any], *, raw: str = "") -> None:
        model = body["model"]
        deadline = time.monotonic() + GATE_WAIT_S
        while self.engine.peak_in_flight < reply.together and time.monotonic() < deadline:
            if self.engine._closing.wait(0.01):
                break
        for piece in _pieces(reply.reasoning, reply.chunk):
            self._event(_chunk(model, {"reasoning_content": piece}))
        for piece in _pieces(reply.content, reply.chunk):
            self._event(_chunk(model, {"content": piece}))
            self.engine._closing.wait(reply.pause)
        if raw:
            self._send_chunk(raw.encode(errors="surrogateescape"))
        for index, call in enumerate(reply.tool_calls):
            arguments = call.get("arguments", {})  # a string is sent as it is (e.g. not JSON)
            arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
            head = {"index": index, "id": f"call_fake_{index}", "type": "function"}
            self._event(_chunk(model, {"tool_calls": [{**head, "function": {"name": call["name"], "arguments": ""}}]}))
            for piece in _pieces(arguments, max(1, len(arguments) // 3)):
                self._event(_chunk(model, {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}))
        self._event(_chunk(model, {}, reply.finish_reason))
        if (body.get("stream_options") or {}).get("include_usage"):
            prompt = reply.prompt_tokens if reply.prompt_tokens is not None else len(json.dumps(body)) // 4
            completion = reply.completion_tokens
            if completion is None:
                completion = len(_pieces(reply.content, 1)) // 4 + 8 * len(reply.tool_calls) + 1
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": reply.cached_tokens},
            }
            self._event({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "choices": [], "usage": usage})
        self._send_chunk(b"data: [DONE]\n\n")
        self._send_chunk(b"")

    def _endless(self, fault: Fault, body: dict[str, Any]) -> None:
        while not self.engine._closing.is_set():
            if fault.content:
                self._event(_chunk(body["model"], {"content": fault.content}))
            else:
                self._send_chunk(b": keep-alive\n\n")
            self.engine._closing.wait(fault.seconds)

    def _fail_midway(self, fault: Fault, body: dict[str, Any]) -> None:
        for piece in _pieces(fault.content, 4):
            self._event(_chunk(body["model"], {"content": piece}))
        if fault.kind == "stall":
            self.engine._closing.wait(fault.seconds)
        if fault.kind == "error":
            self._event({"error": {"message": fault.message, "type": "InternalServerError", "code": 500}})
        # No final chunk and no terminating zero-length chunk: the client sees the body cut.
        self.close_connection = True

    # -- HTTP ---------------------------------------------------------------------------------

    def _record(self, body: dict[str, Any] | None) -> None:
        headers = {k.lower(): v for k, v in self.headers.items()}
        with self.engine._lock:
            self.engine.requests.append(Recorded(self.command, self.path, headers, body))

    def _authorized(self) -> bool:
        key = self.engine.api_key
        if key is None or self.headers.get("Authorization") == f"Bearer {key}":
            return True
        self._error(401, "Incorrect API key provided.")
        return False

    def _answer(self, fault: Fault) -> None:
        if fault.kind == "status":
            return self._error(fault.status, fault.message, fault.headers)
        payload = fault.body.encode()
        self.send_response(fault.status)
        self.send_header("Content-Type", fault.content_type)
        self.send_header("Content-Length", str(len(payload)))
        for name, value in fault.headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)
        return None

    def _error(self, status: int, message: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        self._json(status, {"error": {"message": message, "type": "error", "code": status}}, headers)

    def _json(self, status: int, data: dict[str, Any], headers: tuple[tuple[str, str], ...] = ()) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()

    def _event(self, data: dict[str, Any]) -> None:
        self._send_chunk(f"data: {json.dumps(data)}\n\n".encode())

    def _send_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def _chunk(model: str, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]
