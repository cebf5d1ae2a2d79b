"""Seams between a parent and its children (issue 44, item 7): children stopped by their parent's
timeout are saved as timed out, SubagentStop fires however a child ends, a fork stays readable after its
parent compacts, a chain's `{previous}` stays within the task cap, and no `subagent` tool at the depth
limit."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.caps import MAX_TASK_CHARS
from mlx_subagents.runs.prepared import Parent
from mlx_subagents.runs.tasks import ModelRef
from mlx_subagents.runs.transcripts import child_runs, load_run, read_transcript
from mlx_subagents.tools import Workspace
from tests.helpers import call, make_runner, run_parent, scripted_host, task_text, write_agent

HOOK_LOG = """\
import json, os, sys
event = json.load(sys.stdin)
with open(os.environ["HOOK_LOG"], "a") as log:
    log.write(json.dumps(event) + "\\n")
"""


def results_of(record: Any) -> list[Any]:
    return read_transcript(record.transcript_path(record.tasks[0])).results


@pytest.mark.slow
def test_children_stopped_by_their_parents_timeout_are_saved_as_timed_out_and_subagent_stop_fires(
    tmp_path: Path, write_script: Any, run_cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "hooks.jsonl"
    (tmp_path / "log.py").write_text(HOOK_LOG)
    home = Path(os.environ["MLX_SUBAGENTS_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    hook = [{"hooks": [{"type": "command", "command": f"{shlex.quote(sys.executable)} {tmp_path / 'log.py'}"}]}]
    (home / "settings.json").write_text(json.dumps({"hooks": {"SubagentStop": hook}}))
    monkeypatch.setenv("HOOK_LOG", str(log))
    # The parent waits 0.5 s before it delegates, so that its 2 s run out before its children's own do.
    start = {**call("subagent", agent="worker", task="build", background=True), "delay": 0.5}
    parent = [start, call("task_cancel", id="worker#1"), call("subagent", agent="scout", task="look"), "never"]
    model = write_script(
        {
            "agents": {
                "orchestrator": {"replies": parent},
                "worker": {"replies": [call("bash", command="sleep 30"), "never"]},
                "scout": {"replies": [{"content": "too late", "delay": 30}]},
            }
        }
    )

    code, out, err = run_cli("run", "orchestrator", "go", "-m", model, "-C", str(tmp_path), "--timeout", "2")

    assert code == 1, err
    run = load_run("last")
    [top] = results_of(run)
    assert (top.status, top.stop_reason, top.error) == ("failed", "timeout", "stopped by the timeout of 2s")
    children = {c.tasks[0].label: results_of(c)[-1] for c in child_runs(run)}
    scout = children["orchestrator > scout#1"]
    assert (scout.status, scout.stop_reason, scout.error) == (
        "failed",
        "timeout",
        "stopped by its parent's timeout of 2s",
    )
    worker = children["orchestrator > worker#1"]
    assert (worker.status, worker.stop_reason, worker.error) == ("aborted", "cancelled", "cancelled by its parent")
    stops = sorted(
        (e["label"], e["status"], e["stop_reason"])
        for e in map(json.loads, log.read_text().splitlines())
        if e["hook_event_name"] == "SubagentStop"
    )
    assert stops == [
        ("orchestrator > scout#1", "failed", "timeout"),
        ("orchestrator > worker#1", "aborted", "cancelled"),
    ]
    assert "aborted by the user (Ctrl-C)" not in err + log.read_text()


def test_a_forks_saved_run_stays_readable_after_its_parent_compacts(tmp_path: Path, run_cli: Any) -> None:
    write_agent(tmp_path, "lead", "read, subagent")
    big = "".join(f"line {i:03d}: settings value number {i} for the config parser\n" for i in range(200))
    (tmp_path / "big.txt").write_text(big)
    reads = [call("read", path="big.txt", offset=1 + 17 * i, limit=17) for i in range(5)]
    summary = "## Goal\nRead big.txt.\n## Progress\nRead it in windows of 17 lines."
    lead = [call("subagent", fork=True, task="note the plan"), *reads, summary, "lead is done"]
    script = {"context_window": 4200, "sessions": {"lead": {"replies": lead}, "lead > fork#1": {"replies": ["noted"]}}}
    result = run_parent(make_runner(tmp_path, scripted_host(script), assume_yes=True), agent="lead")

    assert (result.status, result.usage.compactions) == ("completed", 1), result.error
    parent = load_run(result.run_id)
    saved = [r for r in read_transcript(parent.transcript_path(parent.tasks[0])).records if r["type"] == "messages"]
    assert [r.get("compacted", False) for r in saved] == [True, False]  # what it replaced, kept for its fork
    fork = child_runs(parent)[0]
    messages = read_transcript(fork.transcript_path(fork.tasks[0])).messages
    assert messages is not None and messages[:3] == saved[0]["messages"][:3]
    assert [m["content"] for m in messages[-2:]][1] == "noted"

    code, out, err = run_cli("show", fork.run_id)
    assert code == 0, err
    assert f"fork of lead (run {parent.run_id}): its first 3 messages are its parent's" in out


def test_a_chains_previous_is_cut_to_the_task_cap_with_a_note(tmp_path: Path) -> None:
    answer = "x" * 25_000
    chain = [{"agent": "scout", "task": "find it"}, {"agent": "planner", "task": "plan from: {previous}"}]
    script = {
        "agents": {
            "orchestrator": {"replies": [call("subagent", chain=chain), "done"]},
            "scout": {"replies": [answer]},
            "planner": {"replies": ["planned"]},
        }
    }
    host = scripted_host(script)
    result = run_parent(make_runner(tmp_path, host))

    assert result.ok, result.error
    [sent] = host.history["orchestrator > planner#1"]
    note = "\n[the previous step's answer is cut here, to keep this task within 20,000 characters: it has 25,000]"
    task = "plan from: " + "x" * (MAX_TASK_CHARS - len("plan from: ") - len(note)) + note
    assert len(task) == MAX_TASK_CHARS
    assert sent[1]["content"] == task_text(task, tmp_path)


def test_no_subagent_tool_is_offered_at_the_depth_limit_or_with_max_depth_zero(tmp_path: Path) -> None:
    host = scripted_host(["x"])
    orchestrator = make_runner(tmp_path, host).catalog.get("orchestrator")

    def tools(max_depth: int, depth: int) -> list[str]:
        runner = make_runner(tmp_path, host, max_depth=max_depth)
        return list(runner.board_tools(Parent(orchestrator, "o", depth, ModelRef("m"), None), Workspace(tmp_path)))

    assert tools(2, 1)[:1] == ["subagent"]
    assert tools(2, 2) == ["parent_send"] and tools(0, 0) == []  # no subagent, nor task tools to go with it

    script = {"agents": {"orchestrator": {"replies": [call("subagent", agent="scout", task="x"), "did it myself"]}}}
    called = scripted_host(script)
    result = run_parent(make_runner(tmp_path, called, max_depth=0))
    assert result.output == "did it myself"
    [first, _] = called.history["orchestrator"]
    assert first[0]["role"] == "system"
    refused = [m["content"] for m in read_transcript(Path(result.transcript)).messages if m["role"] == "tool"]
    assert refused == [
        "Error: delegation refused: this agent already runs at depth 0 and the limit is 0 (max_depth); do the task "
        "yourself with your other tools"
    ]
