"""`subagent serve`: the real server process, its HTTP guard, its files, status and stop."""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from mlx_subagents.runs.published import read_snapshots
from mlx_subagents.serve.client import make_hello, quick
from mlx_subagents.serve.service import sandbox_notice
from mlx_subagents.serve.state import lock_held, read_info, serve_paths
from mlx_subagents.serve.wire import MAX_LINE_BYTES
from tests.helpers import call, spawn_cli, write_agent

pytestmark = [pytest.mark.slow, pytest.mark.process, pytest.mark.usefixtures("preloaded_mcp")]

INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "1"}},
}


def post(url: str, headers: dict[str, str], body: Any = INITIALIZE, path: str | None = None) -> tuple[int, str]:
    """One POST to the server: its status and body (for an SSE answer, its first event's data)."""
    where = urlparse(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=10)
    base = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    target = path or where.path + (f"?{where.query}" if where.query else "")
    connection.request("POST", target, body if isinstance(body, str) else json.dumps(body), {**base, **headers})
    response = connection.getresponse()
    text = response.read(65536).decode()
    connection.close()
    return response.status, text


def http_listings(url: str, token: str, workspace: Path) -> dict[str, Any]:
    """`list_agents` over two HTTP sessions of the SDK's client: `?cwd=` with `?yes=1`, and without yes."""
    import anyio
    import httpx2
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    found: dict[str, Any] = {}

    async def main() -> None:
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
            for name, query in (("yes", f"?cwd={workspace}&yes=1"), ("no", f"?cwd={workspace}")):
                async with streamable_http_client(url + query, http_client=http) as (read, write):
                    async with ClientSession(read, write) as session:
                        await session.initialize()
                        found[name] = (await session.call_tool("list_agents", {})).structured_content

    anyio.run(main)
    return found


def test_http_refuses_no_token_a_wrong_one_and_a_foreign_origin_or_host(
    serve_process: Any, tmp_path: Path, write_script: Any
) -> None:
    write_agent(tmp_path, "helper", "read")
    _, info = serve_process("--port", "0", "--model", write_script(["unused"]), "-C", str(tmp_path.parent))
    paths = serve_paths()
    token = paths.token.read_text().strip()
    assert stat.S_IMODE(os.stat(paths.token).st_mode) == 0o600 and stat.S_IMODE(os.stat(paths.socket).st_mode) == 0o600
    port = urlparse(info.url).port
    auth = {"Authorization": f"Bearer {token}"}

    status, text = post(info.url, {})
    assert (status, text) == (
        401,
        f"401: unauthorized: no bearer token; send 'Authorization: Bearer TOKEN' with the token in {paths.token}\n",
    )
    status, text = post(info.url, {"Authorization": "Bearer not-the-token"})
    assert (status, text) == (401, f"401: unauthorized: wrong token; the token is in {paths.token}\n")
    status, text = post(info.url, {**auth, "Origin": "http://evil.example"})
    assert status == 403 and text == (
        "403: forbidden: the Origin header 'http://evil.example' is not this server's (127.0.0.1, localhost or [::1] "
        f"at port {port}); it answers only clients on this machine\n"
    )
    status, text = post(info.url, {**auth, "Host": "evil.example"})
    assert status == 403 and text.startswith("403: forbidden: the Host header 'evil.example' is not this server's")
    status, text = post(info.url, auth, path="/other")
    assert (status, text) == (404, "404: not found: the MCP endpoint is /mcp, the chat endpoints are under /v1/\n")
    for headers, url in ((auth, info.url), ({"Origin": f"http://localhost:{port}"}, f"{info.url}?token={token}")):
        status, text = post(url, headers)
        assert status == 200 and '"serverInfo":{"name":"mlx-subagents"' in text
        assert '"capabilities":{"logging":{},"tools":' in text  # logging/setLevel is answered
    # A host name is case-insensitive (RFC 9110): the SDK's own check compared it exactly and refused this.
    status, text = post(info.url, {**auth, "Host": f"LocalHost:{port}", "Origin": f"HTTP://LOCALHOST:{port}"})
    assert status == 200 and '"serverInfo":{"name":"mlx-subagents"' in text
    # The chat endpoints take the token only in a header: their clients all send one, and a URL is kept in
    # histories, logs and configuration files that a header is not.
    status, text = post(f"{info.url.removesuffix('/mcp')}/v1/chat/completions?token={token}", {}, body={})
    assert status == 401 and "unauthorized: no bearer token" in text
    status, text = post(info.url, auth, body="{ not json")  # answered by the SDK, logged here
    assert status == 400 and "Parse error" in text
    status, _ = post(info.url, auth, body={"pad": "x" * MAX_LINE_BYTES})
    assert status == 413
    # The SDK refuses a body over its limit unread when its Content-Length says so; the connection then closes
    # (as the chat endpoints' does): kept alive, the client's next request on it was read as the body it owed.
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n"
        sock.sendall(f"{head}Content-Type: application/json\r\nContent-Length: {MAX_LINE_BYTES + 1}\r\n\r\n".encode())
        refused = http.client.HTTPResponse(sock)
        refused.begin()
        assert (refused.status, refused.getheader("connection")) == (413, "close")
        refused.read()
        try:
            sock.sendall(f"{head}Content-Length: 2\r\n\r\n{{}}".encode())
            after = sock.recv(65536)
        except ConnectionError:  # the server's end is closed: a reset, or a broken pipe
            after = b""
        assert after == b""  # no answer to a second request, which was not read as the first one's body either
    listings = http_listings(info.url, token, tmp_path)
    assert listings["yes"]["workspace"] == str(tmp_path.resolve()) and "helper" in [
        a["name"] for a in listings["yes"]["agents"]
    ]
    assert [w["name"] for w in listings["no"]["withheld"]] == [
        "helper"
    ]  # another session: the first one's yes is its own
    log = paths.log.read_text()
    assert "HTTP POST /mcp answered 400" in log and "HTTP POST /mcp answered 413" in log
    assert "HTTP POST /mcp refused (401): unauthorized: no bearer token" in log
    assert "HTTP POST /mcp refused (403): forbidden: the Origin header 'http://evil.example'" in log


