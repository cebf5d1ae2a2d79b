"""Background commands (`bash` with `"background": true`) as a model calls them: an id at once, the
same task tools as sub-agents, output capped on disk, one notice, and every process killed at the
command's end, its timeout, a cancel, the agent's end, Ctrl-C and SIGTERM; the sandbox, hooks and the
cap of 8 hold."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.events import Event
from mlx_subagents.runs.tasks import TaskSpec
from mlx_subagents.runs.transcripts import load_run
from mlx_subagents.tools.background_bash import CommandLog
from mlx_subagents.tools.processes import marked_processes
from tests.helpers import (
    SLOW,
    all_dead,
    call,
    go,
    make_runner,
    needs_sandbox,
    run_parent,
    scripted_host,
    spawn_cli,
    wait_for_pids,
    write_agent,
)

STARTED = (
    "Started in the background: {id} (killed after {timeout}s, or when your task ends). Carry on; a notice comes "
    "when it ends. task_output reads its output (wait to block until it ends), task_cancel stops it."
)


def bg(command: str, **more: Any) -> dict[str, Any]:
    return call("bash", command=command, background=True, **more)


def results(events: list[Event], label: str = "scout") -> list[str]:
    return [e.data["output"] for e in events if e.kind == "tool_result" and e.label == label]


def scout_run(tmp_path: Path, replies: list[Any], **options: Any) -> tuple[Any, list[Event], Any]:
    host = scripted_host({"agents": {"scout": {"replies": replies}}})
    events: list[Event] = []
    result = go(make_runner(tmp_path, host, events, **options), "run", TaskSpec("scout", "check"))
    return result, events, host


def test_a_background_command_returns_its_id_at_once_and_task_output_reads_it(tmp_path: Path) -> None:
    replies = [
        bg("sleep 0.3; echo building; echo 5 passed"),
        call("task_output", id="bash#1", wait=10),
        "the tests pass",
    ]
    result, events, _ = scout_run(tmp_path, replies)

    assert result.ok, result.error
    started, read = results(events)
    assert started == STARTED.format(id="bash#1", timeout=120)
    assert read == "bash#1 completed ($ sleep 0.3; echo building; echo 5 passed)\n\nbuilding\n5 passed\n"
    calls = [e.data["description"] for e in events if e.kind == "tool_call"]
    assert calls[0] == "$ (background) sleep 0.3; echo building; echo 5 passed"
    # its output is kept in the run's folder, next to the transcripts
    log = load_run(result.run_id).folder / "commands" / "bash_1.log"
    assert log.read_text() == "building\n5 passed\n"


def test_claude_codes_run_in_background_starts_it_in_the_background(tmp_path: Path) -> None:
    """Where the grammar is off a model may spell it as Claude Code's Bash does; it was ignored, and the
    command ran in the foreground."""
    replies = [call("bash", command="echo on", run_in_background=True), call("task_output", id="bash#1", wait=10), "ok"]
    result, events, _ = scout_run(tmp_path, replies, grammar=False)

    assert result.ok, result.error
    assert results(events) == [STARTED.format(id="bash#1", timeout=120), "bash#1 completed ($ echo on)\n\non\n"]
    assert [e.data["description"] for e in events if e.kind == "tool_call"][0] == "$ (background) echo on"


def test_its_end_is_a_notice_at_the_next_turn_once(tmp_path: Path) -> None:
    replies = [bg("echo all green"), call("bash", command="sleep 0.5"), call("ls", path="."), "done"]
    result, events, host = scout_run(tmp_path, replies)

    assert result.ok, result.error
    notice = "[notice] bash#1 completed: all green; read it with task_output"
    sent = host.history["scout"]  # what each turn's model call was sent
    assert [m["content"] for m in sent[2] if m["role"] == "user"][-1] == notice  # the turn after it ended
    assert sum(m.get("content") == notice for m in sent[3]) == 1  # in the conversation once, never again
    ended = [e.data for e in events if e.kind == "task_notice"]
    assert [(n["id"], n["status"], n["first_line"]) for n in ended] == [("bash#1", "completed", "all green")]


def test_the_agents_end_kills_and_sweeps_what_its_commands_started(tmp_path: Path) -> None:
    escaped = "setsid sleep 30 & echo $! > escaped.pid; " + SLOW  # one leaves the group, as a daemon would
    # The next turn waits for the pid files (not a fixed time, which a loaded machine may need more than).
    started = "until [ -s escaped.pid ] && [ -s sleep.pid ]; do sleep 0.05; done"
    result, events, _ = scout_run(tmp_path, [bg(escaped), call("bash", command=started), "answered at once"])

    assert result.ok, result.error
    pids = wait_for_pids(tmp_path, time.monotonic() + 5) + [int((tmp_path / "escaped.pid").read_text())]
    assert all_dead(pids)
    assert results(events)[0] == STARTED.format(id="bash#1", timeout=120)


def test_a_timeout_a_cancel_and_an_exit_code_each_end_a_command(tmp_path: Path) -> None:
    replies = [
        bg("sleep 30", timeout=1),
        bg(SLOW),
        bg("echo broken >&2; exit 3"),
        call("task_output", id="bash#1", wait=10),
        call("task_cancel", id="bash#2"),
        call("task_output", id="bash#2", wait=10),
        call("task_output", id="bash#3", wait=10),
        "done",
    ]
    result, events, _ = scout_run(tmp_path, replies)

    assert result.ok, result.error
    out = results(events)
    assert out[3] == "bash#1 failed: timed out after 1s; its process group was killed ($ sleep 30)\n\n(no output)"
    assert out[4] == "bash#2 is being cancelled; task_output shows what it had done"
    assert out[5].startswith("bash#2 aborted: cancelled by its parent ($ echo $$ > bash.pid;")
    assert out[6] == "bash#3 failed: exit code 3 ($ echo broken >&2; exit 3)\n\nbroken\n"
    failed = [e.data["is_error"] for e in events if e.kind == "tool_result"][3:7]
    assert failed == [True, False, True, True]  # an end other than exit 0 is an error result
    assert all_dead([int((tmp_path / "bash.pid").read_text()), int((tmp_path / "sleep.pid").read_text())])


def test_the_ninth_live_task_is_refused_in_one_line(tmp_path: Path) -> None:
    replies = [bg(f"sleep 30; echo {i}") for i in range(9)] + ["gave up"]
    result, events, _ = scout_run(tmp_path, replies)

    assert result.ok, result.error
    out = results(events)
    assert out[:8] == [STARTED.format(id=f"bash#{i}", timeout=120) for i in range(1, 9)]
    ids = ", ".join(f"bash#{i}" for i in range(1, 9))
    assert out[8] == (
        f"Error: bash call refused: 8 background tasks are alive here ({ids}) and the limit is 8; wait for one to "
        "end (task_output with wait) or cancel one (task_cancel)"
    )
    # The agent answered: all eight died with it, the last one too (cancelled before its watch first ran).
    assert [p for p in marked_processes(f"{os.getpid()}-", prefix=True) if "sleep" in " ".join(p.cmdline())] == []


def test_output_past_the_cap_keeps_its_head_on_disk_and_its_tail(tmp_path: Path) -> None:
    log = CommandLog(tmp_path / "out.log", max_bytes=1000, tail_bytes=20)
    for i in range(300):
        log.add(f"line {i:04d}\n".encode())  # 10 bytes a line: 3,000 in all
    log.close()
    assert (tmp_path / "out.log").stat().st_size == 1000
    kept = "".join(f"line {i:04d}\n" for i in range(100))
    note = "[output truncated: 3,000 bytes in all; the first 1,000 are above, the last 20 below]"
    assert log.text() == f"{kept}\n{note}\nline 0298\nline 0299\n"
    assert log.last_line() == "line 0299"


@needs_sandbox
def test_a_sandboxed_command_writes_only_in_the_workspace(tmp_path: Path) -> None:
    outside = Path("/var/tmp") / f"mlx-subagents-bg-{uuid.uuid4().hex}"
    try:
        command = f"touch {outside} 2>&1; touch inside.txt && echo made"
        replies = [bg(command), call("task_output", id="bash#1", wait=10), "done"]
        result, events, _ = scout_run(tmp_path, replies, sandbox=True)
        assert result.ok, result.error
        read = results(events)[1]
        assert "Read-only file system" in read and read.endswith("made\n")
        assert (tmp_path / "inside.txt").exists() and not outside.exists()
    finally:
        outside.unlink(missing_ok=True)


def test_hooks_see_and_may_block_a_background_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    guard = tmp_path / "guard.py"
    guard.write_text(
        "import json, sys\nevent = json.load(sys.stdin)\n"
        "if event['tool_input'].get('background') and 'deploy' in event['tool_input']['command']:\n"
        "    print('no deploys in the background', file=sys.stderr); sys.exit(2)\n"
    )
    home = Path(os.environ["MLX_SUBAGENTS_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    hooks = {
        "PreToolUse": [
            {"matcher": "Bash", "hooks": [{"type": "command", "command": f"{shlex.quote(sys.executable)} {guard}"}]}
        ]
    }
    (home / "settings.json").write_text(json.dumps({"hooks": hooks}))
    result, events, _ = scout_run(tmp_path, [bg("echo deploy > ran.txt"), "stopped"])

    assert results(events) == ["Error: a PreToolUse hook blocked this call: no deploys in the background"]
    assert not (tmp_path / "ran.txt").exists()


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_kill_a_background_command(tmp_path: Path, write_script: Any, signum: int) -> None:
    model = write_script({"agents": {"scout": {"replies": [bg(SLOW), call("bash", command="sleep 30"), "never"]}}})
    proc = spawn_cli("run", "scout", "check", "-m", model, "-C", str(tmp_path))
    try:
        pids = wait_for_pids(tmp_path, time.monotonic() + 20)
        proc.send_signal(signum)
        proc.wait(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == (130 if signum == signal.SIGINT else 143)
    assert all_dead(pids)


@needs_sandbox
def test_one_board_holds_sub_agents_and_commands_and_one_set_of_tools_reads_both(tmp_path: Path) -> None:
    write_agent(tmp_path, "lead", "read, bash, subagent")
    script = {
        "agents": {
            "scout": {"replies": [{"content": "found app.py", "delay": 0.3}]},
            "lead": {
                "replies": [
                    call("subagent", agent="scout", task="find the app", background=True),
                    bg("echo build ok; exit 1"),
                    call("task_output", id="scout#1", wait=10),
                    call("task_output", id="bash#1", wait=10),
                    call("task_status"),
                    call("task_send", id="bash#1", message="hurry"),
                    "done",
                ]
            },
        }
    }
    events: list[Event] = []
    result = run_parent(make_runner(tmp_path, scripted_host(script), events, assume_yes=True), agent="lead")

    assert result.ok, result.error
    out = results(events, "lead")
    assert out[1] == STARTED.format(id="bash#1", timeout=120)
    assert out[2] == "scout#1 completed\n\nfound app.py"
    assert out[3] == "bash#1 failed: exit code 1 ($ echo build ok; exit 1)\n\nbuild ok\n"
    scout, command = out[4].splitlines()
    assert scout.startswith("scout#1 (scout) completed: turn 1, ")
    assert command.startswith("bash#1 (bash) failed: ") and command.endswith(
        "s, $ echo build ok; exit 1; exit code 1; last line: build ok"
    )
    assert out[5] == (
        "Error: task 'bash#1' is a command: it reads no messages (its stdin is empty); cancel it with task_cancel "
        "and start another"
    )
