"""OAuth for MCP servers over HTTP: sign in once (`subagent mcp-servers login NAME`), then every run
uses the tokens, refreshed as they expire.

The SDK's `OAuthClientProvider` does the protocol: discovery (the server's protected resource
metadata, its authorization server's metadata), dynamic client registration, the authorization code
flow with PKCE, the token exchange and refresh, and scope step-up. This module gives it:

- a `TokenStore`: the tokens and the registered client, one file per server (its name and URL) in
  `$MLX_SUBAGENTS_HOME/mcp-auth/`, readable by its owner only (0600, in a 0700 folder), with the time
  the tokens expire, so that a later process refreshes an expired token instead of presenting it;
- the redirect: `login` listens on a loopback port (`http://127.0.0.1:PORT/callback`; the port is kept
  with the registered client, so its redirect URI stays the one registered), prints the address to
  open, and waits for the authorization server to send the browser back with the code;
- in a run, a sign-in happens only with a person there: in a chat, a call that needs a new sign-in
  (a scope step-up) shows the person the address and waits for the browser to come back. Elsewhere a
  server whose token is missing, or refused and not refreshable, is one line: `MCP server 'NAME'
  needs a sign-in: run subagent mcp-servers login NAME`.

Client ID metadata documents (SEP-991) need the client's metadata at a public HTTPS address, which a
tool on a laptop does not have: the client registers itself (DCR), or uses the client id given to
`login --client-id` (a pre-registered client).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx2
import mcp_types as types
from mcp.client.auth import AuthorizationCodeResult, OAuthClientProvider
from mcp.shared.auth import OAuthClientInformationFull, OAuthClientMetadata, OAuthMetadata, OAuthToken

from ..deadlines import within
from ..errors import McpAuthError, SubagentError
from ..home import make_state_dir, state_home, write_whole
from ..text import one_line
from ..userfiles import read_text
from .mcp_requests import Person

AUTH_DIR = "mcp-auth"
CALLBACK_PATH = "/callback"
# How long a sign-in waits for the browser to come back.
SIGN_IN_WAIT_S = 300.0
DONE_PAGE = "<html><body><p>Signed in to the MCP server {name}; you can close this page.</p></body></html>"
# The SDK logs every failed flow with its traceback, then raises: the raise is said in one line here.
logging.getLogger("mcp.client.auth.oauth2").addFilter(lambda record: record.getMessage() != "OAuth flow error")


def sign_in_line(name: str, refused: bool) -> str:
    """What a run says about a server it cannot sign in to."""
    why = "refused its token (it expired and could not be refreshed, or was revoked)" if refused else "needs a sign-in"
    return f"MCP server '{name}' {why}: run `subagent mcp-servers login {name}`"


class TokenStore:
    """One server's tokens and registered client, kept in the state folder (the SDK's `TokenStorage`)."""

    def __init__(self, name: str, url: str, home: Path | None = None) -> None:
        self.name, self.url = name, url
        digest = hashlib.sha256(url.encode()).hexdigest()[:12]  # a server of that name elsewhere is another
        self.path = (home or state_home()) / AUTH_DIR / f"{name}-{digest}.json"
        self.tokens: OAuthToken | None = None
        self.client: OAuthClientInformationFull | None = None
        self.expires_at: float | None = None
        # The authorization server that issued them (its metadata: where a refresh goes) and its address.
        self.server_metadata: OAuthMetadata | None = None
        self.issuer: str | None = None
        self.provider: OAuthClientProvider | None = None  # the provider writing here: its metadata is kept
        self.refused = False  # the tokens were refused (a refresh failed): a sign-in is needed
        self._read()

    def _read(self) -> None:
        try:
            data = json.loads(read_text(self.path, "MCP sign-in file", SubagentError))
            if data.get("url") != self.url:
                return
            self.tokens = OAuthToken.model_validate(data["tokens"]) if data.get("tokens") else None
            self.client = OAuthClientInformationFull.model_validate(data["client"]) if data.get("client") else None
            self.expires_at = data.get("expires_at")
            metadata = data.get("authorization_server")
            self.server_metadata = OAuthMetadata.model_validate(metadata) if metadata else None
            self.issuer = data.get("issuer")
        except (SubagentError, ValueError, KeyError, TypeError):  # none yet, or damaged: a sign-in writes it again
            self.tokens = self.client = self.expires_at = self.server_metadata = self.issuer = None

    def _write(self) -> None:
        data = {
            "server": self.name,
            "url": self.url,
            "tokens": self.tokens.model_dump(mode="json", exclude_none=True) if self.tokens else None,
            "expires_at": self.expires_at,
            "client": self.client.model_dump(mode="json", exclude_none=True) if self.client else None,
            "authorization_server": self.server_metadata.model_dump(mode="json", exclude_none=True)
            if self.server_metadata
            else None,
            "issuer": self.issuer,
        }
        make_state_dir(self.path.parent)
        os.chmod(self.path.parent, 0o700)
        write_whole(self.path, json.dumps(data, indent=1), private=True)

    @property
    def redirect_uri(self) -> str | None:
        """The redirect URI the stored client was registered with."""
        uris = self.client.redirect_uris if self.client else None
        return str(uris[0]) if uris else None

    @property
    def port(self) -> int:
        """The loopback port of the stored client's redirect URI (0: none yet)."""
        uri = self.redirect_uri
        return (urlparse(uri).port or 0) if uri else 0

    def forget(self, *, client: bool = False) -> None:
        """Drop the tokens (a new sign-in), and the registered client too with `client`."""
        self.tokens, self.expires_at = None, None
        if client:
            self.client = None
        self._write()

    # -- TokenStorage ------------------------------------------------------------------------------------

    async def get_tokens(self) -> OAuthToken | None:
        return self.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self.tokens = tokens
        self.expires_at = time.time() + tokens.expires_in if tokens.expires_in else None
        if self.provider is not None and self.provider.context.oauth_metadata is not None:
            self.server_metadata = self.provider.context.oauth_metadata
            self.issuer = self.provider.context.auth_server_url
        self._write()

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.client

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.client = client_info
        self._write()