def test_a_second_server_is_refused_and_stale_files_are_replaced(
    serve_process: Any, tmp_path: Path, preloaded_python: list[str]
) -> None:
    paths = serve_paths()
    paths.folder.mkdir(parents=True)
    # A server that died: its server.json, its socket, a token others may read.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = {"pid": int(dead.stdout), "version": "0.0.1", "home": str(paths.home), "socket": str(paths.socket),
             "url": None, "log": str(paths.log), "started": 1.0}  # fmt: skip
    paths.info.write_text(json.dumps(stale))
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(paths.socket))  # left behind: nobody listens on it
    paths.token.write_text("leaked-token-leaked-token-leaked-token\n")
    os.chmod(paths.token, 0o644)

    first, info = serve_process("--no-http", "-C", str(tmp_path), own=True)
    assert info.pid == first.pid and info.url is None and read_info(paths) == info
    token = paths.token.read_text().strip()
    assert token != "leaked-token-leaked-token-leaked-token" and stat.S_IMODE(os.stat(paths.token).st_mode) == 0o600
    assert quick(info, make_hello("status"))["status"]["clients"] == []

    second = spawn_cli("serve", "--no-http", python=preloaded_python)
    out, err = second.communicate(timeout=60)
    assert second.returncode == 2 and out == ""
    assert err == (
        f"error: a server already runs for {paths.home} (pid {first.pid}, {paths.socket}); use it, or stop it with: "
        "subagent serve --stop\n"
    )
    stop = spawn_cli("serve", "--stop", python=preloaded_python)
    assert (
        stop.communicate(timeout=60)[1]
        == f"stopped the server (pid {first.pid}); what ran is saved (subagent runs lists it)\n"
    )
    assert first.wait(60) == 0 and not lock_held(paths)
    assert not paths.info.exists() and not paths.socket.exists() and paths.token.read_text().strip() == token


