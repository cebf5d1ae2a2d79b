"""`subagent serve` over HTTP to 2026-07-28 clients (issue 65): stateless requests on the same endpoint
as the 2025 sessions, and an MCP task that outlives the client that started it: another connection
reads it to its end by id (the extension's routing header required); and a client from npm, the TypeScript
SDK with the Tasks extension's requester, runs an agent as a task."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import anyio
import httpx2
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from mlx_subagents.serve.state import serve_paths
from mlx_subagents.tools import mcp_tasks
from tests.helpers import call
from tests.mcp_server.conformance import npm_packages
from tests.mcp_server.test_mcp_2026 import Announced, until
from tests.mcp_server.test_mcp_server import answers, text

pytestmark = [pytest.mark.slow, pytest.mark.process]


def http_client(url: str, mode: str = "auto") -> Client:
    token = serve_paths().token.read_text().strip()
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60)
    return Client(streamable_http_client(url, http_client=http), mode=mode, extensions=[Announced()])


def test_a_task_outlives_its_client_and_the_2025_session_is_served_beside_it(
    serve_process: Any, tmp_path: Path, write_script: Any
) -> None:
    gate = tmp_path / "gate"
    wait = f"while [ ! -e {gate} ]; do sleep 0.05; done; echo opened"
    model = write_script({"agents": {"scout": {"replies": [call("bash", command=wait), "the gate opened"]}}})
    _, info = serve_process("--port", "0", "--model", model, "-C", str(tmp_path))
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with http_client(info.url) as first:
            seen["version"] = first.protocol_version
            args = {"agent": "scout", "task": "wait for the gate"}
            seen["handle"] = await first.session.call_tool("run_agents", args, allow_claimed=True)
        gate.touch()  # the first client has gone; its task runs on
        async with http_client(info.url) as second:
            seen["done"] = await until(second, seen["handle"].task_id, lambda t: t.status == "completed")
        async with http_client(info.url, mode="legacy") as old:
            seen["legacy"] = (old.protocol_version, text(await old.call_tool("agent_status", {})))

    anyio.run(main)
    assert seen["version"] == "2026-07-28"
    result = types.CallToolResult.model_validate(seen["done"].result, by_name=False)
    assert answers(result) == [("scout", "completed", "the gate opened")]
    assert seen["legacy"] == ("2025-11-25", "No tasks started yet: start_agents starts some.")

    # `tasks/*` on HTTP name their task in `Mcp-Name` (the extension's routing header): else -32020, 400.
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tasks/get",
        "params": {"taskId": seen["handle"].task_id, "_meta": ENVELOPE},
    }
    token = serve_paths().token.read_text().strip()
    headers = {
        "Authorization": f"Bearer {token}",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2026-07-28",
        "Mcp-Method": "tasks/get",
    }
    for name, status in [("other", 400), (seen["handle"].task_id, 200)]:
        response = httpx2.post(info.url, json=body, headers={**headers, "Mcp-Name": name}, timeout=30)
        assert response.status_code == status, response.text
    refused = httpx2.post(info.url, json=body, headers={**headers, "Mcp-Name": "other"}, timeout=30).json()
    assert refused["error"] == {"code": -32020, "message": "the Mcp-Name header must be the task id of tasks/get"}


ENVELOPE = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientCapabilities": {"extensions": {mcp_tasks.EXTENSION: {}}},
}


TS_CLIENT = {"@modelcontextprotocol/client": "2.4.0", "@modelcontextprotocol/ext-tasks": "0.2.2"}


def test_the_typescript_sdks_tasks_requester_runs_an_agent_as_a_task(
    serve_process: Any, tmp_path: Path, write_script: Any
) -> None:
    """A 2026-07-28 client from npm: the TypeScript SDK with `@modelcontextprotocol/ext-tasks` gets a task
    handle for run_agents, polls it and settles the agent's answer (tests/serve/tasks_client.mjs)."""
    root = npm_packages("mcp-ts-tasks-client", TS_CLIENT, "node", "the MCP TypeScript SDK")
    model = write_script({"agents": {"scout": {"replies": [{"content": "found it", "delay": 1.0}]}}})
    _, info = serve_process("--port", "0", "--model", model, "-C", str(tmp_path))
    script = Path(__file__).with_name("tasks_client.mjs")
    token = serve_paths().token.read_text().strip()
    task = json.dumps({"agent": "scout", "task": "look"})
    command = [str(root / "node_modules" / ".bin" / "node"), str(script), str(root / "node_modules"), info.url, token]
    done = subprocess.run([*command, "run_agents", task], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["era"] == "modern"
    assert seen["sent"][0] == "tools/call" and set(seen["sent"][1:]) == {"tasks/get"}  # a handle, then polled
    assert seen["result"]["content"][0]["text"].startswith("found it\n")
    assert seen["result"]["structuredContent"]["tasks"][0]["status"] == "completed"
