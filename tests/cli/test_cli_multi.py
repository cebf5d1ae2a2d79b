"""`subagent parallel / chain / workflow`: output, exit codes, events, limits and Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.runs.transcripts import load_run, read_transcript, runs_dir
from tests.helpers import REPO, alive, call

RESULT_FIELDS = {
    "agent",
    "children",
    "worktree",
    "task",
    "status",
    "output",
    "reasoning",
    "error",
    "usage",
    "model",
    "tool_mode",
    "stop_reason",
    "duration_s",
    "label",
    "step_id",
    "run_id",
    "transcript",
    "parsed",
}


@pytest.fixture
def script(write_script: Any) -> str:
    return write_script(
        {
            "agents": {
                "scout": {"replies": [call("ls", path="."), {"content": "scout: src/auth.py", "delay": 0.2}]},
                "reviewer": {"replies": ["reviewer: looks fine"]},
                "planner": {"replies": ["planner: 1. fix it"]},
            }
        }
    )


def test_parallel_json(tmp_path: Path, script: str, run_cli: Any) -> None:
    code, out, err = run_cli(
        "parallel",
        "-t",
        "scout",
        "map auth",
        "-t",
        "reviewer",
        "review db.py",
        "-t",
        "scout",
        "map db",
        "-m",
        script,
        "-C",
        str(tmp_path),
        "--json",
    )
    data = json.loads(out)
    assert code == 0, err
    assert {k: data[k] for k in ("mode", "succeeded", "total", "interrupted", "error")} == {
        "mode": "parallel",
        "succeeded": 3,
        "total": 3,
        "interrupted": False,
        "error": None,
    }
    assert [(r["label"], r["task"], r["output"]) for r in data["results"]] == [
        ("scout-1", "map auth", "scout: src/auth.py"),
        ("reviewer", "review db.py", "reviewer: looks fine"),
        ("scout-2", "map db", "scout: src/auth.py"),
    ]
    assert all(set(r) == RESULT_FIELDS for r in data["results"])
    assert data["run_id"] == load_run("last").run_id
    assert err.splitlines()[-2:] == ["3/3 succeeded", f"saved as run {data['run_id']} (subagent show {data['run_id']})"]


def test_parallel_text_and_a_failure_exits_1(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    model = write_script(
        {"agents": {"scout": {"replies": ["found [it]"]}, "planner": {"replies": [call("ls", path=".")] * 3}}}
    )
    code, out, err = run_cli(
        "parallel", "-t", "scout", "a", "-t", "planner", "b", "-m", model, "-C", str(tmp_path), "--max-turns", "2"
    )
    assert code == 1
    lines = out.splitlines()
    assert lines[0].startswith("scout (scout) · completed ") and lines[1] == "found [it]"
    assert lines[2].startswith("planner (planner) · failed ")
    assert lines[3] == "error: reached the limit of 2 turns without a final answer"
    assert "[scout] started (scout)" in err and "[planner] failed: reached the limit of 2 turns" in err
    assert "1/2 succeeded" in err.splitlines()
    table = [line.split() for line in err.splitlines() if line.startswith(("task ", "scout ", "planner ", "total "))]
    assert [row[:4] for row in table[:3]] == [
        ["task", "agent", "status", "stop"],
        ["scout", "scout", "completed", "completed"],
        ["planner", "planner", "failed", "max_turns"],
    ]
    assert table[3][:2] == ["total", "3"]


def test_parallel_from_a_file_with_events(tmp_path: Path, script: str, run_cli: Any) -> None:
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text("- {agent: scout, task: map auth, label: auth}\n- {agent: planner, task: plan}\n")
    code, out, err = run_cli(
        "parallel",
        "--file",
        str(tasks),
        "-t",
        "reviewer",
        "review",
        "-m",
        script,
        "-C",
        str(tmp_path),
        "--events",
        "--json",
        "-j",
        "1",
    )
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 0, err
    final, events = lines[-1], lines[:-1]
    assert [r["label"] for r in final["results"]] == ["auth", "planner", "reviewer"]
    assert [(e["kind"], e["label"]) for e in events if e["kind"] in ("task_start", "task_end")] == [
        ("task_start", "auth"),
        ("task_end", "auth"),
        ("task_start", "planner"),
        ("task_end", "planner"),
        ("task_start", "reviewer"),
        ("task_end", "reviewer"),
    ]
    auth = [e["kind"] for e in events if e["label"] == "auth"]
    assert auth == [
        "task_start",
        "turn_start",
        "prefill",
        "decode",
        "usage",
        "tool_call",
        "tool_result",
        "turn_start",
        "prefill",
        "text",
        "decode",
        "usage",
        "message",
        "task_end",
    ]
    assert all(isinstance(e["time"], float) and e["agent"] for e in events)
    end = next(e for e in events if e["kind"] == "task_end" and e["label"] == "auth")
    assert (end["data"]["status"], end["data"]["usage"]["turns"]) == ("completed", 2)


def test_chain_previous_and_where_it_stopped(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    model = write_script(
        {
            "agents": {
                "scout": {"replies": ["src/parse.py"]},
                "planner": {"replies": ["plan it"]},
                "reviewer": {"replies": [{"content": "slow", "delay": 5}]},
            }
        }
    )
    code, out, err = run_cli(
        "chain",
        "-s",
        "scout",
        "find the parser",
        "-s",
        "planner",
        "plan a fix for: {previous}",
        "-m",
        model,
        "-C",
        str(tmp_path),
        "--json",
    )
    data = json.loads(out)
    assert code == 0, err
    assert [(r["step_id"], r["task"], r["output"]) for r in data["results"]] == [
        ("1", "find the parser", "src/parse.py"),
        ("2", "plan a fix for: src/parse.py", "plan it"),
    ]

    code, out, err = run_cli(
        "chain",
        "-s",
        "scout",
        "find",
        "-s",
        "reviewer",
        "review {previous}",
        "-s",
        "planner",
        "plan {previous}",
        "-m",
        model,
        "-C",
        str(tmp_path),
        "--timeout",
        "0.2",
    )
    assert code == 1
    assert "Chain stopped at step 2: stopped by the timeout of 0.2s" in err.splitlines()
    assert "1/3 succeeded" in err.splitlines()
    assert "step 3: planner (planner) · failed" in out and "error: not run: step '2' did not complete" in out
    assert load_run("last").error == "Chain stopped at step 2: stopped by the timeout of 0.2s"


def test_workflow_by_name_and_by_file(tmp_path: Path, script: str, run_cli: Any) -> None:
    folder = tmp_path / ".mlx-subagents" / "workflows"
    folder.mkdir(parents=True)
    (folder / "review.toml").write_text(
        '[[steps]]\nid = "map"\nagent = "scout"\nprompt = "Map {input}"\n\n'
        '[[steps]]\nid = "check"\nagent = "reviewer"\nprompt = "Check the map"\nneeds = ["map"]\n'
    )
    code, out, err = run_cli(
        "workflow", "review", "--input", "the auth code", "-m", script, "-C", str(tmp_path), "--json"
    )
    data = json.loads(out)
    assert code == 0, err
    assert [(r["step_id"], r["task"]) for r in data["results"]] == [
        ("map", "Map the auth code"),
        ("check", "Check the map\n\nWorkflow input:\nthe auth code\n\nAnswer of step 'map':\nscout: src/auth.py"),
    ]
    code, _, err = run_cli("workflow", str(folder / "review.toml"), "-m", script, "-C", str(tmp_path), "-q")
    assert (code, err.splitlines()[-2]) == (0, "2/2 succeeded")
    code, out, _ = run_cli("workflows", "-C", str(tmp_path))
    assert out.split() == ["review", str(folder / "review.toml")]


def test_bad_input_is_one_line_and_runs_nothing(tmp_path: Path, script: str, run_cli: Any) -> None:
    cycle = tmp_path / "cycle.toml"
    cycle.write_text('[[steps]]\nid = "a"\nagent = "scout"\nprompt = "p"\nneeds = ["a"]\n')
    schema = tmp_path / "schema.json"
    schema.write_text("{not json")
    cases = [
        (("workflow", str(cycle)), f"error: {cycle}: step 'a' needs itself; remove 'a' from its needs"),
        (
            ("workflow", "nope"),
            "error: unknown workflow 'nope'; available: none (put NAME.toml in .mlx-subagents/workflows/)",
        ),
        (
            ("parallel", "-t", "scout", "x" * 20_001),
            "error: task 'scout' is 20,001 characters, over the limit of 20,000; shorten it, or put the details in a "
            "file the agent can read",
        ),
        (
            ("parallel", *sum((["-t", "scout", "x"] for _ in range(9)), [])),
            "error: 9 tasks is more than the limit of 8 per run; split the work into several runs",
        ),
        (
            ("parallel", "-t", "scout", "a", "-t", "planner"),
            "error: each -t AGENT needs its task text right after it (got 2 agents and 1 texts); quote a task that has "
            'spaces: -t scout "map the auth code"',
        ),
        (
            ("chain", "-s", "scout", "{previous}"),
            "error: step 1 uses {previous}, but there is no previous step; remove it from the first task",
        ),
        (
            ("parallel", "-t", "scout", "a", "--schema", str(schema)),
            f"error: {schema}: invalid JSON at line 1 column 2: Expecting property name enclosed in double quotes",
        ),
    ]
    for args, message in cases:
        code, out, err = run_cli(*args, "-m", script, "-C", str(tmp_path))
        assert (code, out, err) == (2, "", message + "\n"), args
    code, _, err = run_cli("parallel", "-t", "scout", "a", "-j", "9", "-m", script)
    assert code == 2 and "Invalid value for '--concurrency'" in err and "Traceback" not in err
    assert not runs_dir().exists()


def test_schema_output_through_the_cli(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "required": ["files"]}))
    model = write_script(
        {
            "agents": {
                "scout": {"replies": ["not json", '{"files": ["a.py"]}']},
                "planner": {"replies": ["nope", "still nope"]},
            }
        }
    )
    code, out, _ = run_cli(
        "parallel",
        "-t",
        "scout",
        "a",
        "-t",
        "planner",
        "b",
        "--schema",
        str(schema),
        "-m",
        model,
        "-C",
        str(tmp_path),
        "--json",
    )
    scout, planner = json.loads(out)["results"]
    assert code == 1
    assert (scout["status"], scout["parsed"]) == ("completed", {"files": ["a.py"]})
    assert (planner["status"], planner["stop_reason"]) == ("failed", "schema")
    assert planner["error"].startswith(
        "the final answer is not valid against the output schema after one retry: the answer is not valid JSON"
    )


# -- Ctrl-C -----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize("mode", ["parallel", "run"])
def test_ctrl_c_stops_every_task_and_kills_their_processes(tmp_path: Path, write_script: Any, mode: str) -> None:
    # Everything left alone runs 300 s: an exit within the 60 s below is the Ctrl-C's doing, on any load.
    command = "echo $$ > bash.pid; sleep 300 & echo $! > sleep.pid; wait"
    model = write_script(
        {
            "agents": {
                "scout": {"replies": [call("bash", command=command), "never"]},
                "planner": {"replies": [{"content": "never", "delay": 300}]},
            }
        }
    )
    args = (
        ["parallel", "-t", "scout", "a", "-t", "planner", "b", "-t", "planner", "c", "-j", "2"]
        if mode == "parallel"
        else ["run", "scout", "a"]
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_subagents.cli", *args, "-m", model, "-C", str(tmp_path)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not ((tmp_path / "sleep.pid").is_file() and (tmp_path / "sleep.pid").read_text().strip()):
            assert time.monotonic() < deadline and proc.poll() is None, "the bash command never started"
            time.sleep(0.05)
        pids = [int((tmp_path / name).read_text()) for name in ("bash.pid", "sleep.pid")]
        assert all(alive(pid) for pid in pids)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - sent
    finally:
        proc.kill()
        proc.wait()

    assert proc.returncode == 130, err
    assert elapsed < 60  # stopped at the Ctrl-C (a second or a few on a loaded CI), not at the 300 s sleep's end
    assert not any(alive(pid) for pid in pids)
    assert "Traceback" not in err
    record = load_run("last")
    assert record.status == "interrupted"
    if mode == "parallel":
        assert err.splitlines()[-1] == "aborted: scout, planner-1, planner-2"
        assert [t.status for t in record.tasks] == ["aborted"] * 3
        assert record.tasks[2].file is None  # queued behind -j 2: never started
    else:
        assert err.splitlines()[-1] == "aborted: scout"
    log = read_transcript(record.transcript_path(record.tasks[0]))
    assert log.results[-1].stop_reason == "cancelled"
    assert log.messages[-1]["tool_calls"][0]["function"]["arguments"]["command"] == command