def test_status_lists_clients_and_tasks_and_stop_cancels_and_saves_them(
    serve_process: Any, tmp_path: Path, write_script: Any, preloaded_python: list[str]
) -> None:
    from tests.mcp_server.test_mcp_server import connect, run

    model = write_script(
        {
            "agents": {
                "scout": {"replies": [call("bash", command="sleep 30")]},
                "reviewer": {"replies": [call("bash", command="sleep 30")]},
            }
        }
    )
    server, info = serve_process("--no-http", "--model", model, own=True)
    seen: dict[str, Any] = {}

    async def main() -> None:
        import anyio

        async with connect("--cwd", tmp_path) as client:
            started = await client.call_tool("start_agents", {"agent": "reviewer", "task": "in the background"})
            seen["started"] = started.structured_content["ids"]

            async def stop_soon() -> None:
                await anyio.sleep(1.5)
                seen["status"] = quick(info, make_hello("status"))["status"]
                seen["watch"] = read_snapshots()
                seen["stop"] = spawn_cli("serve", "--stop", python=preloaded_python)

            async with anyio.create_task_group() as group:
                group.start_soon(stop_soon)
                seen["result"] = await client.call_tool("run_agents", {"agent": "scout", "task": "in the foreground"})

    run(main)
    assert seen["started"] == ["reviewer#1"]
    status = seen["status"]
    [client] = status["clients"]
    assert (client["kind"], client["workspace"], client["connected"], client["running"]) == (
        "relay",
        str(tmp_path.resolve()),
        True,
        2,
    )
    assert sorted((t["label"], t["agent"], t["status"]) for t in status["tasks"]) == [
        ("reviewer#1", "reviewer", "running"), ("scout", "scout", "running"),
    ]  # fmt: skip
    assert [m["model"] for m in status["models"]] == [model]
    # `subagent watch` shows them under the server, each label after its client's id.
    [served] = [snapshot for snapshot in seen["watch"] if snapshot.pid == info.pid]
    rows = sorted((t.label.partition("/"), t.activity) for t in served.tasks)
    assert [(who, label, activity) for (who, _, label), activity in rows] == [
        (client["id"], "reviewer#1", "tool"), (client["id"], "scout", "tool"),
    ]  # fmt: skip
    # The call in progress answered with what its task had done: aborted by the stop.
    result = seen["result"].structured_content["tasks"][0]
    assert (result["status"], result["error"]) == ("aborted", "the server stopped (subagent serve --stop)")
    assert seen["stop"].wait(30) == 0 and server.wait(30) == 0
    transcripts = sorted(Path(os.environ["MLX_SUBAGENTS_HOME"], "runs").glob("*/*.jsonl"))
    ends = [json.loads(p.read_text().splitlines()[-1]) for p in transcripts]
    assert sorted((e["result"]["label"], e["result"]["status"]) for e in ends if "result" in e) == [
        ("reviewer#1", "aborted"), ("scout", "aborted"),
    ]  # fmt: skip


def test_malformed_and_oversized_messages_are_answered_and_logged(
    serve_process: Any, tmp_path: Path, write_script: Any
) -> None:
    _, info = serve_process("--no-http", "--model", write_script(["unused"]))

    def exchange(*lines: bytes, answers: int = 1) -> list[dict[str, Any]]:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(20)
            sock.connect(info.socket)
            for line in lines:
                sock.sendall(line)
            file = sock.makefile("rb")
            return [json.loads(file.readline()) for _ in range(answers)]

    assert exchange(b"not json\n") == [
        {
            "error": "malformed hello (it is not a JSON object); the first line names what the client is (see protocol.py)"
        }
    ]
    assert exchange(b'{"hello": "dance"}\n')[0]["error"].startswith(
        "malformed hello (hello: Input should be 'mcp', 'job'"
    )
    hello = (
        json.dumps(
            make_hello("mcp", options=None, workspace=str(tmp_path)).model_dump(mode="json", exclude_none=True)
        ).encode()
        + b"\n"
    )
    oversized = b'{"jsonrpc": "2.0", "id": 7, "method": "ping", "params": {"pad": "' + b"x" * MAX_LINE_BYTES + b'"}}\n'
    object_id, batch = (
        b'{"jsonrpc": "2.0", "id": {"a": 1}, "method": "ping"}\n',
        b'[{"jsonrpc": "2.0", "id": 2, "method": "ping"}]\n',
    )
    sent = (hello, b"{ broken\n", oversized, object_id, batch, json.dumps(INITIALIZE).encode() + b"\n")
    answers = exchange(*sent, answers=6)
    assert answers[0]["ok"]["pid"] == info.pid
    assert answers[1] == {
        "jsonrpc": "2.0",
        "id": None,
        "error": {"code": -32700, "message": "Parse error: the line is not valid JSON"},
    }
    assert answers[2]["id"] is None and answers[2]["error"]["message"] == (
        f"Invalid request: the message is {len(oversized) - 1:,} bytes, over the limit of {MAX_LINE_BYTES:,}"
    )
    assert [(a["id"], a["error"]["code"], a["error"]["message"]) for a in answers[3:5]] == [
        (None, -32600, "Invalid request: 'id' must be a string or an integer"),
        (None, -32600, "Invalid request: a message is one JSON object, got an array (batches are not supported)"),
    ]
    assert answers[5]["id"] == 1 and answers[5]["result"]["serverInfo"]["name"] == "mlx-subagents"  # still answering
    log = serve_paths().log.read_text()
    assert "a malformed hello on the socket: it is not a JSON object" in log
    assert f"oversized message from a relayed client ({len(oversized) - 1} bytes): answered with id null" in log
    assert "malformed message (answered with id null) from the client: Parse error" in log


