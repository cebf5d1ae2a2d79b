"""What a parent's `subagent` call may choose and what it sees: the agents it may start, children that
fail alone, per-task choices, workflows, and what reaches the children (issue 26)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from mlx_subagents.runs.chat import Chat
from mlx_subagents.runs.prepared import Parent
from mlx_subagents.runs.tasks import ModelRef, TaskSpec
from mlx_subagents.runs.transcripts import child_runs, load_run, read_transcript
from mlx_subagents.testing.fake_engine import FAKE_MODEL, FakeEngine, Reply
from mlx_subagents.tools import Workspace
from tests.helpers import call, run_parent, write_agent


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

    description = runner.board_tools(parent, Workspace(tmp_path))["subagent"].schema()["function"]["description"]

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
    assert "### [scout#1] completed\nfound it" in result
    assert (
        f"### [worker#1] failed (error): 'lead' may not start 'worker': the agents: list in {lead} names only "
        "scout, remote, wordy; add the agent there to grant it"
    ) in result
    assert "### [nobody#1] failed (error): unknown agent 'nobody'; 'lead' may start: scout, remote, wordy\n" in result
    assert f"### [remote#1] failed (error): {tmp_path / 'missing.json'}: cannot read the scripted model file" in result
    assert "### [wordy#1] failed (error): agent 'wordy' has a system prompt and 2 tools of " in result
    assert "add it to grant it" not in result.split("### [nobody#1]")[1].split("###")[0]


# -- what reaches the children ---------------------------------------------------------------------


def test_a_parents_thinking_reaches_children_without_their_own(tmp_path: Path, scripted_runner: Any) -> None:
    write_agent(tmp_path, "lead", "read, subagent", "thinking: off\n")
    write_agent(tmp_path, "deep", "read", "thinking: 300\n")

    async def budgets(**options: Any) -> list[int]:
        runner = scripted_runner(["x"], assume_yes=True, **options)
        workspace = Workspace(tmp_path)
        async with runner:
            (lead,) = await runner.preparer.prepare([TaskSpec("lead", "go", label="lead")], workspace=workspace)
            parent = lead.as_parent(None)
            (scout,) = await runner.preparer.prepare(
                [TaskSpec("scout", "look", label="s")], workspace=workspace, parent=parent
            )
            (grandchild,) = await runner.preparer.prepare(
                [TaskSpec("planner", "plan", label="p")], workspace=workspace, parent=scout.as_parent(None)
            )
            (deep,) = await runner.preparer.prepare(
                [TaskSpec("deep", "think", label="d")], workspace=workspace, parent=parent
            )
        return [lead.limits.thinking, scout.limits.thinking, grandchild.limits.thinking, deep.limits.thinking]

    assert asyncio.run(budgets()) == [0, 0, 0, 300]
    assert asyncio.run(budgets(thinking="200")) == [200, 200, 200, 200]  # --thinking wins over every file


def test_a_delegated_tasks_call_runs_concurrency_at_a_time_on_an_engine(tmp_path: Path, run_cli: Any) -> None:
    tasks = [{"agent": "scout", "task": f"part {i}"} for i in range(6)]
    with FakeEngine() as engine:
        for i in range(6):
            engine.queue(Reply(f"done {i}", together=6), when=f"Task: part {i}")
        engine.queue(Reply(tool_calls=({"name": "subagent", "arguments": {"tasks": tasks}},)), Reply("all six"))
        args = ["run", "orchestrator", "map it", "--engine", engine.url, "-m", FAKE_MODEL, "-C", str(tmp_path)]
        code, out, err = run_cli(*args, "--concurrency", "8", "--json")

    assert code == 0, err
    assert json.loads(out)["output"] == "all six"
    assert engine.peak_in_flight == 6


def test_run_json_carries_the_childrens_usage(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    tasks = [{"agent": "scout", "task": "look"}, {"agent": "planner", "task": "plan"}]
    model = write_script(
        {
            "agents": {
                "orchestrator": {"replies": [call("subagent", tasks=tasks), "both done"]},
                "scout": {"replies": [call("ls", path="."), "found it"]},
                "planner": {"replies": ["a plan"]},
            }
        }
    )

    code, out, err = run_cli("run", "orchestrator", "go", "-m", model, "-C", str(tmp_path), "--json")

    assert code == 0, err
    children = json.loads(out)["children"]
    assert [(c["label"], c["agent"], c["status"], c["usage"]["turns"]) for c in children["tasks"]] == [
        ("orchestrator > scout#1", "scout", "completed", 2),
        ("orchestrator > planner#1", "planner", "completed", 1),
    ]
    fields = ("input_tokens", "output_tokens", "cached_tokens", "turns")
    for field in fields:
        assert children["usage"][field] == sum(c["usage"][field] for c in children["tasks"]) > 0
    code, out, err = run_cli(
        "run", "scout", "go", "-m", write_script(["alone"], "alone.json"), "-C", str(tmp_path), "--json"
    )
    assert code == 0 and json.loads(out)["children"] is None, err


def test_an_agent_file_added_during_a_chat_can_be_started_at_the_next_call(
    tmp_path: Path, scripted_runner: Any
) -> None:
    write_agent(tmp_path, "lead", "read, subagent")  # no agents: list, so any agent may be started
    script = {
        "agents": {
            "lead": {
                "replies": [
                    call("subagent", agent="late", task="look"),
                    "not yet",
                    call("subagent", agent="late", task="look"),
                    "now it ran",
                ]
            },
            "late": {"replies": ["late was here"]},
        }
    }
    runner = scripted_runner(script, assume_yes=True)

    async def main() -> list[str]:
        async with runner:
            chat = await Chat.start(runner, "lead")
            await chat.turn("ask late")
            write_agent(tmp_path, "late", "read")
            await chat.turn("ask late again")
            await chat.close()
        return tool_results(chat.run_id)

    first, second = asyncio.run(main())
    assert first.startswith("Error: invalid subagent call: unknown agent 'late';")
    assert second.startswith("late was here\n\n[sub-agent run ")


# -- per-task choices ------------------------------------------------------------------------------


def test_each_task_chooses_its_folder_label_local_model_and_fewer_turns(
    tmp_path: Path, write_script: Any, run_cli: Any
) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "inner.py").write_text("x = 1\n")
    (tmp_path / "top.py").write_text("y = 2\n")
    other = write_script({"agents": {"planner": {"replies": ["planned on the other model"]}}}, "other.json")
    tasks = [
        {"agent": "scout", "task": "list", "cwd": "sub", "label": "inner"},
        {"agent": "planner", "task": "plan", "model": other},
        {"agent": "planner", "task": "plan", "model": "nobody/not-here", "label": "remote"},
        {"agent": "reviewer", "task": "look twice", "max_turns": 1, "label": "short"},
    ]
    chain = [
        {"agent": "scout", "task": "list", "cwd": "sub", "label": "first"},
        {"agent": "scout", "task": "{previous}"},
    ]
    model = write_script(
        {
            "agents": {
                "lead": {
                    "replies": [
                        call("subagent", tasks=tasks),
                        call("subagent", chain=chain),
                        call("subagent", agent="scout", task="list", label="x" * 61),
                        "done",
                    ]
                },
                "scout": {"replies": [call("ls", path="."), "listed"]},
                "reviewer": {"replies": [call("ls", path="."), call("ls", path="."), "never"]},
            }
        }
    )
    write_agent(tmp_path, "lead", "read, ls, subagent")

    grants = ["--allow-model", other, "--allow-model", "nobody/not-here"]  # a model a call names must be granted
    code, out, err = run_cli("run", "lead", "go", "-m", model, "-C", str(tmp_path), "--max-turns", "5", "-y", *grants)

    assert (code, out) == (0, "done\n"), err
    parallel, chained, too_long = tool_results()
    assert parallel.splitlines()[0] == "Parallel: 2/4 tasks completed"
    assert "### [inner] completed\nlisted" in parallel
    assert "### [planner#1] completed\nplanned on the other model" in parallel
    assert (
        "### [remote] failed (error): model 'nobody/not-here' is not in the local Hugging Face cache, and a model "
        "chosen during a delegation is never downloaded; name a local model, or download it once while online"
    ) in parallel
    assert "### [short] failed (max_turns)" in parallel
    assert chained.startswith("listed\n\n[sub-agent run ")
    assert too_long.startswith(
        "Error: invalid subagent call: 'label': String should have at most 60 characters; use exactly one of"
    )
    parent = load_run("last")
    runs = {c.tasks[0].label: c for c in child_runs(parent)}
    inner = runs["lead > inner"]
    assert [
        m["content"] for m in read_transcript(inner.transcript_path(inner.tasks[0])).messages if m["role"] == "tool"
    ] == ["inner.py"]
    assert read_transcript(inner.transcript_path(inner.tasks[0])).meta["cwd"] == str(tmp_path / "sub")
    assert "lead > first" in [label for c in child_runs(parent) for label in (t.label for t in c.tasks)]


def test_a_tasks_own_limits_only_narrow(tmp_path: Path, scripted_runner: Any) -> None:
    async def limits(task: TaskSpec, **options: Any) -> tuple[int, float | None]:
        runner = scripted_runner(["x"], **options)
        async with runner:
            (prepared,) = await runner.preparer.prepare([task], workspace=Workspace(tmp_path), delegated=True)
        return prepared.limits.max_turns, prepared.timeout

    wide = TaskSpec("scout", "look", label="s", max_turns=50, timeout=900)
    narrow = TaskSpec("scout", "look", label="s", max_turns=2, timeout=30)
    assert asyncio.run(limits(wide, max_turns=5, timeout=60)) == (5, 60)
    assert asyncio.run(limits(narrow, max_turns=5, timeout=60)) == (2, 30)
    assert asyncio.run(limits(narrow)) == (2, 30)


# -- the single form's own choices (issue 44, item 4) ----------------------------------------------------


def test_the_single_form_takes_the_choices_tasks_items_take(tmp_path: Path, scripted_runner: Any) -> None:
    from tests.runs.test_worktrees import make_repo

    repo = make_repo(tmp_path / "repo")
    calls = [
        call("subagent", agent="reviewer", task="look twice", label="short", max_turns=1),
        call("subagent", agent="scout", task="wait", timeout=0.2),
        call("subagent", agent="worker", task="add a file", isolation="worktree"),
        "done",
    ]
    script = {
        "agents": {
            "orchestrator": {"replies": calls},
            "reviewer": {"replies": [call("ls", path="."), call("ls", path="."), "never"]},
            "scout": {"replies": [{"content": "too late", "delay": 2}]},
            "worker": {"replies": [call("write", path="new.txt", content="hi\n"), "wrote new.txt"]},
        }
    }
    result = run_parent(scripted_runner(script, cwd=repo))

    assert result.ok, result.error
    short, slow, isolated = tool_results(result.run_id)
    assert short.startswith("Error: [short] agent 'reviewer' failed (max_turns): reached the limit of 1 turns")
    assert slow.startswith("Error: agent 'scout' failed (timeout): stopped by the timeout of 0.2s")
    assert isolated.startswith("wrote new.txt\n\n[sub-agent run ")
    assert "[worker#1: changes on branch subagent/" in isolated
    assert not (repo / "new.txt").exists()  # its change is on its branch, not in the shared tree


def test_isolation_is_offered_inside_a_git_repository_only(tmp_path: Path, scripted_runner: Any) -> None:
    from tests.runs.test_worktrees import make_repo

    def fields(cwd: Path) -> set[str]:
        runner = scripted_runner(["x"], cwd=cwd)
        parent = Parent(runner.catalog.get("orchestrator"), "o", 0, ModelRef("m"), None)
        schema = runner.board_tools(parent, Workspace(cwd))["subagent"].schema()["function"]["parameters"]
        return set(schema["properties"]) & {"isolation", "model", "max_turns", "timeout", "label"}

    (tmp_path / "plain").mkdir()
    assert fields(tmp_path / "plain") == {"max_turns", "timeout", "label"}
    assert fields(make_repo(tmp_path / "repo")) == {"isolation", "max_turns", "timeout", "label"}


# -- ids and names a model can use (issue 44, item 6) -----------------------------------------------------


def test_a_labelled_childs_id_starts_its_result_and_its_label_continues_it(
    tmp_path: Path, scripted_runner: Any
) -> None:
    calls = [
        call("subagent", agent="scout", task="find auth", label="auth"),
        call("task_send", id="auth", message="and its tests?"),
        call("task_output", id="auth", wait=10),
        "done",
    ]
    script = {
        "agents": {"orchestrator": {"replies": calls}, "scout": {"replies": ["auth.py:3", "tests/test_auth.py:1"]}}
    }
    result = run_parent(scripted_runner(script))

    first, sent, read = tool_results(result.run_id)
    assert first.splitlines()[0] == "[auth] auth.py:3"
    assert first.endswith("; task_send continues auth]")
    assert sent == "auth had ended: it continues its conversation with the message, in the background"
    assert read == "auth completed\n\ntests/test_auth.py:1"


def test_same_agent_siblings_from_separate_calls_get_distinct_labels(tmp_path: Path, scripted_runner: Any) -> None:
    both = {"tool_calls": [{"name": "subagent", "arguments": {"agent": "scout", "task": f"look {i}"}} for i in (1, 2)]}
    events: list[Any] = []
    script = {"agents": {"orchestrator": {"replies": [both, "done"]}, "scout": {"replies": ["seen"]}}}
    result = run_parent(scripted_runner(script, events))

    assert result.ok, result.error
    starts = sorted(e.label for e in events if e.kind == "task_start" and e.label != "orchestrator")
    assert starts == ["orchestrator > scout#1", "orchestrator > scout#2"]
    saved = sorted(c.tasks[0].label for c in child_runs(load_run(result.run_id)))
    assert saved == starts  # their transcripts are labelled apart too
