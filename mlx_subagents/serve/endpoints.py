"""The OpenAI- and Anthropic-compatible endpoints of `subagent serve`, on its HTTP port.

`POST /v1/chat/completions` (OpenAI), `POST /v1/messages` and `POST /v1/messages/count_tokens`
(Anthropic), `GET /v1/models` (either's shape, by the `anthropic-version` header). Each chat request
is a turn of a host session of the server's resident models (`chat_turn.py`), in the batch with the
agents' sessions, under the one KV budget; a request that goes on from an earlier one goes on in its
session, so its KV is reused (`conversations.py`). The guard in front (`http_app.py`) has checked the
token and the Host and Origin; here every bad request gets one error in its API's shape, and a client
that goes away has its turn cancelled at once.

The clients are told apart by their API and `User-Agent` (Claude Code, an SDK, an editor): each is a
client of the server, listed with its conversations by `subagent serve --status`. A `User-Agent` is
whatever a caller sends, so the table is bounded (`MAX_API_CLIENTS`): past it, the client idle the
longest is forgotten (its conversations stay; a later request of it is a client again).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from starlette.types import Receive, Scope, Send

from ..host.kv.budget import total_memory
from ..host.protocol import ModelHost
from ..models.catalog import ModelInfo, list_models
from ..runs.tasks import ModelRef
from ..text import squash
from .anthropic_api import count_tokens_request, parse_messages
from .api_errors import Api, ApiError
from .asgi_io import Disconnect, EventStream, read_json, send_json
from .chat_turn import ChatTurn, Event, Finished, TurnRun, start_turn
from .conversations import Conversations
from .openai_api import parse_chat

if TYPE_CHECKING:
    from .clients import Client

# The running `service.Service` (not imported: it imports this module).
Service = Any
ROUTES = {
    ("POST", "/v1/chat/completions"): "openai",
    ("POST", "/v1/messages"): "anthropic",
    ("POST", "/v1/messages/count_tokens"): "anthropic",
    ("GET", "/v1/models"): "openai",
}
# `GET /v1/models/NAME`: one model, as the list has it (the SDKs' `models.retrieve`).
MODEL_PATH = "/v1/models/"
PATHS = ", ".join(f"{method} {path}" for method, path in ROUTES) + f", GET {MODEL_PATH}NAME"
# Endpoint clients (API and User-Agent) kept at once; past it the least recently used idle one goes.
MAX_API_CLIENTS = 64

log = logging.getLogger("mlx_subagents.serve")

SseEvent = tuple[str | None, Any]  # (its name, or None, and its data)


class Shape(Protocol):
    """How one API writes a turn: whole, or as server-sent events."""

    turn: ChatTurn

    def whole(self, finished: Finished) -> dict[str, Any]: ...

    def on(self, event: Event) -> list[SseEvent]: ...

    def end(self) -> list[SseEvent]: ...

    def error(self, error: ApiError) -> list[SseEvent]: ...


Parse = Callable[[dict[str, Any]], Shape]


def api_of(path: str) -> Api:
    """Which API's shape a path's answers (and errors) take."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