def test_mcp_serve_starts_a_server_relays_to_it_and_exits_when_it_is_stopped(
    tmp_path: Path, write_script: Any, preloaded_python: list[str]
) -> None:
    import anyio

    from mlx_subagents.serve.state import running_server
    from tests.mcp_server.test_mcp_server import connect

    model = write_script({"agents": {"scout": {"replies": ["found it"]}}})
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with connect("--serve", "--model", model, "--cwd", tmp_path) as client:
            seen["answer"] = await client.call_tool("run_agents", {"agent": "scout", "task": "look"})
            seen["info"] = info = running_server(wait=0)
            seen["status"] = quick(info, make_hello("status"))["status"]
            stop = spawn_cli("serve", "--stop", python=preloaded_python)
            seen["stopped"] = await anyio.to_thread.run_sync(lambda: stop.communicate(timeout=60))
            with anyio.fail_after(30):
                while await anyio.to_thread.run_sync(lambda: lock_held(serve_paths())):
                    await anyio.sleep(0.05)
            try:  # the relay exited with the server stopped on purpose: nothing answers any more
                with anyio.fail_after(20):
                    await client.call_tool("run_agents", {"agent": "scout", "task": "again"})
            except Exception as exc:
                seen["after"] = type(exc).__name__

    try:
        anyio.run(main)
    finally:
        if lock_held(serve_paths()) and (left := running_server(wait=0)) is not None:
            quick(left, make_hello("stop"))
    info = seen["info"]
    assert seen["answer"].structured_content["tasks"][0]["answer"] == "found it"
    assert info.url is None and info.version  # started for the relay: the socket only
    [client] = seen["status"]["clients"]
    assert (client["kind"], client["workspace"]) == ("relay", str(tmp_path.resolve()))
    assert [m["model"] for m in seen["status"]["models"]] == [model]  # its --model, loaded at start
    assert seen["stopped"][1] == f"stopped the server (pid {info.pid}); what ran is saved (subagent runs lists it)\n"
    assert seen["after"] == "MCPError" and not (Path(os.environ["MLX_SUBAGENTS_HOME"]) / "logs" / "mcp.log").exists()


def test_status_shows_how_long_each_task_waited_behind_other_prompts_prefill() -> None:
    """`serve --status` (and its `--json`) carries each task's time behind other sessions' prefills, as its
    usage events report it: the cost of sharing the model, per task."""
    from mlx_subagents.cli.serve import status_lines
    from mlx_subagents.events import Event, TaskStartData, UsageData
    from mlx_subagents.results import RunUsage
    from mlx_subagents.serve.clients import TaskTally

    tally = TaskTally()
    for label, waited in (("scout", 2.345), ("reviewer", 0.0)):
        tally.handle(Event("task_start", label, label, data=TaskStartData(task="t", model="m", tool_mode="native")))
        usage = RunUsage(output_tokens=1234, turns=1, prefill_wait_s=waited).model_dump()
        tally.handle(Event("usage", label, label, turn=1, data=UsageData(**usage, tps=9.5)))
    tasks = [{"client": "c1", **t.model_dump()} for t in tally.tasks.values()]
    assert [t["prefill_wait_s"] for t in tasks] == [2.345, 0.0]
    server = {"pid": 7, "url": None, "socket": "/s", "uptime_s": 5, "log": "/l"}
    status = {"server": server, "kv": {"used": 0, "budget": None}, "models": [], "clients": [], "tasks": tasks}
    assert [line for line in status_lines(status) if line.startswith("task")] == [
        "task    c1 scout (scout) running, turn 0, 1,234 tokens, 2.3s behind other prompts' prefill",
        "task    c1 reviewer (reviewer) running, turn 0, 1,234 tokens",
    ]


