"""Delegation as the reference systems define it, through the CLI on scripted models: a child runs
on its parent's model, fan-out is bounded for the whole process, writers take turns."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.runs.transcripts import child_runs, load_run, read_transcript
from tests.helpers import call, needs_sandbox, task_text, write_agent


def events_of(out: str) -> list[dict[str, Any]]:
    """The `--events` lines of stdout (the last line is the `--json` result)."""
    return [e for e in map(json.loads, out.splitlines()) if "kind" in e]


def peak_loops(events: list[dict[str, Any]]) -> int:
    """Most agent loops working at once: started and not ended, a parent inside a subagent call not counted."""
    working: set[str] = set()
    peak = 0
    for e in events:
        kind, label, data = e["kind"], e["label"], e["data"]
        if kind == "task_start" or (kind == "tool_result" and data.get("name") == "subagent"):
            working.add(label)
        elif kind == "task_end" or (kind == "tool_call" and data.get("name") == "subagent"):
            working.discard(label)
        peak = max(peak, len(working))
    return peak


# -- the child's model -----------------------------------------------------------------------------


def test_a_child_without_a_model_runs_on_its_parents_model(
    tmp_path: Path, write_script: Any, run_cli: Any, monkeypatch: Any
) -> None:
    lead_model = write_script(
        {
            "agents": {
                "lead": {"replies": [call("subagent", agent="scout", task="find it"), "found by scout"]},
                "scout": {"replies": ["it is in app.py"]},
            }
        },
        "lead.json",
    )
    write_agent(tmp_path, "lead", "read, subagent", f"model: {lead_model}\n")
    # Neither the environment's model nor the default exists here: only inheritance can work.
    monkeypatch.setenv("MLX_SUBAGENTS_MODEL", f"scripted:{tmp_path / 'missing.json'}")

    code, out, err = run_cli("run", "lead", "where is it?", "-C", str(tmp_path), "-y")

    assert (code, out) == (0, "found by scout\n"), err
    parent = load_run("last")
    child = load_run("last", home=parent.folder)
    log = read_transcript(child.transcript_path(child.tasks[0]))
    assert (log.meta["agent"], log.meta["model"]) == ("scout", lead_model)


def test_a_childs_own_model_wins_over_its_parents(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    lead_model = write_script({"agents": {"lead": {"replies": [call("subagent", agent="own", task="go"), "ok"]}}})
    own_model = write_script(["from my own model"], "own.json")
    write_agent(tmp_path, "lead", "subagent", f"model: {lead_model}\n")
    write_agent(tmp_path, "own", "read", f"model: {own_model}\n")

    code, _, err = run_cli("run", "lead", "go", "-C", str(tmp_path), "-y")

    assert code == 0, err
    child = load_run("last", home=load_run("last").folder)
    log = read_transcript(child.transcript_path(child.tasks[0]))
    assert (log.meta["model"], log.results[0].output) == (own_model, "from my own model")


# -- fan-out for the whole process -----------------------------------------------------------------


def fan_out_script(write_script: Any) -> str:
    scouts = [{"agent": "scout", "task": f"look {i}"} for i in range(4)]
    return write_script(
        {
            "agents": {
                "orchestrator": {"replies": [call("subagent", tasks=scouts), "all mapped"]},
                "scout": {"replies": [{"content": "seen", "delay": 0.15}]},
            }
        }
    )


@pytest.mark.slow
def test_three_parents_of_four_children_never_run_more_than_four_loops(
    tmp_path: Path, write_script: Any, run_cli: Any
) -> None:
    model = fan_out_script(write_script)
    args = ["parallel", *(x for i in range(3) for x in ("-t", "orchestrator", f"map part {i}"))]

    code, out, err = run_cli(*args, "-m", model, "-C", str(tmp_path), "--events", "--json")

    assert code == 0, err
    events = events_of(out)
    assert sum(e["kind"] == "task_start" and e["agent"] == "scout" for e in events) == 12
    assert peak_loops(events) == 4

    code, out, err = run_cli(*args, "-m", model, "-C", str(tmp_path), "--events", "--json", "--concurrency", "2")
    assert code == 0, err
    assert peak_loops(events_of(out)) == 2


# -- writers take turns ----------------------------------------------------------------------------


@pytest.mark.slow
def test_two_writers_never_overlap_and_a_reader_runs_alongside(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    model = write_script(
        {
            "agents": {
                "worker": {
                    "replies": [
                        {**call("write", path="out.txt", content="x\n"), "delay": 0.2},
                        {"content": "wrote it", "delay": 0.1},
                    ]
                },
                "scout": {"replies": [{"content": "looked", "delay": 0.1}]},
            }
        }
    )
    args = ["parallel", "-t", "worker", "one", "-t", "worker", "two", "-t", "scout", "look"]

    code, out, err = run_cli(*args, "-m", model, "-C", str(tmp_path), "--events", "--json")

    assert code == 0, err
    events = events_of(out)
    spans = {
        label: (
            next(e["time"] for e in events if e["label"] == label and e["kind"] == "task_start"),
            next(e["time"] for e in events if e["label"] == label and e["kind"] == "task_end"),
        )
        for label in ("worker-1", "worker-2", "scout")
    }
    first, second = sorted([spans["worker-1"], spans["worker-2"]])
    assert first[1] <= second[0], f"two writers overlapped: {spans}"
    assert spans["scout"][0] < first[1], "the reader waited for a writer"
    waiting = [e for e in events if e["kind"] == "waiting"]
    assert len(waiting) == 1 and waiting[0]["label"] in ("worker-1", "worker-2")
    assert waiting[0]["data"]["reason"] == (
        "another agent that can change files is working in this workspace; writers take turns"
    )


def test_a_task_waiting_for_a_slot_says_so_in_its_events_and_the_live_views(
    tmp_path: Path, write_script: Any, run_cli: Any
) -> None:
    """With one slot the second task waits: a `waiting` event says for a slot, which the live status and
    `subagent watch` show (`TaskNow.describe`); the progress lines leave the queue out."""
    model = write_script({"agents": {"scout": {"replies": [{"content": "done", "delay": 0.2}]}}})

    code, out, err = run_cli("parallel", "-t", "scout", "a", "-t", "scout", "b", "-j", "1", "-m", model, "--events")

    assert code == 0, err
    [waiting] = [e for e in events_of(out) if e["kind"] == "waiting"]
    assert (waiting["label"], waiting["data"]) == (
        "scout-2",
        {"waiting_for": "a slot", "reason": "every slot is taken (--concurrency); it starts when one frees"},
    )
    [start] = [e for e in events_of(out) if e["kind"] == "task_start" and e["label"] == "scout-2"]
    assert start["data"]["waited_for"] == "a slot" and start["data"]["waited_s"] > 0
    assert "waiting" not in err


def test_the_progress_lines_say_a_writer_waits(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    model = write_script({"agents": {"worker": {"replies": [{"content": "done", "delay": 0.1}]}}})

    code, _, err = run_cli("parallel", "-t", "worker", "a", "-t", "worker", "b", "-m", model, "-C", str(tmp_path))

    assert code == 0
    assert (
        "[worker-2] waiting: another agent that can change files is working in this workspace; writers take turns"
        in err.splitlines()
    )


STAMP = f"{shlex.quote(sys.executable)} -c 'import time; print(time.time())'"


def bash_spans(run: Any) -> dict[str, tuple[float, float]]:
    """Each task's `bash` call as (started, ended), from the timestamps it printed into its transcript."""
    spans = {}
    for task in run.tasks:
        log = read_transcript(run.transcript_path(task))
        [output] = [r["data"]["output"] for r in log.records if r.get("kind") == "tool_result"]
        start, end = map(float, re.findall(r"\d+\.\d+", output))
        spans[task.label] = (start, end)
    return spans


