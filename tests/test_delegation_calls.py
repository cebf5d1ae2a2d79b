"""What a parent's `subagent` call may choose and what it sees: the agents it may start, children that
fail alone, per-task choices, workflows, and what reaches the children (issue 26)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from helpers import call, write_agent

from mlx_subagents.runs.prepare import Parent
from mlx_subagents.runs.tasks import ModelRef
from mlx_subagents.runs.transcripts import load_run, read_transcript
from mlx_subagents.tools import Workspace


def tool_results(run_id: str = "last", home: Path | None = None) -> list[str]:
    """The tool results the first task of a saved run was given, in order."""
    record = load_run(run_id, home=home)
    return [
        m["content"] for m in read_transcript(record.transcript_path(record.tasks[0])).messages if m["role"] == "tool"
    ]


# -- the agents the model sees ---------------------------------------------------------------------


def test_the_description_lists_only_the_granted_agents_and_the_first_warnings(
    tmp_path: Path, scripted_runner: Any
) -> None:
    lead = write_agent(tmp_path, "lead", "read, subagent", "agents: scout, planner, ghost\n")
    folder = lead.parent
    for i in range(7):
        (folder / f"broken{i}.md").write_text("no frontmatter\n")
    runner = scripted_runner(["x"], assume_yes=True)
    parent = Parent(runner.catalog.get("lead"), "lead", 0, ModelRef("m"), None)

    description = runner.delegation_tools(parent, Workspace(tmp_path))["subagent"].schema()["function"]["description"]

    warnings = runner.catalog.all_warnings()
    assert len(warnings) == 7
    assert description.endswith(
        "Agents:\n"
        "- planner: Turns a task into a short, concrete plan (steps, files to touch, risks). Never edits files.\n"
        "- scout: Finds where things are in the codebase and reports exact file locations. Never edits files.\n"
        "Agent-file warnings:\n" + "".join(f"- {w}\n" for w in warnings[:5]) + "- (2 more)"
    )


# -- children that fail alone ----------------------------------------------------------------------


def test_each_child_that_cannot_start_fails_alone_under_a_grant(
    tmp_path: Path, write_script: Any, run_cli: Any, monkeypatch: Any
) -> None:
    tasks = [
        {"agent": "scout", "task": "look"},
        {"agent": "worker", "task": "change it"},
        {"agent": "nobody", "task": "look"},
        {"agent": "remote", "task": "look"},
        {"agent": "wordy", "task": "look"},
    ]
    model = write_script(
        {
            "context_window": 4096,
            "agents": {
                "lead": {"replies": [call("subagent", tasks=tasks), "one of them ran"]},
                "scout": {"replies": ["found it"]},
            },
        }
    )
    lead = write_agent(tmp_path, "lead", "read, subagent", "agents: scout, remote, wordy\n")
    write_agent(tmp_path, "remote", "read", f"model: scripted:{tmp_path / 'missing.json'}\n")
    write_agent(tmp_path, "wordy", "read", body="word " * 9000)
    monkeypatch.setenv("MLX_SUBAGENTS_MODEL", model)

    code, out, err = run_cli("run", "lead", "go", "-C", str(tmp_path), "-y")

    assert (code, out) == (0, "one of them ran\n"), err
    result = tool_results()[0]
    assert result.splitlines()[0] == "Parallel: 1/5 tasks completed"
    assert "### [scout] completed\nfound it" in result
    assert (
        f"### [worker] failed (error): 'lead' may not start 'worker': the agents: list in {lead} names only "
        "scout, remote, wordy; add the agent there to grant it"
    ) in result
    assert "### [nobody] failed (error): unknown agent 'nobody'; 'lead' may start: scout, remote, wordy\n" in result
    assert f"### [remote] failed (error): {tmp_path / 'missing.json'}: cannot read the scripted model file" in result
    assert "### [wordy] failed (error): agent 'wordy' has a system prompt of " in result
    assert "add it to grant it" not in result.split("### [nobody]")[1].split("###")[0]