def test_status_counts_a_running_turns_tokens_as_it_decodes() -> None:
    """A task's tokens in `serve --status` grow while its reply decodes, as the live lines count them: an
    agent's first reply showed "0 tokens" until it ended, however long it ran."""
    from mlx_subagents.cli.serve import status_lines
    from mlx_subagents.events import DecodeData, Event, TaskStartData, UsageData
    from mlx_subagents.results import RunUsage
    from mlx_subagents.serve.clients import TaskTally

    tally = TaskTally()
    server = {"pid": 7, "url": None, "socket": "/s", "uptime_s": 5, "log": "/l"}

    def line(*events: Event) -> str:
        for event in events:
            tally.handle(event)
        tasks = [{"client": "c1", **t.model_dump()} for t in tally.tasks.values()]
        status = {"server": server, "kv": {"used": 0, "budget": None}, "models": [], "clients": [], "tasks": tasks}
        return next(line for line in status_lines(status) if line.startswith("task"))

    def usage(tokens: int) -> Event:
        data = UsageData(**RunUsage(output_tokens=tokens, turns=1).model_dump(), tps=9.5)
        return Event("usage", "scout", "scout", turn=1, data=data)

    start = Event("task_start", "scout", "scout", data=TaskStartData(task="t", model="m", tool_mode="native"))
    assert (
        line(start, Event("turn_start", "scout", "scout", turn=1))
        == "task    c1 scout (scout) running, turn 1, 0 tokens"
    )
    assert line(Event("decode", "scout", "scout", turn=1, data=DecodeData(tokens=57, tps=6.0))).endswith(
        "turn 1, 57 tokens"
    )
    assert line(usage(60)).endswith("turn 1, 60 tokens")
    second = (
        Event("turn_start", "scout", "scout", turn=2),
        Event("decode", "scout", "scout", turn=2, data=DecodeData(tokens=1000, tps=6.0)),
    )
    assert line(*second).endswith("turn 2, 1,060 tokens")
    assert "replied_tokens" not in tally.tasks["scout"].model_dump()  # --json carries the one count


def test_status_says_the_model_is_loading_and_the_default_budget_is_not_unbounded() -> None:
    """Just after start the server listens while `--model` loads: `--status` said "(none loaded yet)" and an
    "unbounded" budget, which is the default budget not sized yet; a model that failed to load is named."""
    from mlx_subagents.cli.serve import status_lines

    server = {"pid": 7, "url": None, "socket": "/s", "uptime_s": 5, "log": "/l"}
    base = {"server": server, "models": [], "clients": [], "tasks": [], "load_error": None}
    loading = {**base, "kv": {"used": 0, "budget": None}, "loading": {"model": "mlx-community/Q", "since_s": 12.3}}
    assert status_lines(loading)[1:] == [
        "kv      0.0 MiB in use; the budget is half the memory the weights leave, once loaded",
        "model   mlx-community/Q: loading for 12s (a client waits for it)",
    ]
    failed = {**base, "kv": {"used": 0, "budget": 0}, "load_error": {"model": "/m", "error": "no config.json"}}
    assert status_lines(failed)[1:] == [
        "kv      0.0 MiB of unbounded in use",
        "model   /m did not load: no config.json",
    ]
    assert status_lines({**base, "kv": {"used": 0, "budget": 2**30}})[1:] == [
        "kv      0.0 MiB of 1.0 GiB in use",
        "model   none loaded: each client's model loads at its first task",
    ]


