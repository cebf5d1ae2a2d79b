"""The server's HTTP side: MCP over streamable HTTP at `http://127.0.0.1:PORT/mcp`, for clients set up
with a URL, and the OpenAI- and Anthropic-compatible chat endpoints under `/v1/` (`endpoints.py`).

The SDK's session manager serves MCP; every request passes `Guard` first:

- its `Host` and `Origin` must be this server's (127.0.0.1, localhost or [::1] at its port, in any
  case), checked with the SDK's `TransportSecuritySettings`, so that a web page a browser was tricked
  into sending here (DNS rebinding) is refused: 403, saying which header;
- it must carry the bearer token (`Authorization: Bearer TOKEN`; on /mcp also `?token=TOKEN` for a
  client that cannot set headers; under /v1/ also `x-api-key: TOKEN`, never in the URL): 401
  otherwise, naming the token file.

Each MCP session is a client of its own (`clients.py`): the tools are `AgentsServer`'s, one per
session, found through the session's connection. Its workspace is its first root, else the URL's
`?cwd=FOLDER`, else the server's `--cwd`; `?yes=1` allows the workspace's project agents for that
session only. A session ends when its client deletes it or after `IDLE_TIMEOUT_S` without a
request; its calls in progress are then cancelled and saved, its background tasks run on.

A 2026-07-28 request (the SDK routes it by its `MCP-Protocol-Version` header) has no session: the
requests for one workspace (`?cwd=`, `?yes=`) share one client, and the calls answered with an MCP
task are the service's, so any later connection reads a task by its id.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h11
import mcp_types as types
import uvicorn
from mcp.server import ServerRequestContext
from mcp.server.streamable_http import MCP_SESSION_ID_HEADER
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..deadlines import within
from ..errors import SubagentError
from ..mcp_server.server import AgentsServer, make_server
from ..text import squash
from .api_errors import ApiError
from .asgi_io import send_json
from .clients import DISCONNECTED
from .endpoints import ApiFront, api_of
from .lingering import LingeringTransport

if TYPE_CHECKING:
    from .clients import Client

# The running `service.Service` (not imported: it imports this module).
Service = Any

PATH = "/mcp"
API_PREFIX = "/v1/"  # the OpenAI- and Anthropic-compatible endpoints (`endpoints.py`)
# A session nobody has sent a request for this long is ended (its client is taken for gone).
IDLE_TIMEOUT_S = 8 * 3600.0
GRACEFUL_S = 3
# At most this many HTTP connections at once, whoever opens them: the rest of the process's descriptors
# stay for the socket's clients (the owner's own front ends) and the agents' tools, so that another
# user holding idle connections never starves them (`raise_descriptor_limit` raises the rest).
MAX_HTTP_CONNECTIONS = 256
MAX_DESCRIPTORS = 65536
CLIENT_KEY = "mlx_subagents.client"
YES = {"1", "true", "yes"}

log = logging.getLogger("mlx_subagents.serve")


def security_settings(port: int) -> TransportSecuritySettings:
    """The only Host and Origin values a request may carry: this machine's loopback names at `port`."""
    names = ("127.0.0.1", "localhost", "[::1]")
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=[f"{n}:{port}" for n in names],
        allowed_origins=[f"http://{n}:{port}" for n in names],
    )


