"""The live status of a running command: a line per running agent on a terminal's stderr (label, turn,
what it does, elapsed), never on a pipe, never in stdout."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from mlx_subagents.cli.live import LiveView, status_line
from mlx_subagents.events import (
    DecodeData,
    Event,
    PrefillData,
    TaskEndData,
    TaskStartData,
    TextData,
    ToolCallData,
    TurnStartData,
    WaitingData,
)
from mlx_subagents.runs.live import LiveTasks
from tests.helpers import ANSI, call, cli_env

# The scout's two replies take a while each, so that the live line is drawn during them.
SLOW_SCOUT = {
    "agents": {
        "scout": {
            "replies": [
                {**call("ls", path="."), "delay": 0.8},
                {"content": "Findings:\n- notes.txt\n\nSummary: one file.", "delay": 0.8, "stall": 0.6},
            ]
        }
    }
}
ANSWER = "Findings:\n- notes.txt\n\nSummary: one file."


def event(kind: Any, label: str, data: Any, turn: int = 1, agent: str = "scout") -> Event:
    return Event(kind=kind, label=label, agent=agent, turn=turn, data=data)


def test_each_activity_reads_from_the_events_in_the_views_words() -> None:
    tasks = LiveTasks([("scout", "scout")])
    seen = [tasks.tasks["scout"].describe()]
    steps = [
        event("waiting", "scout", WaitingData(waiting_for="the writer lease", reason="writers take turns"), 0),
        event("waiting", "scout", WaitingData(waiting_for="a slot", reason="every slot is taken"), 0),
        event("task_start", "scout", TaskStartData(task="t", model="m", tool_mode="native"), 0),
        event("turn_start", "scout", TurnStartData()),
        event("prefill", "scout", PrefillData(tokens=901, cached=0)),
        event("decode", "scout", DecodeData(tokens=1, tps=0.0)),
        event("decode", "scout", DecodeData(tokens=7, tps=6.1)),
        event("tool_call", "scout", ToolCallData(name="bash", arguments={}, description="bash pytest -q")),
        event("turn_start", "scout", TurnStartData(), 2),
        event("prefill", "scout", PrefillData(tokens=40, cached=950), 2),
        event("task_end", "scout", TaskEndData(status="completed", stop_reason="completed", error=None), 2),
    ]
    for step in steps:
        tasks.handle(step)
        seen.append(tasks.tasks["scout"].describe())
    assert seen == [
        "queued",
        "waiting for the writer lease",
        "waiting for a slot",  # it was shown only as queued, or not at all (a sub-agent)
        "starting",
        "waiting for the model",
        "prefilling 901 tokens",
        "decoding",
        "decoding at 6.1 tok/s",
        "running bash pytest -q",
        "waiting for the model",
        "prefilling 40 tokens (950 cached)",
        "done",
    ]


def test_a_sub_agent_is_shown_under_its_parent_with_the_line_it_is_writing() -> None:
    view = LiveView(Console(file=open(os.devnull, "w")), "task")
    start = TaskStartData(task="t", model="m", tool_mode="native")
    for label in ("lead", "lead > scout#1"):
        view.handle(event("task_start", label, start, 0))
        view.handle(event("turn_start", label, TurnStartData()))
    view.handle(event("text", "lead > scout#1", TextData(text="Findings:\n- src/app.py:4 parses it")))
    view.handle(event("decode", "lead > scout#1", DecodeData(tokens=12, tps=5.5)))
    lines = [status_line(task) for task in view.tasks.alive()]
    assert [line.rsplit(" · ", 1)[0] for line in lines] == [
        "[bold]lead[/] · turn 1 · [cyan]waiting for the model[/]",
        "  [bold]lead > scout#1[/] · turn 1 · [cyan]decoding at 5.5 tok/s[/]",
    ]
    assert lines[1].endswith("[dim]- src/app.py:4 parses it[/]")


def _run(args: list[str], *, stderr_tty: bool) -> tuple[int, bytes, str]:
    """`subagent ARGS` with stdout a pipe and stderr a pipe or a pseudo-terminal: exit code, stdout, stderr."""
    command = [sys.executable, "-m", "mlx_subagents.cli", *args]
    if not stderr_tty:
        done = subprocess.run(command, env=cli_env(), stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
        return done.returncode, done.stdout, done.stderr.decode()
    leader, follower = pty.openpty()
    with subprocess.Popen(
        command, env=cli_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=follower
    ) as process:
        os.close(follower)
        seen = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the process closed its end
                break
            if not chunk:
                break
            seen += chunk
        stdout = process.stdout.read() if process.stdout else b""
        code = process.wait(timeout=60)
    os.close(leader)
    return code, stdout, seen.decode(errors="replace")


@pytest.mark.slow
@pytest.mark.process
def test_the_live_status_is_drawn_on_a_terminal_and_never_on_a_pipe(tmp_path: Path, write_script: Any) -> None:
    (tmp_path / "notes.txt").write_text("hello\n")
    script = write_script(SLOW_SCOUT)
    args = ["run", "scout", "what is here?", "--model", script, "-C", str(tmp_path)]

    code, stdout, terminal = _run(args, stderr_tty=True)
    assert code == 0 and stdout.decode() == ANSWER + "\n"
    shown = ANSI.sub("", terminal)
    assert "scout · turn 1 · prefilling" in shown and "scout · turn 2 · prefilling" in shown
    assert "tokens (" in shown.partition("turn 2 · prefilling")[2]  # the second turn reuses what is cached
    assert "ls ." in shown  # the tool call's line, above the status

    code, stdout, piped = _run(args, stderr_tty=False)
    assert code == 0 and stdout.decode() == ANSWER + "\n"
    assert "prefilling" not in piped and "turn 1" not in piped and "\x1b" not in piped
    assert piped.splitlines()[0] == "ls ."

    code, stdout, _ = _run([*args, "-q"], stderr_tty=True)
    assert code == 0 and stdout.decode() == ANSWER + "\n"


@pytest.mark.slow
@pytest.mark.process
def test_with_json_stdout_is_the_same_whether_stderr_is_a_terminal_or_not(tmp_path: Path, write_script: Any) -> None:
    (tmp_path / "notes.txt").write_text("hello\n")
    script = write_script(SLOW_SCOUT)
    args = ["run", "scout", "what is here?", "--model", script, "-C", str(tmp_path), "--json"]
    _, on_terminal, terminal = _run(args, stderr_tty=True)
    _, on_pipe, _ = _run(args, stderr_tty=False)
    assert "prefilling" in ANSI.sub("", terminal)  # the live status was drawn meanwhile, on stderr

    def steady(stdout: bytes) -> dict[str, Any]:
        data = json.loads(stdout)
        return {k: v for k, v in data.items() if k not in ("duration_s", "run_id", "transcript")}

    assert b"\x1b" not in on_terminal and on_terminal.count(b"\n") == on_pipe.count(b"\n")
    assert steady(on_terminal) == steady(on_pipe) and steady(on_pipe)["output"] == ANSWER


# What a terminal obeys: OSC 52 writes the clipboard, ESC[2J clears the screen, OSC 0 sets the title,
# 0x9b is a CSI of its own, U+202E reverses what follows.
HOSTILE = "\x1b]52;c;cHduZWQ=\x07\x1b[2J\x1b]0;owned\x07\x9b2J\u202e"


@pytest.mark.slow
@pytest.mark.process
def test_text_the_program_did_not_make_reaches_the_terminal_escaped(tmp_path: Path, write_script: Any) -> None:
    """A model's text in the live line, a bash command in its event line: shown, never obeyed; a pipe
    gets the answer as it is."""
    script = write_script(
        {
            "agents": {
                "scout": {
                    "replies": [
                        {
                            "content": f"checking{HOSTILE}",
                            **call("bash", command=f"true '{HOSTILE}'; sleep 1.5"),
                            "delay": 0.8,
                        },
                        {"content": f"done{HOSTILE}", "delay": 0.8, "stall": 0.6},
                    ]
                }
            }
        }
    )
    code, stdout, terminal = _run(["run", "scout", "go", "--model", script, "-C", str(tmp_path)], stderr_tty=True)
    assert code == 0 and stdout.decode().startswith("done\x1b]52;c;cHduZWQ=")  # a pipe: the answer as it is
    for sequence in ("\x1b]", "\x1b[2J", "\x9b", "\u202e"):
        assert sequence not in terminal
    shown = ANSI.sub("", terminal)
    assert (
        "running $ true '\\x1b]52;c;cHduZWQ=\\x1b[2J\\x1b]0;owned\\x9b2J\\u202e'" in shown
    )  # the live line while the command runs (rich drops BEL itself)
    assert "checking\\x1b]52;c;cHduZWQ=" in shown  # the model's line, live
