"""SIGTERM and SIGHUP to a real `subagent` process: stop, kill every tool process, save, exit 128 + N."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlx_subagents.runs.transcripts import load_run, read_transcript
from tests.helpers import SLOW as SLOW_CHILD
from tests.helpers import Terminal, alive, all_dead, call, cli_env, spawn_cli, wait_for_pids

pytestmark = pytest.mark.process

# A foreground sleep, a background one, and one that left the process group (setsid -f).
SLOW = (
    "echo $$ > bash.pid; setsid -f sh -c 'echo $$ > escaped.pid; exec sleep 30'; "
    "sleep 30 & echo $! > sleep.pid; while [ ! -s escaped.pid ]; do sleep 0.05; done; echo 1 > ready; wait"
)
PID_FILES = ("bash.pid", "sleep.pid", "escaped.pid")


def wait_for(path: Path, deadline: float) -> None:
    while not (path.is_file() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def stop_when_ready(
    proc: subprocess.Popen[str], folder: Path, signum: signal.Signals
) -> tuple[int, str, str, list[int]]:
    """Send `signum` once the slow bash call is up; the exit code, the output and the pids it started."""
    try:
        wait_for(folder / "ready", time.monotonic() + 60)
        pids = [int((folder / name).read_text()) for name in PID_FILES]
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err, pids


# Each signal once, each command once: the handling is one context manager both commands use.
@pytest.mark.slow
@pytest.mark.parametrize(("signum", "command"), [(signal.SIGTERM, "run"), (signal.SIGHUP, "chat")])
def test_a_termination_signal_stops_kills_saves_and_exits(
    tmp_path: Path, isolated_home: Path, signum: signal.Signals, command: str
) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"agents": {"scout": {"replies": [call("bash", command=SLOW), "never reached"]}}}))
    args = ["run", "scout", "wait"] if command == "run" else ["chat", "--agent", "scout", "--once", "wait"]
    args += ["-m", f"scripted:{script}", "-C", str(tmp_path)]
    code, _, err, pids = stop_when_ready(spawn_cli(*args), tmp_path, signum)

    assert code == 128 + signum, err
    assert f"{signum.name} received: stopping every task" in err
    assert all_dead(pids, within=5), "a process the bash call started outlived the task"

    record = load_run("last")
    assert (record.status, record.tasks[0].status) == ("interrupted", "aborted")
    log = read_transcript(record.transcript_path(record.tasks[0]))
    assert [m["role"] for m in log.messages][:3] == ["system", "user", "assistant"]
    assert log.messages[2]["tool_calls"][0]["function"]["arguments"] == {"command": SLOW}
    assert [r.status for r in log.results] == ["aborted"]


@pytest.mark.slow
def test_sigterm_at_the_idle_chat_prompt_stops_the_children_saves_and_exits_143(tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    replies = {
        "orchestrator": {
            "replies": [call("subagent", agent="worker", task="run the slow check", background=True), "ok"]
        },
        "worker": {"replies": [call("bash", command=SLOW_CHILD), "never"]},
    }
    script.write_text(json.dumps({"agents": replies}))
    term = Terminal(["chat", "-m", f"scripted:{script}", "-C", str(tmp_path)])
    try:
        term.expect("/exit leaves\n> ")
        term.send("start it\n")
        term.expect("ok\n> ")
        pids = wait_for_pids(tmp_path, time.monotonic() + 60)
        term.send("half a li")  # typed, not sent: the prompt and the typing leave the screen
        term.expect("half a li")
        os.kill(term.pid, signal.SIGTERM)
        screen = term.expect("\n") + term.expect("\n") + term.expect("\n") + term.expect("\n")
        code = term.wait()
    finally:
        term.close()

    record = load_run("last")
    assert code == 143
    assert screen == (
        "\rSIGTERM received: stopping every task\n"
        "stopping 1 background sub-agent(s): worker#1\n"
        "● worker#1 aborted: stopped by SIGTERM\n"
        f"saved as run {record.run_id}; continue with: subagent chat --resume {record.run_id}\n"
    )
    assert all_dead(pids, within=5)
    [child] = [load_run(p.name, home=record.folder) for p in (record.folder / "runs").iterdir()]
    assert (child.status, child.tasks[0].status) == ("interrupted", "aborted")
    assert [r.output for r in read_transcript(record.transcript_path(record.tasks[0])).results] == ["ok"]


def test_sigterm_at_a_piped_chat_prompt_ends_the_prompt_line_and_exits_143(tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"agents": {"orchestrator": {"replies": ["hello there"]}}}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_subagents.cli", "chat", "-m", f"scripted:{script}", "-C", str(tmp_path)],
        env=cli_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(b"hi\n")
        proc.stdin.flush()
        shown = b""
        while not shown.endswith(b"\n> "):  # the reply, and the prompt again
            shown += os.read(proc.stdout.fileno(), 100)
        # stdin stays open: the chat waits at its prompt, in a thread reading stdin (which made the
        # interpreter abort at shutdown, exit -6, while that thread held stdin's buffer).
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert proc.stderr is not None
        out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()

    run_id = load_run("last").run_id
    assert (proc.returncode, shown + out.encode()) == (143, b"> hello there\n> \n")  # the prompt's line ended
    assert err.splitlines()[1:] == [
        "SIGTERM received: stopping every task",
        f"saved as run {run_id}; continue with: subagent chat --resume {run_id}",
    ]


@pytest.mark.slow
def test_sigterm_names_itself_and_json_still_prints_what_was_done(tmp_path: Path, isolated_home: Path) -> None:
    script = tmp_path / "script.json"
    replies = {
        "scout": {"replies": ["auth is in app.py"]},
        "worker": {"replies": [{"content": "running the slow check", **call("bash", command=SLOW)}, "never"]},
        "reviewer": {"replies": ["never reached"]},
    }
    script.write_text(json.dumps({"agents": replies}))
    tasks = ["-t", "scout", "find auth", "-t", "worker", "check", "-t", "reviewer", "review"]
    proc = spawn_cli(
        "parallel", *tasks, "--concurrency", "1", "--json", "-m", f"scripted:{script}", "-C", str(tmp_path)
    )
    code, out, err, pids = stop_when_ready(proc, tmp_path, signal.SIGTERM)

    assert code == 143, err
    assert all_dead(pids, within=5)
    data = json.loads(out)
    assert (data["mode"], data["succeeded"], data["total"], data["interrupted"]) == ("parallel", 1, 3, True)
    assert [(r["label"], r["status"], r["stop_reason"], r["error"], r["output"]) for r in data["results"]] == [
        ("scout", "completed", "completed", None, "auth is in app.py"),
        ("worker", "aborted", "cancelled", "stopped by SIGTERM", "running the slow check"),
        ("reviewer", "aborted", "cancelled", "stopped by SIGTERM before it started", ""),
    ]
    assert "Ctrl-C" not in err
    assert err.splitlines()[-1] == "aborted: worker, reviewer"
    record = load_run("last")
    assert [t.status for t in record.tasks] == ["completed", "aborted", "aborted"]
    [result] = read_transcript(record.transcript_path(record.tasks[1])).results
    assert (result.status, result.error) == ("aborted", "stopped by SIGTERM")


@pytest.mark.slow
def test_sighup_on_run_json_prints_the_partial_answer_and_exits_129(tmp_path: Path, isolated_home: Path) -> None:
    script = tmp_path / "script.json"
    first = {"content": "checking the config first", **call("bash", command=SLOW)}
    script.write_text(json.dumps({"agents": {"scout": {"replies": [first, "never"]}}}))
    proc = spawn_cli("run", "scout", "look", "--json", "-m", f"scripted:{script}", "-C", str(tmp_path))
    code, out, err, pids = stop_when_ready(proc, tmp_path, signal.SIGHUP)

    assert code == 129, err
    assert all_dead(pids, within=5)
    data = json.loads(out)
    assert (data["status"], data["stop_reason"], data["error"], data["output"]) == (
        "aborted",
        "cancelled",
        "stopped by SIGHUP",
        "checking the config first",
    )
    assert data["usage"]["turns"] == 1 and data["run_id"] == load_run("last").run_id
    assert err.splitlines()[-2:] == ["SIGHUP received: stopping every task", "aborted: scout"]


@pytest.mark.slow
def test_a_chat_turn_stopped_by_sigterm_says_so_down_to_its_children(tmp_path: Path, isolated_home: Path) -> None:
    script = tmp_path / "script.json"
    replies = {
        "orchestrator": {"replies": [call("subagent", agent="worker", task="run the slow check"), "never"]},
        "worker": {"replies": [call("bash", command=SLOW), "never"]},
    }
    script.write_text(json.dumps({"agents": replies}))
    proc = spawn_cli("chat", "--once", "check it", "-m", f"scripted:{script}", "-C", str(tmp_path))
    code, _, err, pids = stop_when_ready(proc, tmp_path, signal.SIGTERM)

    assert code == 143, err
    assert all_dead(pids, within=5)
    record = load_run("last")
    [parent] = read_transcript(record.transcript_path(record.tasks[0])).results
    assert (parent.status, parent.error) == ("aborted", "stopped by SIGTERM")
    [child] = [load_run(p.name, home=record.folder) for p in (record.folder / "runs").iterdir()]
    [result] = read_transcript(child.transcript_path(child.tasks[0])).results
    assert (result.status, result.stop_reason, result.error) == ("aborted", "cancelled", "stopped by SIGTERM")


@pytest.mark.slow
def test_kill_9_of_the_cli_leaves_no_command_running(tmp_path: Path, isolated_home: Path) -> None:
    """SIGKILL runs no handler: the commands die with the process all the same (the tether reads the end
    of its lifeline), the foreground one, its background job, the one that left the group, and a
    background `bash`."""
    script = tmp_path / "script.json"
    background = call("bash", command="echo $$ > bg.pid; exec sleep 30", background=True)
    script.write_text(json.dumps({"agents": {"scout": {"replies": [background, call("bash", command=SLOW), "no"]}}}))
    proc = spawn_cli("run", "scout", "look", "-m", f"scripted:{script}", "-C", str(tmp_path))
    try:
        wait_for(tmp_path / "ready", time.monotonic() + 60)
        wait_for(tmp_path / "bg.pid", time.monotonic() + 60)
        pids = [int((tmp_path / name).read_text()) for name in (*PID_FILES, "bg.pid")]
        assert all(alive(pid) for pid in pids)
        proc.kill()
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    assert proc.returncode == -signal.SIGKILL
    assert all_dead(pids, within=5), "a command outlived the process that started it"