class StoredOAuth(OAuthClientProvider):
    """The SDK's provider, knowing what it learnt in the process that signed in: when the tokens expire
    and which authorization server issued them (where a refresh goes), so that a later process
    refreshes an expired token at the right place before it presents one."""

    def __init__(self, store: TokenStore, **kwargs: Any) -> None:
        super().__init__(storage=store, **kwargs)
        self.store = store
        store.provider = self

    async def _initialize(self) -> None:
        await super()._initialize()
        self.context.token_expiry_time = self.store.expires_at
        if self.context.oauth_metadata is None and self.store.server_metadata is not None:
            self.context.oauth_metadata = self.store.server_metadata
            self.context.auth_server_url = self.store.issuer

    async def _handle_refresh_response(self, response: httpx2.Response) -> bool:
        refreshed = await super()._handle_refresh_response(response)
        if not refreshed:  # never tried again: the next request needs a sign-in
            self.store.refused = True
            self.store.forget()
        return refreshed


class RunOAuth(StoredOAuth):
    """A run's provider: when the server asks for a sign-in and nobody can do one (`can_sign_in`), the
    request fails at once with the one line, before any registration or discovery is done for nothing."""

    def __init__(self, store: TokenStore, can_sign_in: Callable[[], bool], **kwargs: Any) -> None:
        super().__init__(store, **kwargs)
        self.can_sign_in = can_sign_in

    async def async_auth_flow(self, request: httpx2.Request) -> Any:
        flow = super().async_auth_flow(request)
        try:
            outgoing = await flow.__anext__()
            while True:
                response = yield outgoing
                if outgoing is request and wants_sign_in(response) and not self.can_sign_in():
                    refused = self.store.tokens is not None or self.store.refused
                    raise McpAuthError(sign_in_line(self.store.name, refused=refused))
                outgoing = await flow.asend(response)
        except StopAsyncIteration:
            return
        finally:
            await flow.aclose()


