"""The official MCP conformance suite (`conformance.py`) against this project, both ways (issue 45).

As a server: the server's own handlers (`AgentsServer`, what `subagent mcp` serves on stdio) on the
SDK's streamable HTTP app, since the suite speaks HTTP. As a client: `subagent` itself, driven by
`conformance_client.py`, which the suite runs with its mock server's URL."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from mlx_subagents.mcp_server.server import AgentsServer
from tests.helpers import REPO, make_runner, scripted_host
from tests.mcp_server.conformance import Suite, conformance_suite

pytestmark = [pytest.mark.slow, pytest.mark.process]

DRIVER = Path(__file__).with_name("conformance_client.py")


@pytest.fixture(scope="module")
def suite() -> Suite:
    return conformance_suite()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`AgentsServer`'s handlers on the SDK's streamable HTTP app, served by uvicorn in a thread."""
    workspace = tmp_path_factory.mktemp("workspace")
    host = scripted_host(["unused"])
    agents = AgentsServer(lambda root, sink: make_runner(root, host, sink), workspace)
    app = agents.server().streamable_http_app(host="127.0.0.1")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True, name="mcp-http")
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the HTTP server did not start"
    yield f"http://127.0.0.1:{port}/mcp"
    server.should_exit = True
    thread.join(10)


@pytest.mark.parametrize("scenario", ["server-initialize", "ping", "tools-list", "logging-set-level"])
def test_the_server_passes_the_suites_server_scenarios(suite: Suite, server_url: str, scenario: str) -> None:
    outcome = suite.server(server_url, scenario)
    assert outcome.ok, outcome.report()
    assert outcome.passed and outcome.failed == []


def driver(*args: str) -> list[str]:
    """The command the suite runs for a client scenario: `subagent`, set up and driven by the driver."""
    return [sys.executable, str(DRIVER), *args]


@pytest.mark.parametrize("scenario", ["initialize", "tools_call", "sse-retry", "elicitation-sep1034-client-defaults"])
def test_subagent_passes_the_suites_client_scenarios(suite: Suite, scenario: str) -> None:
    outcome = suite.client(driver(), scenario, env={"PYTHONPATH": str(REPO)})
    assert outcome.ok, outcome.report()
    assert outcome.passed
