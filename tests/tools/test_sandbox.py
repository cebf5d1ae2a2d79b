"""The bash sandbox on real bubblewrap, and plan mode, through the runner and the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.events import Event
from mlx_subagents.runs.tasks import TaskSpec
from mlx_subagents.tools import Sandbox, Workspace
from mlx_subagents.tools.bash import BashTool
from mlx_subagents.tools.processes import marked_processes
from tests.helpers import SLOW, all_dead, call, go, make_runner, run_parent, scripted_host, wait_for_pids, write_agent


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A TCP listener on 127.0.0.1 that no one should reach from a sandbox without network."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.setblocking(False)
    yield server
    server.close()


@pytest.fixture
def outside() -> Iterator[Path]:
    """A path outside the workspace and outside the temp folder (both of which a sandbox may write)."""
    path = Path("/var/tmp") / f"mlx-subagents-sandbox-{uuid.uuid4().hex}"
    yield path
    path.unlink(missing_ok=True)


def reached(server: socket.socket) -> bool:
    try:
        server.accept()[0].close()
    except BlockingIOError:
        return False
    return True


def bash_outputs(events: list[Event], label: str | None = None) -> list[str]:
    return [
        e.data["output"]
        for e in events
        if e.kind == "tool_result" and e.data["name"] == "bash" and (label is None or e.label == label)
    ]


def probe(outside: Path, port: int) -> str:
    """A bash command that writes inside, then outside, then connects to the listener."""
    return (
        f"echo in > inside.txt; echo out > {outside} 2>&1 || echo WRITE-REFUSED; "
        f"(exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo REACHED || echo NO-NETWORK"
    )


def test_a_project_agent_bash_writes_only_in_its_workspace_and_has_no_network(
    scripted_runner: Any, tmp_path: Path, listener: socket.socket, outside: Path
) -> None:
    write_agent(tmp_path, "local", "bash")
    port = listener.getsockname()[1]
    events: list[Event] = []
    script = [call("bash", command=probe(outside, port)), {"content": "done"}]
    result = go(scripted_runner(script, events, assume_yes=True), "run", TaskSpec("local", "probe"))
    assert result.ok
    [output] = bash_outputs(events)
    assert output.splitlines()[-2:] == ["WRITE-REFUSED", "NO-NETWORK"]
    assert "Read-only file system" in output
    assert (tmp_path / "inside.txt").read_text() == "in\n"
    assert not outside.exists() and not reached(listener)

    # `network: allow` gives the network back (the switch is the cause), writes stay confined.
    write_agent(tmp_path, "online", "bash", front="network: allow\n")
    events.clear()
    go(scripted_runner(script, events, assume_yes=True), "run", TaskSpec("online", "probe"))
    assert bash_outputs(events)[0].splitlines()[-2:] == ["WRITE-REFUSED", "REACHED"]
    assert not outside.exists() and reached(listener)


def test_a_sandboxed_parent_sandboxes_its_children_and_a_project_file_cannot_turn_it_off(
    scripted_runner: Any, tmp_path: Path, outside: Path
) -> None:
    # `sandbox: off` in a project file is not honoured; the built-in worker it starts is sandboxed too.
    write_agent(tmp_path, "boss", "bash, subagent", front="sandbox: off\n")
    touch = call("bash", command=f"echo x > {outside} || echo WRITE-REFUSED")
    script = {
        "agents": {
            "boss": {"replies": [touch, call("subagent", agent="worker", task="touch it"), {"content": "ok"}]},
            "worker": {"replies": [touch, {"content": "tried"}]},
        }
    }
    events: list[Event] = []
    result = go(scripted_runner(script, events, assume_yes=True), "run", TaskSpec("boss", "go"))
    assert result.ok
    outputs = {e.label: e.data["output"] for e in events if e.kind == "tool_result" and e.data["name"] == "bash"}
    assert set(outputs) == {"boss", "boss > worker#1"}
    assert all(out.endswith("WRITE-REFUSED") for out in outputs.values())
    assert not outside.exists()

    # The user's --sandbox off is the one switch that turns it off (here for the whole tree).
    go(scripted_runner(script, None, assume_yes=True, sandbox=False), "run", TaskSpec("boss", "go"))
    assert outside.read_text() == "x\n"


@pytest.mark.slow
def test_sandboxed_bash_is_swept_on_cancel_and_keeps_its_time_out(tmp_path: Path) -> None:
    tool = BashTool(Workspace(tmp_path), Sandbox(writable=(tmp_path,)))

    async def cancel_midway() -> list[int]:
        task = asyncio.create_task(tool.call({"command": f"setsid sleep 31 & {SLOW}"}))
        pids = await asyncio.to_thread(wait_for_pids, tmp_path, time.monotonic() + 20)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return pids

    pids = asyncio.run(cancel_midway())
    assert all_dead(pids)
    assert [p for p in marked_processes(f"{os.getpid()}-", prefix=True) if "sleep" in " ".join(p.cmdline())] == []
    timed_out = asyncio.run(tool.call({"command": "echo started; sleep 30", "timeout": 1}))
    assert timed_out.output == "Error: command timed out after 1s; its process group was killed\nstarted"


def test_a_missing_bwrap_fails_closed_in_one_line(
    scripted_runner: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "bash").symlink_to("/bin/bash")
    monkeypatch.setenv("PATH", str(bin_dir))
    write_agent(tmp_path, "local", "bash")
    events: list[Event] = []
    script = [call("bash", command="echo ran > ran.txt"), {"content": "done"}]
    go(scripted_runner(script, events, assume_yes=True), "run", TaskSpec("local", "x"))
    assert bash_outputs(events) == [
        "Error: bash is sandboxed for this agent but 'bwrap' is not on PATH; install bubblewrap (Debian/Ubuntu: "
        "apt-get install bubblewrap; Fedora: dnf install bubblewrap), or run this agent unsandboxed with "
        "--sandbox off (or 'sandbox: off' in a user agent's file)"
    ]
    assert not (tmp_path / "ran.txt").exists()


def test_plan_mode_strips_the_write_tools_from_the_agent_and_its_children(tmp_path: Path) -> None:
    write_agent(tmp_path, "lead", "ls, bash, subagent")
    refused = "Error: {tool} is not available to '{agent}' in plan mode, which only looks: no edit, write or bash; "
    refused += "describe the change in your answer instead"
    script = {
        "agents": {
            "lead": {
                "replies": [
                    call("bash", command="rm -rf x"),
                    call("subagent", agent="worker", task="w"),
                    {"content": "ok"},
                ]
            },
            "worker": {"replies": [call("write", path="a.txt", content="a"), call("ls", path="."), {"content": "w"}]},
        }
    }
    events: list[Event] = []
    host = scripted_host(script)
    result = run_parent(make_runner(tmp_path, host, events, plan=True, assume_yes=True), agent="lead")
    assert result.ok
    [bash] = bash_outputs(events, "lead")
    assert bash == refused.format(tool="bash", agent="lead")
    [child] = [name for name in host.history if name != "lead"]
    tool_results = [m["content"] for m in host.history[child][-1] if m["role"] == "tool"]
    assert tool_results[0] == refused.format(tool="write", agent="worker")
    assert not (tmp_path / "a.txt").exists()


def test_agents_list_says_the_sandbox_and_plan_defaults(run_cli: Any, tmp_path: Path) -> None:
    write_agent(tmp_path, "local", "read, bash", front="permissionMode: plan\n")
    code, out, _ = run_cli("agents", "--cwd", str(tmp_path), "--json")
    rows = {row["name"]: row for row in json.loads(out)}
    assert code == 0
    assert (rows["local"]["sandbox"], rows["local"]["permission"]) == (True, "plan")
    assert (rows["worker"]["sandbox"], rows["worker"]["permission"]) == (False, "default")
    code, out, _ = run_cli("agents", "--cwd", str(tmp_path), "--verbose")
    assert (
        "sandbox: on (a project agent); its bash writes only in the workspace and the temp folder, no network; "
        "plan mode: read-only tools" in out
    )
    assert "sandbox: off (a builtin agent); its bash has all your rights" in out