def test_status_gives_each_models_draft_acceptance_rate() -> None:
    """A model's line ends with its drafting: off and why, or the share of drafted tokens its replies kept."""
    from mlx_subagents.cli.serve import status_lines

    server = {"pid": 7, "url": None, "socket": "/s", "uptime_s": 5, "log": "/l"}
    base = {"server": server, "clients": [], "tasks": [], "load_error": None, "kv": {"used": 0, "budget": 0}}
    model = {"model": "/m", "weights_bytes": 2**20, "kv_budget": 0, "kv_bytes": 0, "sessions": 2}
    model |= {"most_decoding": 2, "context_window": 4096}
    start = "model   /m: weights 1.0 MiB, KV 0.0 MiB of unbounded, 2 sessions, at most 2 decoding in one batch, "
    drafts = [
        (
            {"mode": "lookup", "on": True, "drafted": 1200, "accepted": 900},
            "lookup, 900 of 1,200 drafted tokens accepted (75%)",
        ),
        ({"mode": "auto", "on": False, "drafted": 0, "accepted": 0}, "off (--draft auto: lookup on a GPU only)"),
        ({"mode": "lookup", "on": True, "drafted": 0, "accepted": 0}, "lookup, nothing drafted yet"),
    ]
    for given, said in drafts:
        lines = status_lines({**base, "models": [{**model, "drafts": given}]})
        assert lines[2] == start + f"window 4,096 tokens; drafts {said}"
    assert status_lines({**base, "models": [{**model, "drafts": None}]})[2] == start + "window 4,096 tokens"


def test_a_detached_server_writes_each_log_line_once_and_its_status_names_its_model(
    tmp_path: Path, write_script: Any, preloaded_python: list[str]
) -> None:
    """`serve --detach` sends its output to the log the server writes too: every line was there twice."""
    model = write_script({"replies": ["hi"]})
    started = spawn_cli("serve", "--detach", "--no-http", "--model", model, python=preloaded_python)
    try:
        assert started.wait(60) == 0, started.stderr.read() if started.stderr else ""
        status = spawn_cli("serve", "--status", python=preloaded_python)
        out, _ = status.communicate(timeout=60)
        assert [line for line in out.splitlines() if line.startswith("model")] == [
            f"model   {model}: weights 0.0 MiB, KV 0.0 MiB of unbounded, 0 sessions, at most 0 decoding in one "
            "batch, window 32,768 tokens"
        ]
    finally:
        assert spawn_cli("serve", "--stop", python=preloaded_python).wait(60) == 0
    lines = [line.split(" ", 2)[2] for line in serve_paths().log.read_text().splitlines()]
    assert lines[0].startswith("INFO mlx_subagents.serve: mlx-subagents ") and lines[-1].endswith(": stopped")
    # serving, loaded, stopping, stopped; and where no sandboxed bash can run here (no bubblewrap), the line saying so
    assert len(lines) == len(set(lines)) == 4 + bool(sandbox_notice())


def test_a_server_says_at_start_when_no_sandboxed_bash_can_run_here(
    serve_process: Any, tmp_path: Path, write_script: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without bubblewrap, a client's project agent had its bash refused in a tool call only its model read;
    the server says so, and the fix, in one line at its start (on stderr and in its log)."""
    bare = tmp_path / "bin"  # a PATH without bwrap (as a fresh machine has none)
    bare.mkdir()
    monkeypatch.setenv("PATH", str(bare))
    process, info = serve_process("--no-http", "--model", write_script(["unused"]))
    log, deadline = Path(info.log), time.monotonic() + 30
    while "bwrap" not in log.read_text():  # said right after it listens
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    process.terminate()
    _, stderr = process.communicate(timeout=30)
    notice = (
        "project agents' bash (and any run with --sandbox on) is refused on this machine: 'bwrap' is not on PATH; "
        "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap), or run "
        "this agent unsandboxed with --sandbox off (or 'sandbox: off' in a user agent's file)"
    )
    assert [line.split(" WARNING mlx_subagents.serve: ")[-1] for line in stderr.splitlines() if "bwrap" in line] == [
        notice
    ]
    assert notice in log.read_text()
