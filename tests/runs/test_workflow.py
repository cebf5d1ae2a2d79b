"""Workflows: TOML steps with needs, run as soon as their needs are done, and every rejection."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.errors import WorkflowError
from mlx_subagents.events import Event
from mlx_subagents.runs.transcripts import runs_dir
from mlx_subagents.runs.workflow import (
    WorkflowStep,
    find_cycle,
    find_workflow,
    load_workflow,
    parse_workflow,
    render_prompt,
)
from tests.helpers import go

FLOW = """
name = "fix"

[[steps]]
id = "find"
agent = "scout"
prompt = "Find the code behind: {input}"

[[steps]]
id = "history"
agent = "reviewer"
prompt = "Read the git history."

[[steps]]
id = "plan"
agent = "planner"
prompt = "Plan a fix using {find}."
needs = ["find", "history"]
"""


def write(tmp_path: Path, text: str, name: str = "flow.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_steps_get_the_input_and_the_answers_they_need(tmp_path: Path, scripted_runner: Any) -> None:
    script = {
        "agents": {
            "scout": {"replies": [{"content": "src/dates.py:10", "delay": 0.1}]},
            "reviewer": {"replies": [{"content": "changed last week", "delay": 0.2}]},
            "planner": {"replies": ["1. fix it"]},
        }
    }
    events: list[Event] = []
    outcome = go(scripted_runner(script, events), "workflow", write(tmp_path, FLOW), "dates lose their zone")

    assert (outcome.mode, outcome.succeeded, outcome.total) == ("workflow", 3, 3)
    assert [(r.step_id, r.label, r.output) for r in outcome.results] == [
        ("find", "find", "src/dates.py:10"),
        ("history", "history", "changed last week"),
        ("plan", "plan", "1. fix it"),
    ]
    assert [r.task for r in outcome.results] == [
        "Find the code behind: dates lose their zone",
        "Read the git history.\n\nWorkflow input:\ndates lose their zone",
        "Plan a fix using src/dates.py:10.\n\nWorkflow input:\ndates lose their zone\n\n"
        "Answer of step 'history':\nchanged last week",
    ]
    order = [(e.kind, e.label) for e in events if e.kind in ("task_start", "task_end")]
    assert order.index(("task_start", "plan")) > max(
        order.index(("task_end", "find")), order.index(("task_end", "history"))
    )


@pytest.mark.slow
def test_a_step_starts_as_soon_as_its_own_needs_are_done(tmp_path: Path, scripted_runner: Any) -> None:
    flow = write(
        tmp_path,
        """
[[steps]]
id = "slow"
agent = "reviewer"
prompt = "take your time"

[[steps]]
id = "quick"
agent = "scout"
prompt = "be quick"

