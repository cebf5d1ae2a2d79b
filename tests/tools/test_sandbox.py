"""The bash sandbox on real bubblewrap, and plan mode, through the runner and the CLI."""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.events import Event
from mlx_subagents.home import state_home
from mlx_subagents.runs.tasks import TaskSpec
from mlx_subagents.runs.transcripts import load_run, read_transcript
from tests.helpers import call, go, make_runner, needs_sandbox, run_parent, scripted_host, write_agent


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
    """A path outside the workspace (the one folder of the host's a sandbox may write)."""
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


@needs_sandbox
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


@needs_sandbox
def test_a_project_agents_network_takes_the_users_word(
    scripted_runner: Any, tmp_path: Path, listener: socket.socket, outside: Path
) -> None:
    # A cloned repository's `network: allow` is not honoured: one warning, no network.
    path = write_agent(tmp_path, "online", "bash", front="network: allow\n")
    port = listener.getsockname()[1]
    script = [call("bash", command=probe(outside, port)), {"content": "done"}]
    events: list[Event] = []
    go(scripted_runner(script, events, assume_yes=True), "run", TaskSpec("online", "probe"))
    assert bash_outputs(events)[0].splitlines()[-2:] == ["WRITE-REFUSED", "NO-NETWORK"]
    assert [e.data["message"] for e in events if e.kind == "hook_warning"] == [
        f"{path}: 'network: allow' comes with the project, which cannot grant itself the network; its bash runs "
        "without it (give it with --network allow)"
    ]
    assert not reached(listener)

    # The user's word gives it: --network allow, or a user agent's own file. Writes stay confined.
    events.clear()
    go(scripted_runner(script, events, assume_yes=True, network=True), "run", TaskSpec("online", "probe"))
    assert bash_outputs(events)[0].splitlines()[-2:] == ["WRITE-REFUSED", "REACHED"]
    assert reached(listener)
    user_agents = state_home() / "agents"
    user_agents.mkdir(parents=True)
    (user_agents / "mine.md").write_text(
        "---\nname: mine\ndescription: mine\ntools: bash\nsandbox: on\nnetwork: allow\n---\nDo it.\n"
    )
    events.clear()
    go(scripted_runner(script, events), "run", TaskSpec("mine", "probe"))
    assert bash_outputs(events)[0].splitlines()[-2:] == ["WRITE-REFUSED", "REACHED"]
    assert not outside.exists() and reached(listener)


@needs_sandbox
def test_a_resumed_child_keeps_the_sandbox_its_parent_gave_it(tmp_path: Path, outside: Path) -> None:
    # The worker is a built-in agent: unsandboxed on its own, sandboxed below a project agent.
    write_agent(tmp_path, "boss", "bash, subagent")
    delegate = call("subagent", agent="worker", task="look")
    script = {"agents": {"boss": {"replies": [delegate, "ok"]}, "worker": {"replies": ["seen"]}}}
    go(make_runner(tmp_path, scripted_host(script), assume_yes=True), "run", TaskSpec("boss", "go"))
    child = load_run("last", home=load_run("last").folder)
    assert read_transcript(child.transcript_path(child.tasks[0])).meta["sandbox"] == {"network": False}

    touch = call("bash", command=f"(echo x > {outside}) 2>/dev/null || echo WRITE-REFUSED")
    follow = scripted_host({"agents": {"worker": {"replies": [touch, "tried"]}}})
    answer = go(make_runner(tmp_path, follow), "resume", child.run_id, "now write it")

    assert answer.output == "tried"
    log = read_transcript(child.transcript_path(child.tasks[0]))
    assert [m["content"] for m in log.messages if m["role"] == "tool"] == ["WRITE-REFUSED"]
    assert not outside.exists()


@needs_sandbox
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
        "sandbox: on (a project agent); its bash writes only in the workspace and a private /tmp, no network; "
        "plan mode: read-only tools" in out
    )
    assert "sandbox: off (a builtin agent); its bash has all your rights" in out
