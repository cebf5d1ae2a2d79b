"""`subagent chat` with sub-agents in the background, in a real pseudo-terminal: the parent's turn ends
while they run, their notices print while the user sits at the prompt, `/tasks`, `/send` and
`/cancel` act on them, and Ctrl-C stops the turn first and the background sub-agents on the next press."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.runs.transcripts import load_run, read_transcript
from tests.helpers import SLOW, Terminal, alive, all_dead, call, wait_for_pids

pytestmark = [pytest.mark.slow, pytest.mark.process]


def child_runs(parent_folder: Path) -> dict[str, Any]:
    """The runs a chat's sub-agents saved inside its run folder, by their id (`worker#1`)."""
    records = [load_run(p.name, home=parent_folder) for p in sorted((parent_folder / "runs").iterdir())]
    return {r.tasks[0].label.rsplit(" > ", 1)[-1]: r for r in records}


def test_tasks_send_cancel_and_notices_at_the_prompt(tmp_path: Path, write_script: Any) -> None:
    start = call(
        "subagent",
        tasks=[{"agent": "worker", "task": "run the slow check"}, {"agent": "scout", "task": "find the app"}],
        background=True,
        notify="each",  # a notice as each ends, not one when both have
    )
    model = write_script(
        {
            "agents": {
                "orchestrator": {"replies": [start, "Both are on it."]},
                "worker": {"replies": [call("bash", command=SLOW), "never"]},
                # the scout answers after the parent's turn has ended: its notice comes at the prompt
                "scout": {"replies": [{"content": "app.py:1", "delay": 3}, "tests/test_app.py:3"]},
            }
        }
    )
    term = Terminal(["chat", "-m", model, "-C", str(tmp_path), "--no-wake"])  # notices at the prompt, not waking
    try:
        term.expect("/exit leaves\n> ")
        term.send("start them\n")
        term.expect("Both are on it.\n> ")
        term.send("/ta")  # half a command typed when the scout's notice comes
        # the notice prints above the prompt, which comes back with what was typed, and typing goes on
        term.expect("● scout#1 completed: app.py:1\n> /ta")
        pids = wait_for_pids(tmp_path, time.monotonic() + 60)
        term.send("sks\n")
        table = term.expect("\n> ").splitlines()
        assert re.split(r"\s+", table[1].strip()) == [
            "id",
            "agent",
            "status",
            "turn",
            "tokens",
            "last",
            "tool",
            "elapsed",
        ]
        worker = re.split(r"\s{2,}", table[2].strip())
        assert worker[:4] == ["worker#1", "worker", "running", "1"]
        assert worker[5].startswith("$ echo $$ > bash.pid")
        scout = re.split(r"\s{2,}", table[3].strip())
        assert scout[:5] == ["scout#1", "scout", "completed", "1", scout[4]] and scout[5] == "-"

        term.send("/send scout#1 and where is it tested?\n")
        term.expect("sent to scout#1: it resumes with it\n")
        term.expect("● scout#1 completed: tests/test_app.py:3\n> ")
        term.send("/send worker#1 hurry up\n")
        term.expect("sent to worker#1: it reads it at its next turn\n> ")

        term.send("/cancel nobody\n")
        term.expect("no task 'nobody' here; the tasks started here are: worker#1, scout#1\n> ")
        term.send("/send worker#1\n")
        term.expect("usage: /send ID TEXT (background sub-agents: worker#1, scout#1)\n> ")
        assert all(alive(p) for p in pids)
        term.send("/cancel worker#1\n")
        term.expect("cancelling worker#1\n")
        term.expect("● worker#1 aborted: cancelled by the user\n> ")
        assert all_dead(pids), "the cancelled sub-agent's bash survived"
        term.send("/cancel worker#1\n")
        term.expect("task 'worker#1' is not running (it aborted); nothing to cancel\n> ")

        term.send("/usage\n")
        usage = term.expect("saved as run ")
        assert re.search(r"sub-agents: 2 started, 3 turns, .*; 2 in the background, 0 running\n", usage)
        term.send("/exit\n")
        assert term.wait() == 0
    finally:
        term.close()

    record = load_run("last")
    children = child_runs(record.folder)
    assert (children["worker#1"].status, children["worker#1"].tasks[0].status) == ("interrupted", "aborted")
    scout = read_transcript(children["scout#1"].transcript_path(children["scout#1"].tasks[0]))
    assert [m["content"] for m in scout.messages if m["role"] in ("user", "assistant")][1:] == [
        "app.py:1",
        "and where is it tested?",
        "tests/test_app.py:3",
    ]


def test_ctrl_c_stops_the_turn_then_the_background_sub_agents(tmp_path: Path, write_script: Any) -> None:
    model = write_script(
        {
            "agents": {
                "orchestrator": {
                    "replies": [
                        call("subagent", agent="worker", task="run the slow check", background=True),
                        call("subagent", agent="scout", task="take your time"),  # waited for: the turn goes on
                        "still here",
                    ]
                },
                "worker": {"replies": [call("bash", command=SLOW), "never"]},
                "scout": {"replies": [{"content": "late", "delay": 60}]},
            }
        }
    )
    term = Terminal(["chat", "-m", model, "-C", str(tmp_path)])
    try:
        term.expect("/exit leaves\n> ")
        term.send("start it\n")
        pids = wait_for_pids(tmp_path, time.monotonic() + 60)
        term.expect("↳ scout#1 (scout) started")
        term.send("\x03")
        shown = term.expect("the chat goes on (/exit leaves)\n> ")
        assert "1 background sub-agent(s) run on (Ctrl-C again stops them too)" in shown
        assert "✗ scout#1 aborted" in shown
        assert all(alive(p) for p in pids), "the first Ctrl-C stopped a background sub-agent"
        term.send("/tasks\n")
        assert re.search(r"worker#1\s+worker\s+running", term.expect("\n> "))

        term.send("\x03")  # at the prompt, with a sub-agent running: it stops
        term.expect("stopping 1 background sub-agent(s): worker#1\n")
        term.expect("● worker#1 aborted: cancelled by the user\n> ")
        assert all_dead(pids)
        term.send("\x03")  # nothing left to stop: a hint
        term.expect("(Ctrl-C stops a running turn; /exit or Ctrl-D leaves)\n> ")
        term.send("are you there?\n")
        term.expect("still here\n> ")
        term.send("\x04")
        assert term.wait() == 0
    finally:
        term.close()