def wants_sign_in(response: httpx2.Response) -> bool:
    """A 401, or a 403 asking for more scope: what starts the SDK's sign-in."""
    insufficient = response.status_code == 403 and "insufficient_scope" in response.headers.get("www-authenticate", "")
    return response.status_code == 401 or insufficient


class Callback:
    """The loopback address an authorization server sends the browser back to, with the code."""

    def __init__(self, port: int = 0, name: str = "") -> None:
        self.port = port
        self.name = name
        self._server: asyncio.Server | None = None
        self._result: asyncio.Future[AuthorizationCodeResult] = asyncio.get_running_loop().create_future()

    @property
    def redirect_uri(self) -> str:
        return f"http://127.0.0.1:{self.port}{CALLBACK_PATH}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._answer, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def result(self, timeout: float = SIGN_IN_WAIT_S) -> AuthorizationCodeResult:
        """The code the browser brings back; a second authorization in the same sign-in (the server moved to
        another authorization server, more scope) waits for the browser's next return, not this one."""
        try:
            return await within(asyncio.shield(self._result), timeout)
        except asyncio.TimeoutError:
            raise McpAuthError(
                f"MCP server '{self.name}': the browser did not come back to {self.redirect_uri} within {timeout:g} s"
            ) from None
        finally:
            if self._result.done():
                self._result = asyncio.get_running_loop().create_future()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = (await within(reader.readline(), 10)).decode("latin-1").split()
            while (await within(reader.readline(), 10)).strip():
                pass  # the headers: nothing in them is needed
            url = urlparse(line[1] if len(line) > 1 else "/")
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            if url.path != CALLBACK_PATH or not ("code" in query or "error" in query):
                status, page = "404 Not Found", "<html><body><p>Not the sign-in address.</p></body></html>"
            else:
                status, page = "200 OK", DONE_PAGE.format(name=self.name)
                self._settle(query)
            body = page.encode()
            head = f"HTTP/1.1 {status}\r\nContent-Type: text/html; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
            writer.write(head.encode() + b"Connection: close\r\n\r\n" + body)
            await writer.drain()
        except (OSError, asyncio.TimeoutError, UnicodeError):
            pass
        finally:
            writer.close()

    def _settle(self, query: dict[str, str]) -> None:
        if self._result.done():
            return
        if "error" in query:
            what = one_line(query.get("error_description") or query["error"], 200)
            self._result.set_exception(McpAuthError(f"MCP server '{self.name}': the sign-in was refused ({what})"))
        else:
            self._result.set_result(
                AuthorizationCodeResult(code=query["code"], state=query.get("state"), iss=query.get("iss"))
            )


def client_metadata(redirect_uri: str) -> OAuthClientMetadata:
    return OAuthClientMetadata(
        client_name="mlx-subagents",
        redirect_uris=[redirect_uri],  # type: ignore[list-item]
        grant_types=["authorization_code", "refresh_token"],
        response_types=["code"],
    )


def has_authorization(headers: tuple[tuple[str, str], ...]) -> bool:
    """Whether the server's definition sends its own `Authorization` header (then no OAuth)."""
    return any(key.lower() == "authorization" for key, _ in headers)


def run_auth(name: str, url: str, person: Callable[[], Person | None]) -> httpx2.Auth:
    """The OAuth of a server in a run: the stored tokens, refreshed; a new sign-in only when `person()`
    is someone (a chat), else one line saying to run `login`."""
    store = TokenStore(name, url)
    callback: list[Callback] = []

    async def redirect(address: str) -> None:
        someone = person()
        if someone is None or not store.redirect_uri:
            raise McpAuthError(sign_in_line(name, refused=store.tokens is not None or store.refused))
        back = Callback(store.port, name)
        await back.start()
        callback.append(back)
        ask = types.ElicitRequestURLParams(
            message=f"sign in to the MCP server {name} (it asks for more access); open the address, then come back",
            url=address,
            elicitation_id="sign-in",
        )
        answer = await someone.elicit(name, ask)
        if answer.action != "accept":
            await back.close()
            raise McpAuthError(f"MCP server '{name}': the sign-in was not done ({answer.action})")

    async def came_back() -> AuthorizationCodeResult:
        back = callback.pop()
        try:
            return await back.result()
        finally:
            await back.close()

    return RunOAuth(
        store,
        lambda: person() is not None and bool(store.redirect_uri),
        server_url=url,
        client_metadata=client_metadata(store.redirect_uri or f"http://127.0.0.1:0{CALLBACK_PATH}"),
        redirect_handler=redirect,
        callback_handler=came_back,
    )