class ApiFront:
    """The endpoints: the ASGI app for every path under /v1/, over the server's host pool."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.conversations = Conversations(service.pool.session_names)
        self.clients: OrderedDict[tuple[str, str], Client] = OrderedDict()  # least recently used first
        self._parsers: dict[str, Parse] = {"/v1/chat/completions": parse_chat, "/v1/messages": parse_messages}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"].rstrip("/"), scope["method"]
        shown = squash(path)  # a path's line breaks (%0a) break no message's one line, forge no log line
        anthropic = "anthropic-version" in _headers(scope)
        api: Api = "anthropic" if anthropic and path.startswith("/v1/models") else api_of(path)
        try:
            if method == "GET" and path.startswith(MODEL_PATH):
                await send_json(send, 200, await self.model(path.removeprefix(MODEL_PATH), anthropic=anthropic))
            elif (method, path) not in ROUTES:
                methods = [m for m, p in ROUTES if p == path]
                if methods:
                    raise ApiError(405, f"{method} {shown} is not served; use {' or '.join(methods)}")
                raise ApiError(404, f"not found: {method} {shown}; this server serves {PATHS}")
            elif path == "/v1/models":
                await send_json(send, 200, await self.models(anthropic=anthropic))
            elif path == "/v1/messages/count_tokens":
                await send_json(send, 200, await self.count_tokens(await read_json(scope, receive)))
            else:
                await self.answer(api, self._parsers[path], scope, receive, send)
        except ApiError as exc:
            log.warning("HTTP %s %s answered %d: %s", method, shown, exc.status, squash(exc.message))
            # A body refused unread (413) is still owed on the connection: kept alive, what the client sends
            # next (its next request, when it sent no body) would be read as that body. It closes instead.
            close = {"Connection": "close"} if exc.status == 413 else None
            await send_json(send, exc.status, exc.body(api), close)

    # -- models ------------------------------------------------------------------------------------

    async def models(self, *, anthropic: bool) -> dict[str, Any]:
        """The resident models, then the local ones (`subagent models`), by the names requests use."""
        names = await self.model_names()
        data = [self._entry(n, anthropic=anthropic) for n in names]
        if anthropic:
            return {
                "data": data,
                "has_more": False,
                "first_id": names[0] if names else None,
                "last_id": names[-1] if names else None,
            }
        return {"object": "list", "data": data}

    async def model(self, name: str, *, anthropic: bool) -> dict[str, Any]:
        """One model of the list, by its name."""
        names = await self.model_names()
        if name not in names:
            raise _not_served(name, names)
        return self._entry(name, anthropic=anthropic)

    def _entry(self, name: str, *, anthropic: bool) -> dict[str, Any]:
        if anthropic:
            return {"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"}
        return {"id": name, "object": "model", "created": int(self.service.started), "owned_by": "mlx-subagents"}

    async def model_names(self) -> list[str]:
        return self._names(await asyncio.to_thread(list_models))

    def _names(self, local: list[ModelInfo]) -> list[str]:
        """The resident models, the server's `--model`, then the local ones (`local`: the catalog)."""
        resident = [str(ref) for ref in self.service.pool.hosts]
        default = self.service.config.options.model
        return list(dict.fromkeys([*resident, *([default] if default else []), *(m.name for m in local)]))

    async def host_for(self, model: str) -> ModelHost:
        """The resident host of `model` (a local model is loaded now, within the one KV budget)."""
        pool = self.service.pool
        for ref, host in list(pool.hosts.items()):
            if model in (str(ref), host.model_id):
                return await pool.get(ref)
        local = await asyncio.to_thread(list_models)  # once: its folders are read again at each listing
        names = self._names(local)
        if model and model in names:
            self._check_fits(model, local)
            return await pool.get(ModelRef(model))
        raise _not_served(model, names)

    def _check_fits(self, model: str, local: list[ModelInfo]) -> None:
        """Refuse a local model whose weights do not fit in RAM beside the models the server holds: a model
        loaded stays resident, so a client naming every local model in turn would have it hold them all."""
        ram = total_memory()
        info = next((m for m in local if model in (m.name, m.path)), None)
        if not ram or info is None:
            return
        held = sum(
            weights()
            for h in self.service.pool.hosts.values()
            if callable(weights := getattr(h, "weights_bytes", None))
        )
        if info.size_bytes + held > ram:
            raise ApiError(
                503,
                f"model {model!r} ({info.size_bytes / 2**30:.1f} GiB of weights) does not fit beside the models this "
                f"server holds ({held / 2**30:.1f} GiB) in this machine's {ram / 2**30:.1f} GiB of RAM; name a model it "
                f"holds, or restart it with --model {model}",
                "model",
            )

    # -- turns ---------------------------------------------------------------------------------------

    def client(self, api: Api, scope: Scope) -> Client:
        """The client a request comes from: one per API and `User-Agent`; a new one past `MAX_API_CLIENTS`
        forgets the one idle the longest (none answered now)."""
        agent = _headers(scope).get("user-agent", "")
        key = (api, agent)
        if key not in self.clients:
            idle = [k for k, c in self.clients.items() if not c.serving]
            for old in idle[: max(0, len(self.clients) + 1 - MAX_API_CLIENTS)]:
                self.service.clients.remove(self.clients.pop(old))
            self.clients[key] = self.service.add_client(api, self.service.client_options({}), name=agent or api)
        self.clients.move_to_end(key)
        return self.clients[key]

    async def answer(self, api: Api, parse: Parse, scope: Scope, receive: Receive, send: Send) -> None:
        """One chat request: parsed, run as a turn, answered whole or streamed; cancelled if its client goes."""
        shape = parse(await read_json(scope, receive))
        host = await self.host_for(shape.turn.model)
        client = self.client(api, scope)
        run = await start_turn(host, shape.turn, self.conversations, api, client.id)
        client.serving += 1
        gone = Disconnect(receive)
        try:
            first = await _next(run, gone)
            if first is None:
                return
            if shape.turn.stream:
                await self._stream(shape, run, first, gone, send)
                return
            while not isinstance(first, Finished):
                first = await _next(run, gone)
                if first is None:
                    return
            await send_json(send, 200, shape.whole(first))
        finally:
            client.serving -= 1
            run.cancel()
            gone.stop()

    async def _stream(self, shape: Shape, run: TurnRun, event: Event | None, gone: Disconnect, send: Send) -> None:
        out = EventStream(send)
        await out.open()
        try:
            while event is not None:
                for name, data in shape.on(event):
                    await out.event(data, name)
                if isinstance(event, Finished):
                    break
                event = await _next(run, gone)
            if event is None:
                return  # gone: nobody to write to
            events = shape.end()
        except ApiError as exc:  # after the answer began: in the stream, as the API sends errors there
            events = shape.error(exc)
        for name, data in events:
            await out.event(data, name)
        await out.close()

    async def count_tokens(self, body: dict[str, Any]) -> dict[str, int]:
        """`POST /v1/messages/count_tokens`: the prompt's tokens as this model renders it."""
        turn = count_tokens_request(body)
        host = await self.host_for(turn.model)
        return {"input_tokens": await host.count_tokens(turn.messages, turn.tools, thinking=turn.thinking)}

    def summaries(self) -> list[dict[str, Any]]:
        """The endpoints' conversations, for `--status`."""
        return self.conversations.summaries()


async def _next(run: TurnRun, gone: Disconnect) -> Event | None:
    """The turn's next event, or None once its client has gone (the turn is then cancelled)."""
    event = asyncio.ensure_future(run.next())
    left = asyncio.ensure_future(gone.gone.wait())
    try:
        await asyncio.wait([event, left], return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
    if event.done():
        return event.result()
    event.cancel()
    run.cancel()
    return None


def _not_served(model: str, names: list[str]) -> ApiError:
    served = ", ".join(names) or "none"
    return ApiError(
        404,
        f"model {model!r} is not served here (GET /v1/models lists them: {served}); name one of them",
        "model",
        "model_not_found",
    )


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


__all__ = ["ApiFront", "PATHS", "Shape", "api_of"]
