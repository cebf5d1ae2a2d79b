"""OAuth for MCP servers over HTTP (issue 45): the tokens kept owner-only in the state folder and
refreshed by a later process where the authorization server said, before one is presented. The
server and its authorization server are `httpx2.MockTransport` handlers; the whole flow against a
real mock (the conformance suite's) is in tests/mcp_server/test_conformance.py."""

from __future__ import annotations

import asyncio
import json
import stat
import time
from urllib.parse import parse_qs

import httpx2
from mcp.shared.auth import OAuthClientInformationFull, OAuthMetadata, OAuthToken

from mlx_subagents.home import state_home
from mlx_subagents.tools.mcp_auth import TokenStore, run_auth

URL = "http://mcp.test/mcp"


def test_tokens_are_kept_owner_only_and_an_expired_one_is_refreshed_where_it_was_issued() -> None:
    store = TokenStore("remote", URL)
    client = OAuthClientInformationFull(
        client_id="c1", redirect_uris=["http://127.0.0.1:5555/callback"], token_endpoint_auth_method="none"
    )
    asyncio.run(store.set_client_info(client))
    store.server_metadata = OAuthMetadata(
        issuer="http://auth.test",
        authorization_endpoint="http://auth.test/authorize",
        token_endpoint="http://auth.test/oauth/token",
    )
    asyncio.run(store.set_tokens(OAuthToken(access_token="old", expires_in=60, refresh_token="r1")))
    folder = state_home() / "mcp-auth"
    assert [p.name for p in folder.iterdir()] == [store.path.name] and store.path.name.startswith("remote-")
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600 and stat.S_IMODE(folder.stat().st_mode) == 0o700
    saved = json.loads(store.path.read_text())
    saved["expires_at"] = time.time() - 1  # it expired since
    store.path.write_text(json.dumps(saved))

    seen: list[tuple[str, str | None, dict[str, list[str]]]] = []

    def answer(request: httpx2.Request) -> httpx2.Response:
        body = parse_qs(request.content.decode()) if request.url.path == "/oauth/token" else {}
        seen.append((str(request.url), request.headers.get("authorization"), body))
        if request.url.path == "/oauth/token":
            return httpx2.Response(200, json={"access_token": "new", "token_type": "Bearer", "expires_in": 3600})
        return httpx2.Response(200, json={"jsonrpc": "2.0", "id": 1, "result": {}})

    async def call() -> int:  # a later process: the store read from its file
        auth = run_auth("remote", URL, lambda: None)
        async with httpx2.AsyncClient(auth=auth, transport=httpx2.MockTransport(answer)) as http:
            return (await http.post(URL, json={"jsonrpc": "2.0", "id": 1, "method": "ping"})).status_code

    assert asyncio.run(call()) == 200
    assert seen == [
        (
            "http://auth.test/oauth/token",
            None,
            {"grant_type": ["refresh_token"], "refresh_token": ["r1"], "client_id": ["c1"]},
        ),
        (URL, "Bearer new", {}),
    ]
    again = TokenStore("remote", URL)
    assert again.tokens is not None and (again.tokens.access_token, again.tokens.refresh_token) == ("new", "r1")
    assert again.expires_at is not None and again.expires_at > time.time() + 3000
    assert stat.S_IMODE(again.path.stat().st_mode) == 0o600


def test_a_store_of_another_address_or_a_damaged_file_holds_nothing() -> None:
    store = TokenStore("remote", URL)
    asyncio.run(store.set_tokens(OAuthToken(access_token="t")))
    assert TokenStore("remote", "http://elsewhere.test/mcp").tokens is None  # another file: another server
    store.path.write_text("{not json")
    assert TokenStore("remote", URL).tokens is None