def test_leaving_the_chat_cancels_the_background_sub_agents(tmp_path: Path, write_script: Any) -> None:
    model = write_script(
        {
            "agents": {
                "orchestrator": {
                    "replies": [call("subagent", agent="worker", task="run the slow check", background=True), "ok"]
                },
                "worker": {"replies": [call("bash", command=SLOW), "never"]},
            }
        }
    )
    term = Terminal(["chat", "-m", model, "-C", str(tmp_path)])
    try:
        term.expect("/exit leaves\n> ")
        term.send("start it\n")
        term.expect("ok\n> ")
        pids = wait_for_pids(tmp_path, time.monotonic() + 60)
        term.send("/exit\n")
        term.expect("stopping 1 background sub-agent(s): worker#1\n")
        assert term.wait() == 0
    finally:
        term.close()
    assert all_dead(pids)
    child = child_runs(load_run("last").folder)["worker#1"]
    assert (child.status, child.tasks[0].status) == ("interrupted", "aborted")


def wake_script(write_script: Any) -> str:
    start = call("subagent", agent="scout", task="find the app", background=True)
    return write_script(
        {
            "agents": {
                "orchestrator": {"replies": [start, "Started it.", "The scout says app.py:1."]},
                "scout": {"replies": [{"content": "app.py:1", "delay": 1.5}]},
            }
        }
    )


def user_messages() -> list[str]:
    run = load_run("last")
    return [m["content"] for m in read_transcript(run.transcript_path(run.tasks[0])).messages if m["role"] == "user"]


@pytest.mark.parametrize("attached", [False, True], ids=["standalone", "attached"])
def test_a_background_childs_end_wakes_a_waiting_chat(
    tmp_path: Path, write_script: Any, serve_process: Any, attached: bool
) -> None:
    """A chat attached to `subagent serve` never woke on a background end (a standalone chat does)."""
    model = wake_script(write_script)
    if attached:
        serve_process("--no-http", "--model", model)
    term = Terminal(["chat", "-m", model, "-C", str(tmp_path)])
    try:
        term.expect("/exit leaves\n> ")
        term.send("find the app\n")
        term.expect("Started it.\n> ")
        # nothing typed: the scout's end starts the parent's next turn, with its notice as the message
        shown = term.expect("The scout says app.py:1.\n> ")
        assert "● scout#1 completed: app.py:1" in shown
        assert "the parent goes on from the notice (/wake off waits for your message)" in shown
        term.send("/exit\n")
        assert term.wait() == 0
    finally:
        term.close()
    assert user_messages()[1:] == ["[notice] scout#1 completed:\napp.py:1\n\n[task_send continues scout#1]"]


def test_wake_off_waits_for_the_persons_message(tmp_path: Path, write_script: Any) -> None:
    term = Terminal(["chat", "-m", wake_script(write_script), "-C", str(tmp_path)])
    try:
        term.expect("/exit leaves\n> ")
        term.send("/wake off\n")
        term.expect("the parent waits for your message when a background sub-agent ends\n> ")
        term.send("find the app\n")
        term.expect("Started it.\n> ")
        term.expect("● scout#1 completed: app.py:1")
        time.sleep(1)  # time the wake would have had
        term.send("what did it find?\n")
        shown = term.expect("The scout says app.py:1.\n> ")
        assert "the parent goes on from the notice" not in shown
        term.send("/exit\n")
        assert term.wait() == 0
    finally:
        term.close()
    assert user_messages()[1:] == [
        "what did it find?\n\n[notice] scout#1 completed:\napp.py:1\n\n[task_send continues scout#1]"
    ]


def test_a_childs_message_wakes_a_waiting_chat(tmp_path: Path, write_script: Any) -> None:
    start = call("subagent", agent="scout", task="find the app", background=True)
    said = call("parent_send", message="app.py so far")
    model = write_script(
        {
            "agents": {
                "orchestrator": {"replies": [start, "Started it.", "Noted: app.py so far."]},
                "scout": {"replies": [{**said, "delay": 0.5}, {"content": "app.py:1", "delay": 30}]},
            }
        }
    )
    term = Terminal(["chat", "-m", model, "-C", str(tmp_path)])
    try:
        term.expect("/exit leaves\n> ")
        term.send("find the app\n")
        term.expect("Started it.\n> ")
        # nothing typed: the scout's message starts the parent's next turn, while the scout works on
        shown = term.expect("Noted: app.py so far.\n> ")
        assert "✉ scout#1: app.py so far" in shown
        term.send("/exit\n")  # leaving cancels the scout
        assert term.wait() == 0
    finally:
        term.close()
    assert user_messages()[1:] == ["[message from scout#1] app.py so far"]
