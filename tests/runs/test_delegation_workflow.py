"""A model-facing workflow (issue 26, item 9): `{"workflow": NAME, "input": TEXT}` on the `subagent`
tool and MCP `run_agents`, and `/workflow NAME INPUT` in the chat, each checked as `subagent workflow`
checks a workflow before any step starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.runs.prepared import Parent
from mlx_subagents.runs.tasks import ModelRef
from mlx_subagents.runs.transcripts import child_runs, load_run, read_transcript
from mlx_subagents.tools import Workspace
from mlx_subagents.tools.delegation import delegation_schema
from tests.helpers import Terminal, call, make_runner, run_parent, scripted_host, spawn_cli, task_text, write_agent

FLOW = """
[[steps]]
id = "find"
agent = "scout"
prompt = "Find the code behind: {input}"

[[steps]]
id = "plan"
agent = "planner"
prompt = "Plan a fix using {find}."
needs = ["find"]
"""
STEPS = {"scout": {"replies": ["src/dates.py:10"]}, "planner": {"replies": ["1. keep the zone"]}}


def write_flow(root: Path, name: str = "fix", text: str = FLOW) -> Path:
    folder = root / ".mlx-subagents" / "workflows"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    path.write_text(text)
    return path


def cli_error(python: list[str], *args: str | Path) -> str:
    """What `subagent ARGS` (run by `python`) says on stderr, without its `error: `, after exiting with 2."""
    process = spawn_cli(*map(str, args), python=python)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2, err
    return err.strip().removeprefix("error: ")


def tool_messages(result: Any) -> list[str]:
    return [m["content"] for m in read_transcript(Path(result.transcript)).messages if m["role"] == "tool"]


def test_a_parent_runs_a_named_workflow_as_its_children(tmp_path: Path, scripted_runner: Any) -> None:
    write_flow(tmp_path)
    run_it = call("subagent", workflow="fix", input="dates lose their zone")
    script = {"agents": {"orchestrator": {"replies": [run_it, "Planned."]}, **STEPS}}
    runner = scripted_runner(script)
    result = run_parent(runner)

    assert (result.status, result.output) == ("completed", "Planned.")
    [answer] = tool_messages(result)
    body, _, footer = answer.partition("\n\n[sub-agent run ")
    assert body == (
        "Workflow fix: 2/2 steps completed\n\n"
        "### [find: scout] completed\nsrc/dates.py:10\n\n"
        "### [plan: planner] completed\n1. keep the zone"
    )
    # The steps ran as the parent's children, in its run folder, with the answers they need.
    [child] = child_runs(load_run(result.run_id))
    labels = [(t.label, t.step_id) for t in child.tasks]
    assert (child.mode, labels) == (
        "workflow",
        [("orchestrator > scout#1", "find"), ("orchestrator > planner#1", "plan")],
    )
    plan = read_transcript(child.transcript_path(child.tasks[1])).messages
    assert plan[1]["content"].startswith("Task: Plan a fix using src/dates.py:10.")
    find = read_transcript(child.transcript_path(child.tasks[0])).messages
    assert "dates lose their zone" in find[1]["content"]


def test_the_tool_offers_the_workflow_form_only_where_workflows_exist(tmp_path: Path, scripted_runner: Any) -> None:
    assert {"workflow", "input"} <= set(delegation_schema(background=True, workflows=True)["properties"])
    assert "workflow" not in delegation_schema(background=True)["properties"]  # `input` stays: `steps` take it

    runner = scripted_runner(["x"])
    parent = runner.catalog.get("orchestrator")

    def description() -> tuple[str, set[str]]:
        tool = runner.board_tools(Parent(parent, "o", 0, ModelRef("m"), None), Workspace(tmp_path))["subagent"]
        function = tool.schema()["function"]
        return function["description"], set(function["parameters"]["properties"])

    text, fields = description()
    assert '"workflow"' not in text and "workflow" not in fields and "steps" in fields
    write_flow(tmp_path, "fix")
    write_flow(tmp_path, "review")
    text, fields = description()
    assert '- {"workflow": NAME, "input": TEXT}: a named workflow of steps on an input (fix, review).' in text
    assert {"workflow", "input"} <= fields


@pytest.mark.slow
@pytest.mark.process
def test_a_workflow_call_is_checked_as_the_cli_checks_it(
    tmp_path: Path, scripted_runner: Any, preloaded_python: list[str]
) -> None:
    write_flow(tmp_path)
    # The parent may start only the scout: the workflow's planner step is refused before any step starts.
    write_agent(tmp_path, "lead", "read, subagent", front="agents: scout\n")
    bad_graph = "[[steps]]\nid = 'a'\nagent = 'scout'\nprompt = 'x'\nneeds = ['b']\n"
    write_flow(tmp_path, "broken", bad_graph)
    calls = [
        call("subagent", workflow="nope", input="x"),
        call("subagent", workflow="broken"),
        call("subagent", workflow="fix", input="x"),
        call("subagent", input="x"),
        call("subagent", workflow="fix", agent="scout", task="x"),
        "done",
    ]
    script = {"agents": {"lead": {"replies": calls}, **STEPS}}
    result = run_parent(scripted_runner(script, assume_yes=True), agent="lead")

    unknown, broken, ungranted, no_flow, two_forms = tool_messages(result)
    assert (
        unknown
        == f"Error: subagent call refused: {cli_error(preloaded_python, 'workflow', 'nope', '--input', 'x', '-C', tmp_path)}"
    )
    assert (
        broken == f"Error: subagent call refused: {cli_error(preloaded_python, 'workflow', 'broken', '-C', tmp_path)}"
    )
    assert ungranted.startswith("Error: subagent call refused: 'lead' may not start 'planner'")
    assert no_flow.startswith("Error: invalid subagent call: 'input' is given without 'workflow';")
    assert two_forms.startswith("Error: invalid subagent call: agent/task and workflow given together;")
    assert child_runs(load_run(result.run_id)) == []  # nothing started


@pytest.mark.process
def test_chat_workflow_runs_the_steps_and_the_parent_reads_their_answers(tmp_path: Path, write_script: Any) -> None:
    write_flow(tmp_path)
    model = write_script({"agents": {"orchestrator": {"replies": ["Hello.", "I read the plan."]}, **STEPS}})
    term = Terminal(["chat", "-m", model, "-C", str(tmp_path)])
    try:
        term.expect("/exit leaves\n> ")
        term.send("hello\n")
        term.expect("Hello.\n> ")
        term.send("/workflow fix dates lose their zone\n")
        shown = term.expect("steps completed; the parent reads their answers next\n> ")
        assert "src/dates.py:10" in shown and "1. keep the zone" in shown and "2/2" in shown
        term.send("what now?\n")
        term.expect("I read the plan.\n> ")
        term.send("/workflow nope x\n")
        assert "unknown workflow 'nope'; available: fix" in term.expect("\n> ")
        term.send("/exit\n")
        assert term.wait() == 0
    finally:
        term.close()
    run = load_run("last")
    parent = read_transcript(run.transcript_path(run.tasks[0])).messages
    [_, user] = [m["content"] for m in parent if m["role"] == "user"]
    assert user.startswith("what now?\n\n[the user ran the workflow fix]\nWorkflow fix: 2/2 steps completed")
    assert [r.mode for r in child_runs(run)] == ["workflow"]


@pytest.mark.slow
def test_a_workflow_in_the_background_starts_each_step_when_its_needs_are_done(tmp_path: Path) -> None:
    write_flow(tmp_path)
    start = call("subagent", workflow="fix", input="dates lose their zone", background=True)
    read = call("task_output", id="planner#1", wait=60)
    steps = {"scout": {"replies": [{"content": "src/dates.py:10", "delay": 0.5}]}, "planner": STEPS["planner"]}
    host = scripted_host({"agents": {"orchestrator": {"replies": [start, read, "Planned."]}, **steps}})
    result = run_parent(make_runner(tmp_path, host))

    assert (result.status, result.output) == ("completed", "Planned.")
    started, planned = tool_messages(result)
    assert started.startswith("Started in the background: scout#1, planner#1.")
    assert planned == "planner#1 completed\n\n1. keep the zone"
    # The planner started after the scout ended, with its answer in the task.
    [plan_prompt] = host.history["orchestrator > planner#1"]
    assert plan_prompt[1]["content"].startswith("Task: Plan a fix using src/dates.py:10.")


def test_a_background_workflow_whose_step_fails_skips_the_steps_that_need_it(tmp_path: Path) -> None:
    write_flow(tmp_path)
    start = call("subagent", workflow="fix", input="x", background=True)
    read = call("task_output", id="planner#1", wait=60)
    steps = {"scout": {"replies": []}, "planner": STEPS["planner"]}  # the scout has no reply: it fails
    host = scripted_host({"agents": {"orchestrator": {"replies": [start, read, "Gave up."]}, **steps}})
    result = run_parent(make_runner(tmp_path, host))

    _, planned = tool_messages(result)
    assert planned == "planner#1 failed: not run: step 'scout#1' did not complete\n\n(no answer)"
    assert "orchestrator > planner#1" not in host.history


# -- inline workflows (issue 44, item 3): {"steps": [...]} on the tool, MCP and the chat -------------------

INLINE = [
    {"name": "find", "agent": "scout", "task": "Find the code behind: {input}"},
    {"name": "plan", "agent": "planner", "task": "Plan a fix using {find}.", "needs": ["find"]},
]


def test_an_inline_workflow_runs_its_steps_when_their_needs_are_done(tmp_path: Path) -> None:
    run_it = call("subagent", steps=INLINE, input="dates lose their zone")
    host = scripted_host({"agents": {"orchestrator": {"replies": [run_it, "Planned."]}, **STEPS}})
    result = run_parent(make_runner(tmp_path, host))

    assert (result.status, result.output) == ("completed", "Planned.")
    child = child_runs(load_run(result.run_id))[0]
    assert tool_messages(result) == [
        "Workflow: 2/2 steps completed\n\n### [find: scout] completed\nsrc/dates.py:10\n\n"
        f"### [plan: planner] completed\n1. keep the zone\n\n[sub-agent run {child.run_id}; task_send continues "
        "scout#1, planner#1]"
    ]
    [find_prompt] = host.history["orchestrator > scout#1"]
    assert find_prompt[1]["content"] == task_text("Find the code behind: dates lose their zone", tmp_path)
    [plan_prompt] = host.history["orchestrator > planner#1"]
    assert plan_prompt[1]["content"] == task_text(
        "Plan a fix using src/dates.py:10.\n\nWorkflow input:\ndates lose their zone", tmp_path
    )
    assert (child.mode, [(t.label, t.step_id) for t in child.tasks]) == (
        "workflow",
        [("orchestrator > scout#1", "find"), ("orchestrator > planner#1", "plan")],
    )


@pytest.mark.slow
def test_an_inline_workflow_in_the_background_starts_each_step_after_its_needs(tmp_path: Path) -> None:
    start = call("subagent", steps=INLINE, input="x", background=True)
    read = call("task_output", id="planner#1", wait=60)
    steps = {"scout": {"replies": [{"content": "src/dates.py:10", "delay": 0.5}]}, "planner": STEPS["planner"]}
    host = scripted_host({"agents": {"orchestrator": {"replies": [start, read, "Planned."]}, **steps}})
    result = run_parent(make_runner(tmp_path, host))

    started, planned = tool_messages(result)
    assert started.startswith("Started in the background: scout#1, planner#1.")
    assert planned == "planner#1 completed\n\n1. keep the zone"
    [plan_prompt] = host.history["orchestrator > planner#1"]
    assert plan_prompt[1]["content"].startswith("Task: Plan a fix using src/dates.py:10.")


def step(name: str, *needs: str, task: str = "do it") -> dict[str, Any]:
    return {"name": name, "agent": "scout", "task": task, "needs": list(needs)}


@pytest.mark.parametrize(
    ("steps", "problem"),
    [
        ([step("a", "b"), step("b", "a")], "steps: the needs form a cycle: a -> b -> a; remove one of these needs"),
        ([step("a"), step("b", "x")], "steps: step 'b' needs unknown step 'x'; known steps: a, b"),
        ([step("a"), step("a")], "steps: duplicate step name 'a'; give every step its own name"),
        ([step(f"s{i}") for i in range(9)], "steps: 9 steps is more than the limit of 8; split the workflow"),
        (
            [step("two words")],
            "steps: steps[0].name 'two words' is not a valid step name; use letters, digits, '_' "
            "and '-', starting with a letter",
        ),
        (
            [step("a", task="uses {b}"), step("b")],
            "steps: step 'a' uses {b} in its prompt but does not need 'b'; add it to needs",
        ),
    ],
)
@pytest.mark.parametrize("background", [False, True])
def test_an_inline_workflow_is_checked_as_a_workflow_file_and_nothing_runs(
    tmp_path: Path, steps: list[dict[str, Any]], problem: str, background: bool
) -> None:
    host = scripted_host(
        {"agents": {"orchestrator": {"replies": [call("subagent", steps=steps, background=background), "ok"]}}}
    )
    result = run_parent(make_runner(tmp_path, host))

    assert tool_messages(result) == [f"Error: subagent call refused: {problem}"]
    assert child_runs(load_run(result.run_id)) == []  # nothing ran
    assert set(host.history) == {"orchestrator"}


def test_a_malformed_inline_workflow_is_refused_with_the_forms(tmp_path: Path) -> None:
    calls = [
        call("subagent", steps=[{"name": "a", "agent": "nobody", "task": "x"}]),
        call("subagent", steps=[{"name": "a", "agent": "scout", "task": " "}]),
        call("subagent", steps=INLINE, agent="scout", task="x"),
    ]
    host = scripted_host({"agents": {"orchestrator": {"replies": [*calls, "ok"]}}})
    unknown, empty, both = tool_messages(run_parent(make_runner(tmp_path, host)))
    assert unknown.startswith("Error: invalid subagent call: unknown agent 'nobody'; use exactly one of these forms:")
    assert empty.startswith("Error: invalid subagent call: 'steps[0].task' is empty; use exactly one of these forms:")
    assert both.startswith("Error: invalid subagent call: agent/task and steps given together;")
    assert '"workflow": "NAME"' not in unknown  # no named workflow here: that form is not named


def test_the_chat_runs_an_inline_workflow(tmp_path: Path, write_script: Any, run_cli: Any, monkeypatch: Any) -> None:
    import io
    import json

    model = write_script({"agents": {"orchestrator": {"replies": ["I read the plan."]}, **STEPS}})
    steps = json.dumps({"steps": INLINE, "input": "dates lose their zone"})
    lines = [f"/workflow {steps}", "/workflow {not json", "what now?", "/exit"]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{line}\n" for line in lines)))
    code, out, err = run_cli("chat", "-m", model, "-C", str(tmp_path))

    assert code == 0, err
    assert "src/dates.py:10" in out and "1. keep the zone" in out
    assert "2/2 steps completed; the parent reads their answers next" in out
    assert (
        "/workflow: the steps are not valid JSON (Expecting property name enclosed in double quotes at character 1)"
        in err
    )
    run = load_run("last")
    parent = read_transcript(run.transcript_path(run.tasks[0])).messages
    [user] = [m["content"] for m in parent if m["role"] == "user"]
    assert user.startswith("what now?\n\n[the user ran a workflow of 2 steps]\nWorkflow: 2/2 steps completed")


def test_a_model_names_a_workflow_never_a_file(tmp_path: Path, scripted_runner: Any) -> None:
    write_flow(tmp_path)
    elsewhere = write_flow(tmp_path / "elsewhere", "evil")  # a workflow file outside the workspace
    workspace = tmp_path / "ws"
    write_flow(workspace)
    calls = [call("subagent", workflow=str(elsewhere)), call("subagent", workflow="../elsewhere/evil.toml"), "done"]
    script = {"agents": {"orchestrator": {"replies": calls}, **STEPS}}

    result = run_parent(scripted_runner(script, cwd=workspace))

    by_path = (
        "Error: subagent call refused: workflow '{}' is a path: a call names a workflow, never a file; available: fix"
    )
    assert tool_messages(result) == [by_path.format(elsewhere), by_path.format("../elsewhere/evil.toml")]
    assert child_runs(load_run(result.run_id)) == []