class Guard:
    """Refuses what is not for this server before the MCP transport or the chat endpoints see it:
    another path (404), a foreign Host or Origin (403), no token or a wrong one (401). Under /v1/ the
    refusal is a JSON error in the API's shape (`api_errors.py`), and the token may also come as
    `x-api-key` (what Anthropic clients send); those paths go to `api`, the rest to `app`."""

    def __init__(
        self, app: ASGIApp, api: ASGIApp, token: str, port: int, token_file: Path, on_delete: Callable[[str], None]
    ) -> None:
        self.app = app
        self.api = api
        self.on_delete = on_delete
        self.token = token
        self.port = port
        self.token_file = token_file
        self.security = TransportSecurityMiddleware(security_settings(port))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chat = scope["path"].startswith(API_PREFIX)
        scope = _names_lowered(scope)
        refusal = await self.refusal(Request(scope), chat)
        if refusal is not None:
            status, text = refusal
            log.warning("HTTP %s %s refused (%d): %s", scope.get("method"), squash(scope["path"]), status, text)
            headers = {"WWW-Authenticate": 'Bearer realm="mlx-subagents"'} if status == 401 else None
            if chat:
                await send_json(send, status, ApiError(status, text).body(api_of(scope["path"])), headers)
            else:
                await PlainTextResponse(f"{status}: {text}\n", status_code=status, headers=headers)(
                    scope, receive, send
                )
            return
        if chat:
            await self.api(scope, receive, send)
            return
        if scope.get("method") == "DELETE" and (session := Request(scope).headers.get(MCP_SESSION_ID_HEADER)):
            self.on_delete(session)  # the client ends its session: its calls say why they stop

        async def logged(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:  # malformed, too large, ...
                log.warning("HTTP %s %s answered %d", scope.get("method"), squash(scope["path"]), message["status"])
                if message["status"] == 413:  # the SDK refused the body unread: the connection still owes it
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, logged)

    async def refusal(self, request: Request, chat: bool = False) -> tuple[int, str] | None:
        """(status, the reason in one line) for a request to refuse; None to let it through."""
        if request.url.path != PATH and not chat:
            return 404, f"not found: the MCP endpoint is {PATH}, the chat endpoints are under {API_PREFIX}"
        checked = await self.security.validate_request(request, is_post=False)
        if checked is not None:
            which = "Host" if checked.status_code == 421 else "Origin"
            value = request.headers.get(which.lower(), "")
            return 403, (
                f"forbidden: the {which} header {value!r} is not this server's (127.0.0.1, localhost or [::1] at port "
                f"{self.port}); it answers only clients on this machine"
            )
        given = request.headers.get("x-api-key") if chat else None
        given = bearer(request, query=not chat) or given
        if given is None:
            return (
                401,
                f"unauthorized: no bearer token; send 'Authorization: Bearer TOKEN' with the token in {self.token_file}",
            )
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            return 401, f"unauthorized: wrong token; the token is in {self.token_file}"
        return None


