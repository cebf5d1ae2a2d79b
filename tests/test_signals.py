"""SIGTERM and SIGHUP to a real `subagent` process: stop, kill every tool process, save, exit 128 + N."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from helpers import all_dead, call, spawn_cli

from mlx_subagents.transcripts import load_run, read_transcript

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
