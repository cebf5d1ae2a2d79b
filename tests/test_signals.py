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
from helpers import SLOW as SLOW_CHILD
from helpers import Terminal, all_dead, call, cli_env, spawn_cli, wait_for_pids

from mlx_subagents.runs.transcripts import load_run, read_transcript

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


# Each signal once, each command once: the handling is one context manager both commands use.
@pytest.mark.parametrize(("signum", "command"), [(signal.SIGTERM, "run"), (signal.SIGHUP, "chat")])
def test_a_termination_signal_stops_kills_saves_and_exits(
    tmp_path: Path, isolated_home: Path, signum: signal.Signals, command: str
) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"agents": {"scout": {"replies": [call("bash", command=SLOW), "never reached"]}}}))
    args = ["run", "scout", "wait"] if command == "run" else ["chat", "--agent", "scout", "--once", "wait"]
    args += ["-m", f"scripted:{script}", "-C", str(tmp_path)]
    proc = spawn_cli(*args)
    try:
        wait_for(tmp_path / "ready", time.monotonic() + 60)
        pids = [int((tmp_path / name).read_text()) for name in PID_FILES]
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    assert proc.returncode == 128 + signum, err
    assert f"{signum.name} received: stopping every task" in err
    assert all_dead(pids, within=5), "a process the bash call started outlived the task"

    record = load_run("last")
    assert (record.status, record.tasks[0].status) == ("interrupted", "aborted")
    log = read_transcript(record.transcript_path(record.tasks[0]))
    assert [m["role"] for m in log.messages][:3] == ["system", "user", "assistant"]
    assert log.messages[2]["tool_calls"][0]["function"]["arguments"] == {"command": SLOW}
    assert [r.status for r in log.results] == ["aborted"]


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
        pids = wait_for_pids(tmp_path, time.monotonic() + 15)
        term.send("half a li")  # typed, not sent: the prompt and the typing leave the screen
        term.expect("half a li")
        os.kill(term.pid, signal.SIGTERM)
        screen = term.expect("\n", timeout=15) + term.expect("\n") + term.expect("\n") + term.expect("\n")
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