def bearer(request: Request, query: bool = True) -> str | None:
    """The token a request carries: its `Authorization: Bearer` header, else (with `query`) its `?token=`,
    which only the MCP endpoint takes: its clients may not set headers, the chat endpoints' all do."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return (request.query_params.get("token") or None) if query else None


def _names_lowered(scope: Scope) -> Scope:
    """`scope` with its Host and Origin in lower case, as the checks (the SDK's compare exactly) and the
    MCP transport after them see it: a host name and a scheme are case-insensitive (RFC 9110), so
    `Host: LOCALHOST:8421` is this server as much as `localhost:8421` is."""
    headers = [(k, v.lower() if k in (b"host", b"origin") else v) for k, v in scope.get("headers", [])]
    return {**scope, "headers": headers}


class HttpFront:
    """The tools for every HTTP session: each session's own `AgentsServer`, made at its first call."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.sessions: dict[str, Client] = {}  # the clients by their MCP session id
        # 2026-07-28 requests carry no session: one client per workspace asked for (`?cwd=`, `?yes=`).
        self.stateless: dict[tuple[str, bool], Client] = {}

    def ended(self, session_id: str) -> None:
        """A session's DELETE: its calls in progress are cancelled as the client's leaving."""
        client = self.sessions.pop(session_id, None)
        if client is not None:
            client.cancel(DISCONNECTED, background=False)

    def server(self) -> Any:
        return make_server(self.list_tools, self.call_tool, self.set_level, self.service.calls)

    async def list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return await self.agents(ctx).list_tools(ctx, params)

    async def call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult | dict[str, Any]:
        return await self.agents(ctx).call_tool(ctx, params)

    async def set_level(self, ctx: ServerRequestContext[Any], params: types.SetLevelRequestParams) -> types.EmptyResult:
        return await self.agents(ctx).set_level(ctx, params)

    def agents(self, ctx: ServerRequestContext[Any]) -> AgentsServer:
        """The session's tools; the first call makes its client, and the session's end is its disconnect.
        A 2026-07-28 request has no session: its tools are those of its workspace's stateless client."""
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
            return self._stateless(ctx)
        # The SDK keeps per-session state on the session's connection (`state`, and `exit_stack`, which
        # it unwinds when the session ends); a handler reaches it only through the session object.
        connection = ctx.session._connection  # mcp 2.3 has no public accessor
        client: Client | None = connection.state.get(CLIENT_KEY)
        if client is None:
            client = self._new_client(ctx)
            connection.state[CLIENT_KEY] = client
            if connection.session_id:
                self.sessions[connection.session_id] = client
            connection.exit_stack.push_async_callback(self._gone, connection.session_id, client)
        assert client.agents is not None
        return client.agents

    def _stateless(self, ctx: ServerRequestContext[Any]) -> AgentsServer:
        query = ctx.request.query_params if isinstance(ctx.request, Request) else {}
        key = (str(query.get("cwd", "")), str(query.get("yes", "")).lower() in YES)
        client = self.stateless.get(key)
        if client is None:
            client = self.stateless[key] = self._new_client(ctx)
        assert client.agents is not None
        return client.agents

    async def _gone(self, session_id: str | None, client: Client) -> None:
        self.sessions.pop(session_id or "", None)
        await self.service.disconnect(client)

    def _new_client(self, ctx: ServerRequestContext[Any]) -> Client:
        query = ctx.request.query_params if isinstance(ctx.request, Request) else {}
        options = self.service.client_options({})
        if str(query.get("yes", "")).lower() in YES:
            options = replace(options, assume_yes=True)
        named = query.get("cwd")
        client = self.service.mcp_client(
            "http", options, cwd=Path(named) if named else None, here=self.service.config.cwd
        )
        params = ctx.session.client_params
        if params is not None:
            client.name = f"{params.client_info.name} {params.client_info.version}".strip()
        return client


class CappedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol that closes a connection past `MAX_HTTP_CONNECTIONS` at once; said
    once in the log each time the limit is reached (a line per refusal would let a flood fill the log).
    A connection closed while its request's body is unread (a 413) lingers (`lingering.py`)."""

    refusing = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.lingering = LingeringTransport(transport, lambda: self.conn.their_state is h11.SEND_BODY)
        super().connection_made(self.lingering)  # type: ignore[arg-type]
        if len(self.connections) <= MAX_HTTP_CONNECTIONS:
            CappedH11.refusing = False
            return
        if not CappedH11.refusing:
            CappedH11.refusing = True
            log.warning("HTTP connections past %d are closed as they come, until some end", MAX_HTTP_CONNECTIONS)
        transport.abort()

    def data_received(self, data: bytes) -> None:
        if not self.lingering.lingering:  # what comes after is the unread body, or more: never a request
            super().data_received(data)


def raise_descriptor_limit() -> None:
    """Raise this process's soft limit of open files to its hard limit (at most `MAX_DESCRIPTORS`): 1,024
    is the usual soft default, which HTTP connections and the agents' commands share with the socket."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_DESCRIPTORS if hard == resource.RLIM_INFINITY else min(hard, MAX_DESCRIPTORS)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


class QuietServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the server's stop wiring is the one."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


class HttpServer:
    """The running HTTP side: uvicorn on a socket bound before the app was made (so its port is known)."""

    def __init__(self, server: QuietServer, task: asyncio.Task[None]) -> None:
        self.server = server
        self.task = task

    async def stop(self) -> None:
        self.server.should_exit = True
        try:
            await within(asyncio.shield(self.task), GRACEFUL_S + 2)
        except asyncio.TimeoutError:
            self.server.force_exit = True
            self.task.cancel()


def make_app(service: Service, port: int) -> ASGIApp:
    front = HttpFront(service)
    manager = StreamableHTTPSessionManager(
        app=front.server(),
        security_settings=security_settings(port),
        session_idle_timeout=IDLE_TIMEOUT_S,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        async with manager.run():
            yield

    # Route (not Mount: no /mcp -> /mcp/ redirect), its endpoint an ASGI object.
    app = Starlette(routes=[Route(PATH, endpoint=StreamableHTTPASGIApp(manager))], lifespan=lifespan)
    service.api = ApiFront(service)
    return Guard(app, service.api, service.token, port, service.paths.token, front.ended)


def bind_http(port: int) -> socket.socket:
    """A listening TCP socket on 127.0.0.1:`port`; a port in use is one line saying what to do."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as exc:
        sock.close()
        raise SubagentError(
            f"127.0.0.1:{port} cannot be used ({exc.strerror}); pass --port N, or --port 0 for any free port"
        ) from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def start_http(service: Service, port: int) -> tuple[HttpServer, str]:
    """Serve HTTP on 127.0.0.1:`port` (0: a free one); the running server and its URL."""
    raise_descriptor_limit()
    sock = bind_http(port)
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        make_app(service, port),
        http=CappedH11,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_S,
    )
    server = QuietServer(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it
            raise RuntimeError("the HTTP server stopped before it started")
        await asyncio.sleep(0.01)
    return HttpServer(server, task), f"http://127.0.0.1:{port}{PATH}"