[[steps]]
id = "next"
agent = "planner"
prompt = "go on from {quick}"
needs = ["quick"]
""",
    )
    script = {
        "agents": {
            "reviewer": {"replies": [{"content": "slow done", "delay": 0.5}]},
            "scout": {"replies": ["quick done"]},
            "planner": {"replies": ["next done"]},
        }
    }
    events: list[Event] = []
    outcome = go(scripted_runner(script, events), "workflow", flow)

    assert outcome.ok
    ends = [e.label for e in events if e.kind == "task_end"]
    assert ends == ["quick", "next", "slow"]


def test_a_step_whose_need_failed_is_skipped(tmp_path: Path, scripted_runner: Any) -> None:
    script = {
        "agents": {
            "scout": {"replies": [{"raw": "<tool_call>x</tool_call>"}] * 3},
            "reviewer": {"replies": ["fine"]},
            "planner": {"replies": ["never"]},
        }
    }
    outcome = go(scripted_runner(script), "workflow", write(tmp_path, FLOW), "x")

    assert [(r.status, r.stop_reason) for r in outcome.results] == [
        ("failed", "format_errors"),
        ("completed", "completed"),
        ("failed", "skipped"),
    ]
    assert outcome.results[2].error == "not run: step 'find' did not complete"
    assert (outcome.succeeded, outcome.total) == (1, 3)


STEP = '[[steps]]\nid = "{id}"\nagent = "{agent}"\nprompt = "{prompt}"\nneeds = {needs}\n'


def steps(*specs: tuple[str, str, list[str]], prompt: str = "do it") -> str:
    return "\n".join(STEP.format(id=i, agent=a, prompt=prompt, needs=str(n).replace("'", '"')) for i, a, n in specs)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            steps(("a", "scout", []), ("b", "nobody", ["a"])),
            "step 'b' uses unknown agent 'nobody'; available: orchestrator, planner, reviewer, scout, worker",
        ),
        (steps(("a", "scout", []), ("b", "planner", ["c"])), "step 'b' needs unknown step 'c'; known steps: a, b"),
        (steps(("a", "scout", []), ("a", "planner", [])), "duplicate step id 'a'; give every step its own id"),
        (
            steps(("a", "scout", ["c"]), ("b", "planner", ["a"]), ("c", "planner", ["b"])),
            "the needs form a cycle: a -> c -> b -> a; remove one of these needs",
        ),
        (steps(("a", "scout", ["a"])), "step 'a' needs itself; remove 'a' from its needs"),
        (
            steps(("a", "scout", [])) + '[[steps]]\nid = "b"\nagent = "planner"\nprompt = "use {a}"\n',
            "step 'b' uses {a} in its prompt but does not need 'a'; add it to needs",
        ),
        (steps(("a", "scout", []), prompt="use {a}"), "step 'a' uses {a}, its own answer, in its prompt; remove it"),
        (steps(*[(f"s{i}", "scout", []) for i in range(9)]), "9 steps is more than the limit of 8; split the workflow"),
        ('[[steps]]\nid = "a"\nagent = "scout"\n', "step 'a': missing field 'prompt'; add it"),
        ('[[steps]]\nid = "a"\nagent = "scout"\nprompt = "p"\ncolour = "red"\n', "step 'a': unknown field 'colour'"),
        ('[[steps]]\nid = "1a"\nagent = "scout"\nprompt = "p"\n', "step '1a': field 'id' '1a' is not a valid id"),
        ('name = "x"\n', "no steps: add at least one [[steps]] table"),
        ("[[steps]\n", "invalid TOML: "),
    ],
)
def test_a_bad_workflow_is_rejected_before_anything_runs(
    tmp_path: Path, scripted_runner: Any, text: str, message: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(WorkflowError) as info:
        go(scripted_runner(["done"]), "workflow", path)
    assert str(info.value).startswith(f"{path}: {message}")
    assert not runs_dir().exists()


def test_named_workflows_are_found_from_a_subfolder(tmp_path: Path, scripted_runner: Any) -> None:
    folder = tmp_path / ".mlx-subagents" / "workflows"
    folder.mkdir(parents=True)
    write(folder, FLOW, "fix.toml")
    sub = tmp_path / "src" / "deep"
    sub.mkdir(parents=True)

    assert find_workflow("fix", sub) == (folder / "fix.toml").resolve()
    flow = write(tmp_path, FLOW)
    assert find_workflow("../../flow.toml", sub) == flow.resolve()
    assert find_workflow(str(flow), sub) == flow.resolve()
    with pytest.raises(WorkflowError, match="unknown workflow 'nope'; available: fix"):
        find_workflow("nope", sub)
    with pytest.raises(WorkflowError, match="workflow file not found: missing.toml"):
        find_workflow("missing.toml", sub)
    assert go(scripted_runner(["answer"]), "workflow", "fix", "input").succeeded == 3


def test_render_prompt_places_or_appends() -> None:
    step = WorkflowStep(id="c", agent="planner", prompt="In: {input}; A: {a}; {unknown} {x", needs=("a", "b"))
    assert render_prompt(step, "IN", {"a": "AA", "b": "BB"}) == "In: IN; A: AA; {unknown} {x\n\nAnswer of step 'b':\nBB"
    bare = WorkflowStep(id="d", agent="scout", prompt="go")
    assert render_prompt(bare, "", {}) == "go"


def test_graph_helpers() -> None:
    assert find_cycle({"a": ("b",), "b": ()}) is None
    assert find_cycle({"a": ("b",), "b": ("a",)}) == ["a", "b", "a"]
    flow = parse_workflow({"steps": [{"id": "a", "agent": "scout", "prompt": "p", "schema": "s.json"}]})
    assert flow.steps[0].schema_file == "s.json"
    assert load_workflow(write(Path(__import__("tempfile").mkdtemp()), FLOW)).name == "fix"


def test_a_steps_needed_answers_are_cut_to_the_task_cap_each_cut_said() -> None:
    """A step's `{name}` was not capped as a chain's `{previous}` is: a 30,000-character answer made a
    30,025-character task. The short answer keeps its length; the long ones share what is left."""
    from mlx_subagents.caps import MAX_TASK_CHARS

    step = WorkflowStep(id="c", agent="planner", prompt="From {a} and {b}", needs=("a", "b", "s"))
    answers = {"a": "a" * 30_000, "b": "b" * 12_000, "s": "short"}
    task = render_prompt(step, "", answers)
    assert len(task) <= MAX_TASK_CHARS
    cut = "\n[step '{}''s answer is cut here, to keep this task within 20,000 characters: it has {:,}]"
    room = MAX_TASK_CHARS - len("From  and \n\nAnswer of step 's':\nshort")  # what the task leaves them
    b = "b" * (room // 2 - len(cut.format("b", 12_000))) + cut.format("b", 12_000)
    a = "a" * (room - len(b) - len(cut.format("a", 30_000))) + cut.format("a", 30_000)
    assert task == f"From {a} and {b}\n\nAnswer of step 's':\nshort"
    assert render_prompt(step, "", {**answers, "a": "A", "b": "B"}) == "From A and B\n\nAnswer of step 's':\nshort"