async def login(
    name: str,
    url: str,
    headers: dict[str, str],
    say: Callable[[str], None],
    *,
    client_id: str | None = None,
    client_secret: str | None = None,
    callback_port: int | None = None,
    timeout: float = SIGN_IN_WAIT_S,
) -> str:
    """Sign in to a server now: print the address to open, wait for the browser to come back, save
    the tokens. Returns what to tell the person; a failure raises `McpAuthError` (one line)."""
    store = TokenStore(name, url)
    back = await _listen(name, callback_port or store.port, fixed=callback_port is not None)
    try:
        if client_id:
            method = "client_secret_basic" if client_secret else "none"
            registered = OAuthClientInformationFull(
                client_id=client_id,
                client_secret=client_secret,
                redirect_uris=[back.redirect_uri],  # type: ignore[list-item]
                token_endpoint_auth_method=method,
            )
            await store.set_client_info(registered)
        store.forget(client=store.redirect_uri != back.redirect_uri)  # another port: register again

        async def show(address: str) -> None:
            say(f"open this address in a browser to sign in to {name}:\n{address}")
            say(f"waiting for the browser to come back to {back.redirect_uri} (Ctrl-C stops)")

        auth = StoredOAuth(
            store,
            server_url=url,
            client_metadata=client_metadata(back.redirect_uri),
            redirect_handler=show,
            callback_handler=lambda: back.result(timeout),
        )
        await _connect(url, headers, auth)
    finally:
        await back.close()
    if store.tokens is None:
        return f"MCP server '{name}' did not ask for a sign-in; nothing was saved"
    expiry = f", valid for {store.tokens.expires_in // 60} min and refreshed after" if store.tokens.expires_in else ""
    return f"signed in to MCP server '{name}'{expiry}; the tokens are in {store.path}"


async def _listen(name: str, port: int, *, fixed: bool) -> Callback:
    """The callback listener on `port` (the registered one), else on any port unless it was asked for."""
    back = Callback(port, name)
    try:
        await back.start()
    except OSError as exc:
        if fixed or not port:
            raise McpAuthError(f"cannot listen on 127.0.0.1:{port} for the sign-in: {exc}") from None
        back = Callback(0, name)
        await back.start()
    return back


async def _connect(url: str, headers: dict[str, str], auth: httpx2.Auth) -> None:
    """Connect and list the tools with `auth`, as a run does (either revision: `server/discover` first,
    else the 2025 handshake), so that every sign-in they need happens."""
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    try:
        async with httpx2.AsyncClient(auth=auth, headers=headers, timeout=httpx2.Timeout(30, read=300)) as http:
            async with Client(streamable_http_client(url, http_client=http), mode="auto", cache=None) as client:
                await client.list_tools()
    except McpAuthError:
        raise
    except BaseException as exc:
        inner = exc
        while isinstance(group := getattr(inner, "exceptions", None), tuple) and group:
            inner = group[0]
        if isinstance(inner, McpAuthError):
            raise inner from None
        if isinstance(inner, (KeyboardInterrupt, asyncio.CancelledError)):
            raise
        raise McpAuthError(f"the sign-in failed: {type(inner).__name__}: {one_line(str(inner), 300)}") from None


__all__ = ["Callback", "StoredOAuth", "TokenStore", "has_authorization", "login", "run_auth", "sign_in_line"]