def looking_agents(tmp_path: Path, write_script: Any, front: str) -> str:
    """Two `looker` agents with bash (and `front`), each running one bash call that takes 0.5 s."""
    write_agent(tmp_path, "looker", "read, bash", front)
    command = f"{STAMP}; sleep 0.5; {STAMP}"
    return write_script({"agents": {"looker": {"replies": [call("bash", command=command), "looked"]}}})


@needs_sandbox
@pytest.mark.slow
def test_two_bash_agents_take_turns(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    model = looking_agents(tmp_path, write_script, "")
    args = ["parallel", "-t", "looker", "one", "-t", "looker", "two", "-m", model, "-C", str(tmp_path), "-y"]

    code, _, err = run_cli(*args)

    assert code == 0, err
    first, second = sorted(bash_spans(load_run("last")).values())
    assert first[1] <= second[0], f"two bash agents overlapped: {first}, {second}"
    assert (
        "[looker-2] waiting: another agent that can change files is working in this workspace; writers take turns"
        in err.splitlines()
    )


@needs_sandbox
@pytest.mark.slow
def test_bash_agents_that_say_writer_false_run_alongside(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    model = looking_agents(tmp_path, write_script, "writer: false\n")
    args = ["parallel", "-t", "looker", "one", "-t", "looker", "two", "-m", model, "-C", str(tmp_path), "-y"]

    code, _, err = run_cli(*args)

    assert code == 0, err
    one, two = bash_spans(load_run("last")).values()
    assert one[0] < two[1] and two[0] < one[1], f"the two readers took turns: {one}, {two}"
    assert "waiting" not in err


def test_the_writer_field_is_listed_and_checked(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    write_agent(tmp_path, "forced", "read", "writer: true\n")
    write_agent(tmp_path, "looker", "read, bash")

    code, out, _ = run_cli("agents", "-C", str(tmp_path), "-v")
    assert code == 0
    lines = out.splitlines()
    assert [
        lines[lines.index(line) + 3] for line in lines if line.startswith(("forced ", "looker ", "scout ", "worker "))
    ] == [
        "  writer: takes turns with other writers in its workspace (writer: true)",
        "  writer: takes turns with other writers in its workspace (it has bash)",
        "  reader: runs alongside the others (writer: false)",
        "  writer: takes turns with other writers in its workspace (it has bash, edit, write)",
    ]
    code, out, _ = run_cli("agents", "-C", str(tmp_path), "--json")
    assert {row["name"]: row["writer"] for row in json.loads(out)} == {
        "forced": True, "looker": True, "orchestrator": False, "planner": False, "reviewer": False, "scout": False,
        "worker": True,
    }  # fmt: skip

    bad = tmp_path / ".mlx-subagents" / "agents" / "looker.md"
    bad.write_text(bad.read_text().replace("tools: read, bash\n", "tools: read, bash\nwriter: maybe\n"))
    code, out, err = run_cli("run", "looker", "look", "-m", write_script(["x"]), "-C", str(tmp_path), "-y")
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        f"warning: skipped {bad}: field 'writer' must be true or false, got 'maybe'; "
        "write 'writer: false' for an agent that only looks (its bash changes nothing), or leave it out",
        "error: unknown agent 'looker'; available: forced, orchestrator, planner, reviewer, scout, worker",
    ]


# -- calls and set-up failures ---------------------------------------------------------------------


def test_two_subagent_calls_in_one_reply_run_concurrently(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    two_calls = {
        "tool_calls": [
            {"name": "subagent", "arguments": {"agent": "scout", "task": "map the parser"}},
            {"name": "subagent", "arguments": {"agent": "planner", "task": "plan the fix"}},
        ]
    }
    model = write_script(
        {
            "agents": {
                "orchestrator": {"replies": [two_calls, "both answered"]},
                "scout": {"replies": [{"content": "parser.py", "delay": 0.3}]},
                "planner": {"replies": [{"content": "step 1", "delay": 0.3}]},
            }
        }
    )

    code, out, err = run_cli("run", "orchestrator", "go", "-m", model, "-C", str(tmp_path), "--events")

    assert code == 0, err
    events = events_of(out)
    starts = {e["label"]: e["time"] for e in events if e["kind"] == "task_start"}
    ends = {e["label"]: e["time"] for e in events if e["kind"] == "task_end"}
    scout, planner = "orchestrator > scout#1", "orchestrator > planner#1"
    assert starts[scout] < ends[planner] and starts[planner] < ends[scout], "the two calls ran one after the other"
    parent = load_run("last")
    log = read_transcript(parent.transcript_path(parent.tasks[0]))
    children = {c.tasks[0].label: c.run_id for c in child_runs(parent)}
    assert [m["content"] for m in log.messages if m["role"] == "tool"] == [
        f"parser.py\n\n[sub-agent run {children[scout]}; task_send continues scout#1]",
        f"step 1\n\n[sub-agent run {children[planner]}; task_send continues planner#1]",
    ]


def test_a_child_that_cannot_start_fails_alone(
    tmp_path: Path, write_script: Any, run_cli: Any, monkeypatch: Any
) -> None:
    tasks = [
        {"agent": "scout", "task": "look"},
        {"agent": "nobody", "task": "look"},
        {"agent": "remote", "task": "look"},
    ]
    model = write_script(
        {
            "agents": {
                "lead": {"replies": [call("subagent", tasks=tasks), "two of them failed"]},
                "scout": {"replies": ["found it"]},
            }
        }
    )
    write_agent(tmp_path, "lead", "read, subagent")  # no agents: list, so any agent may be started
    write_agent(tmp_path, "remote", "read", f"model: scripted:{tmp_path / 'missing.json'}\n")
    monkeypatch.setenv("MLX_SUBAGENTS_MODEL", model)  # not --model, which would force it on every child

    code, out, err = run_cli("run", "lead", "go", "-C", str(tmp_path), "-y")

    assert (code, out) == (0, "two of them failed\n"), err
    parent = load_run("last")
    result = read_transcript(parent.transcript_path(parent.tasks[0])).messages[3]["content"]
    assert result.splitlines()[0] == "Parallel: 1/3 tasks completed"
    assert "### [scout#1] completed\nfound it" in result
    assert (
        "### [nobody#1] failed (error): unknown agent 'nobody'; available: lead, orchestrator, planner, remote, "
        "reviewer, scout, worker"
    ) in result
    assert f"### [remote#1] failed (error): {tmp_path / 'missing.json'}: cannot read the scripted model file" in result
    assert "  [lead > nobody#1] failed: unknown agent 'nobody'" in err


# -- children are findable -------------------------------------------------------------------------


def test_a_childs_run_id_from_the_parents_result_works_with_show_and_resume(
    tmp_path: Path, write_script: Any, run_cli: Any
) -> None:
    model = write_script(
        {
            "agents": {
                "orchestrator": {"replies": [call("subagent", agent="scout", task="find the app"), "app.py"]},
                "scout": {"replies": ["app.py:1", "and tests/test_app.py"]},
            }
        }
    )
    assert run_cli("run", "orchestrator", "where?", "-m", model, "-C", str(tmp_path))[0] == 0
    parent = load_run("last")
    messages = read_transcript(parent.transcript_path(parent.tasks[0])).messages
    child_id, more = messages[3]["content"].rsplit("[sub-agent run ", 1)[1].rstrip("]").split("; ")
    assert more == "task_send continues scout#1"

    code, out, _ = run_cli("show", child_id)
    assert code == 0 and out.splitlines()[0].startswith(f"run {child_id}  single  finished  1/1 succeeded")
    code, out, _ = run_cli("show", parent.run_id)
    assert code == 0
    assert f"{child_id}  single   finished      1/1  orchestrator > scout#1" in out.splitlines()
    code, out, _ = run_cli("show", parent.run_id, "--json")
    children = json.loads(out)["children"]
    assert children == [{"run_id": child_id, "status": "finished", "tasks": ["orchestrator > scout#1"]}]

    # The scripted model replays each session from its start: a second model answers the follow-up.
    follow = write_script({"agents": {"scout": {"replies": ["and tests/test_app.py"]}}}, "follow.json")
    code, out, err = run_cli("resume", child_id[:-2], "and the tests?", "-m", follow)
    assert (code, out) == (0, "and tests/test_app.py\n"), err
    log = read_transcript(load_run(child_id).transcript_path(load_run(child_id).tasks[0]))
    assert [m["content"] for m in log.messages if m["role"] == "user"] == [
        task_text("find the app", tmp_path),
        "and the tests?",
    ]


def test_a_resumed_child_keeps_the_tools_its_parent_withheld(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    model = write_script(
        {
            "agents": {
                "orchestrator": {"replies": [call("subagent", agent="scout", task="find the app"), "app.py"]},
                "scout": {"replies": ["app.py:1"]},
            }
        }
    )
    assert run_cli("run", "orchestrator", "where?", "-m", model, "-C", str(tmp_path))[0] == 0
    child = load_run("last", home=load_run("last").folder)
    meta = read_transcript(child.transcript_path(child.tasks[0])).meta
    assert sorted(meta["denied"]) == ["bash"]  # the orchestrator has no bash: its scout works without it

    follow = write_script({"agents": {"scout": {"replies": [call("bash", command="touch ran.txt"), "ran"]}}}, "2.json")
    code, out, err = run_cli("resume", child.run_id, "run the tests", "-m", follow)

    assert (code, out) == (0, "ran\n"), err
    log = read_transcript(child.transcript_path(child.tasks[0]))
    [refusal] = [m["content"] for m in log.messages if m["role"] == "tool"]
    assert refusal == meta["denied"]["bash"]
    assert refusal.startswith("Error: bash is not available to 'scout' here: its parent 'orchestrator' lacks it")
    assert not (tmp_path / "ran.txt").exists()


# -- grants ----------------------------------------------------------------------------------------


def grant_script(write_script: Any) -> str:
    return write_script(
        {
            "agents": {
                "lead": {"replies": [call("subagent", agent="worker", task="make the file"), "asked"]},
                "orchestrator": {"replies": [call("subagent", agent="worker", task="make the file"), "asked"]},
                "worker": {"replies": [call("bash", command="touch made.txt"), "tried"]},
            }
        }
    )


def worker_results(parent_folder: Path) -> list[str]:
    child = load_run("last", home=parent_folder)
    return [
        m["content"] for m in read_transcript(child.transcript_path(child.tasks[0])).messages if m["role"] == "tool"
    ]


def test_a_read_only_parent_cannot_make_its_child_run_bash(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    write_agent(tmp_path, "lead", "read, subagent")

    code, _, err = run_cli("run", "lead", "go", "-m", grant_script(write_script), "-C", str(tmp_path), "-y")

    assert code == 0, err
    assert not (tmp_path / "made.txt").exists()
    path = tmp_path / ".mlx-subagents" / "agents" / "lead.md"
    assert worker_results(load_run("last").folder) == [
        "Error: bash is not available to 'worker' here: its parent 'lead' lacks it, and a sub-agent's tools never "
        f"exceed its parent's without a grant (agents: [worker!] in {path})"
    ]


def test_an_agents_list_limits_who_may_be_started(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    write_agent(tmp_path, "lead", "read, subagent", "agents: scout, planner\n")

    code, _, err = run_cli("run", "lead", "go", "-m", grant_script(write_script), "-C", str(tmp_path), "-y")

    assert code == 0, err
    parent = load_run("last")
    path = tmp_path / ".mlx-subagents" / "agents" / "lead.md"
    messages = read_transcript(parent.transcript_path(parent.tasks[0])).messages
    assert messages[3]["content"] == (
        f"Error: subagent call refused: 'lead' may not start 'worker': the agents: list in {path} names only "
        "scout, planner; add the agent there to grant it"
    )
    assert not (parent.folder / "runs").exists()


@needs_sandbox
def test_a_full_tools_grant_lets_the_child_keep_its_tools(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    write_agent(tmp_path, "lead", "read, subagent", "agents: [scout, worker!]\n")

    code, _, err = run_cli("run", "lead", "go", "-m", grant_script(write_script), "-C", str(tmp_path), "-y")

    assert code == 0, err
    assert (tmp_path / "made.txt").is_file()
    assert worker_results(load_run("last").folder) == ["(no output)"]
    (tmp_path / "made.txt").unlink()

    # The built-in orchestrator has that grant for worker, as its prompt expects.
    code, _, err = run_cli("run", "orchestrator", "go", "-m", grant_script(write_script), "-C", str(tmp_path))
    assert code == 0, err
    assert (tmp_path / "made.txt").is_file()


def test_claude_code_task_tool_form_grants_agents(tmp_path: Path) -> None:
    from mlx_subagents.agents.spec import parse_agent_file

    folder = tmp_path / ".claude" / "agents"
    folder.mkdir(parents=True)
    path = folder / "lead.md"
    path.write_text("---\nname: lead\ndescription: leads\ntools: Read, Task(scout, worker)\n---\nLead.\n")

    spec = parse_agent_file(path, "project")

    assert (spec.tools, spec.agents, spec.full_tools_for, spec.warnings) == (
        ("read", "subagent"),
        ("scout", "worker"),
        (),
        (),
    )


# -- project instructions --------------------------------------------------------------------------


def system_prompts(run: Any) -> dict[str, str]:
    return {
        t.label: read_transcript(run.transcript_path(t)).messages[0]["content"] for t in run.tasks if t.file is not None
    }


def test_agents_md_reaches_every_agent_and_keeps_prompts_identical(
    tmp_path: Path, write_script: Any, run_cli: Any
) -> None:
    (tmp_path / ".git").mkdir()
    (tmp_path / "AGENTS.md").write_text("Indent with tabs.\n")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "CLAUDE.md").write_text("Run `make test` before you answer.\n")
    scouts = [{"agent": "scout", "task": "look here"}, {"agent": "scout", "task": "look there"}]
    model = write_script(
        {
            "agents": {
                "orchestrator": {"replies": [call("subagent", tasks=scouts), "done"]},
                "scout": {"replies": ["seen"]},
            }
        }
    )

    code, _, err = run_cli("run", "orchestrator", "go", "-m", model, "-C", str(pkg))

    assert code == 0, err
    parent = load_run("last")
    block = (
        "Project instructions (from the files named below; follow them):\n\n"
        "## AGENTS.md\nIndent with tabs.\n\n## pkg/CLAUDE.md\nRun `make test` before you answer."
    )
    parent_prompt = system_prompts(parent)["orchestrator"]
    assert f"\n\n{block}\n\nAll paths are relative to the workspace" in parent_prompt
    children = system_prompts(load_run("last", home=parent.folder))
    assert list(children) == ["orchestrator > scout#1", "orchestrator > scout#2"]
    first, second = children.values()
    assert first == second and f"\n\n{block}\n\nAll paths" in first  # one shared prefix for both
    assert str(tmp_path) not in parent_prompt + first

    # A second checkout of the repository elsewhere (another worktree) gets the same prompt, byte for
    # byte: its KV is shared; only the task message names the folder.
    other = tmp_path / "elsewhere" / "copy"
    shutil.copytree(tmp_path, other, ignore=shutil.ignore_patterns("elsewhere", ".mlx-subagents", "*.json"))
    code, _, err = run_cli("run", "orchestrator", "go", "-m", model, "-C", str(other / "pkg"))
    assert code == 0, err
    again = read_transcript(load_run("last").transcript_path(load_run("last").tasks[0])).messages
    assert again[0]["content"] == parent_prompt
    assert again[1]["content"] == task_text("go", other / "pkg")

    code, out, _ = run_cli("agents", "-C", str(pkg), "--verbose")
    assert code == 0
    assert out.splitlines()[-3:] == [
        f"project instructions ({len(block.split(chr(10), 2)[2]):,} characters), in this order:",
        f"  {tmp_path / 'AGENTS.md'}",
        f"  {pkg / 'CLAUDE.md'}",
    ]


def test_an_agent_can_opt_out_and_long_instructions_are_cut(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    (tmp_path / "AGENTS.md").write_text("x" * 9_000)
    write_agent(tmp_path, "plain", "read", "context: none\n", body="Plain.")
    model = write_script(["ok"])

    assert run_cli("run", "scout", "a", "-m", model, "-C", str(tmp_path))[0] == 0
    prompt = system_prompts(load_run("last"))["scout"]
    body = "## AGENTS.md\n" + "x" * 9_000
    block = prompt.split("follow them):\n\n", 1)[1].split("\n\nAll paths are relative", 1)[0]
    note = f"[project instructions cut at 8,000 of {len(body):,} characters; read the files above for the rest]"
    assert block == f"{body[:8_000]}\n{note}"

    assert run_cli("run", "plain", "a", "-m", model, "-C", str(tmp_path), "-y")[0] == 0
    assert system_prompts(load_run("last"))["plain"].startswith("Plain.\n\nAll paths are relative")
    code, out, _ = run_cli("agents", "-C", str(tmp_path), "-v")
    assert out.splitlines()[-1] == "  not for: plain (context: none)"


# -- agent-file warnings ---------------------------------------------------------------------------


def test_run_and_chat_show_the_first_five_agent_file_warnings(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    folder = tmp_path / ".mlx-subagents" / "agents"
    folder.mkdir(parents=True)
    for i in range(7):
        (folder / f"broken{i}.md").write_text("no frontmatter\n")
    model = write_script(["answer"])

    code, listing_out, listing = run_cli("agents", "-C", str(tmp_path))
    assert code == 0 and len(listing.splitlines()) == 7
    for args in (["run", "scout", "go"], ["chat", "--once", "go"]):
        code, out, err = run_cli(*args, "-m", model, "-C", str(tmp_path))
        assert (code, out) == (0, "answer\n"), err
        assert err.splitlines()[:6] == [
            *listing.splitlines()[:5],
            "warning: (2 more; subagent agents shows them all)",
        ]


@pytest.mark.slow
@pytest.mark.parametrize("repository", [True, False], ids=["in-a-repository", "outside-a-repository"])
def test_a_writer_in_a_subfolder_takes_turns_with_one_at_the_root(
    tmp_path: Path, write_script: Any, run_cli: Any, repository: bool
) -> None:
    if repository:
        (tmp_path / ".git").mkdir()
    (tmp_path / "sub").mkdir()
    command = f"{STAMP}; sleep 0.3; {STAMP}"
    both = [
        {"name": "subagent", "arguments": {"agent": "worker", "task": "change the root"}},
        {"name": "subagent", "arguments": {"agent": "worker", "task": "change sub", "cwd": "sub"}},
    ]
    model = write_script(
        {
            "agents": {
                "orchestrator": {"replies": [{"tool_calls": both}, "both changed"]},
                "worker": {"replies": [call("bash", command=command), "changed"]},
            }
        }
    )

    code, out, err = run_cli("run", "orchestrator", "change both", "-m", model, "-C", str(tmp_path))

    assert (code, out) == (0, "both changed\n"), err
    children = child_runs(load_run("last"))
    assert sorted(c.cwd for c in children) == [str(tmp_path), str(tmp_path / "sub")]
    first, second = sorted(span for child in children for span in bash_spans(child).values())
    assert first[1] <= second[0], f"the root's writer and the subfolder's overlapped: {first}, {second}"
    # Two calls of one agent in one reply: distinct labels (issue 44, item 6); either may be the one that waits.
    waiting = re.compile(r"\[orchestrator > worker#[12]\] waiting: another agent that can change files is working")
    assert sum(bool(waiting.match(line.strip())) for line in err.splitlines()) == 1, err
    assert {"  [orchestrator > worker#1] completed", "  [orchestrator > worker#2] completed"} <= set(err.splitlines())
