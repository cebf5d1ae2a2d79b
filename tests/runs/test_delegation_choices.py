"""What a `subagent` call may choose for each task and step beyond its agent and limits (issue 66): an
output schema for its answer, fewer tools, an addition to its system prompt, a thinking budget, a task
read from a file, one reply without tools; each refused in one line where it would widen."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from mlx_subagents.errors import RequestError
from mlx_subagents.runs.prepared import Parent
from mlx_subagents.runs.tasks import ModelRef, TaskSpec
from mlx_subagents.runs.transcripts import child_runs, load_run, read_transcript
from mlx_subagents.tools import Workspace
from mlx_subagents.tools.delegation import delegation_schema
from tests.helpers import call, run_parent
from tests.host.test_grammar import ANSWER

COUNT = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
NAMES = {"type": "array", "items": {"type": "string"}}


def tool_messages(result: Any) -> list[str]:
    return [m["content"] for m in read_transcript(Path(result.transcript)).messages if m["role"] == "tool"]


def child_logs(result: Any) -> dict[str, Any]:
    """Each child's transcript by its label, read from the parent's run."""
    logs = {}
    for run in child_runs(load_run(result.run_id)):
        for entry in run.tasks:
            logs[entry.label] = read_transcript(run.transcript_path(entry))
    return logs


def test_each_task_chain_step_and_workflow_step_holds_its_answer_to_its_own_schema(scripted_runner: Any) -> None:
    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    call(
                        "subagent",
                        tasks=[
                            {"agent": "scout", "task": "count them", "label": "count", "output_schema": COUNT},
                            {"agent": "planner", "task": "plan it", "label": "plan"},
                        ],
                    ),
                    call("subagent", chain=[{"agent": "scout", "task": "name them", "output_schema": NAMES}]),
                    call("subagent", steps=[{"name": "n", "agent": "scout", "task": "n?", "output_schema": COUNT}]),
                    "all three came back",
                ]
            },
            "planner": {"replies": ["1. do it"]},
        },
        "sessions": {
            # Not JSON at first: one retry with the validation error, then a valid answer.
            "orchestrator > count": {"replies": ["about three", '{"n": 3}']},
            "orchestrator > scout#1": {"replies": ['["a.py", "b.py"]']},
            "orchestrator > scout#2": {"replies": ['{"n": "four"}', '{"n": "four"}']},
        },
    }
    result = run_parent(scripted_runner(script))

    assert (result.status, result.output) == ("completed", "all three came back")
    parallel, chain, workflow = tool_messages(result)
    assert parallel.startswith(
        'Parallel: 2/2 tasks completed\n\n### [count] completed\n{"n": 3}\n\n### [plan] completed\n1. do it'
    )
    assert chain.startswith('["a.py", "b.py"]\n\n[sub-agent run ')
    assert workflow.startswith("Workflow: 0/1 steps completed\n\n### [n: scout] failed (schema): the final answer is")
    logs = child_logs(result)
    count = logs["orchestrator > count"]
    assert count.meta["schema"] == COUNT and count.results[-1].parsed == {"n": 3}
    retry = [m["content"] for m in count.messages if m["role"] == "user"][-1]
    assert retry.startswith("Your final answer does not match the required JSON schema: the answer is not valid JSON")
    assert logs["orchestrator > scout#1"].results[-1].parsed == ["a.py", "b.py"]
    assert logs["orchestrator > plan"].meta["schema"] is None  # its sibling's schema is its own
    assert logs["orchestrator > scout#2"].results[-1].stop_reason == "schema"


@pytest.mark.parametrize(
    "schema, problem",
    [
        ({"type": "nope"}, "not a valid JSON schema: at $.type: 'nope' is not valid under any of the given schemas"),
        ("deep", "the data is nested more than 128 levels deep; flatten it"),
    ],
)
def test_a_bad_or_too_deep_schema_is_refused_before_any_child_starts(
    scripted_runner: Any, schema: Any, problem: str
) -> None:
    if schema == "deep":
        schema = {"type": "object"}
        for _ in range(130):
            schema = {"type": "object", "properties": {"x": schema}}
    tasks = [{"agent": "scout", "task": "look"}, {"agent": "planner", "task": "plan", "output_schema": schema}]
    script = {
        "agents": {"orchestrator": {"replies": [call("subagent", tasks=tasks), "refused"]}, "scout": {"replies": ["x"]}}
    }
    result = run_parent(scripted_runner(script))

    [refused] = tool_messages(result)
    assert refused.startswith("Error: subagent call refused: output schema of task 'orchestrator > planner#1': ")
    assert refused.endswith(problem)
    assert child_runs(load_run(result.run_id)) == []  # not even the scout ran


def test_allowed_tools_narrow_a_child_and_naming_one_it_lacks_is_refused(tmp_path: Path, scripted_runner: Any) -> None:
    (tmp_path / "a.txt").write_text("alpha\n")
    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    call("subagent", agent="scout", task="look", allowed_tools=["edit"]),
                    call("subagent", agent="scout", task="look", allowed_tools=["bash"]),
                    call("subagent", agent="scout", task="look", allowed_tools=["read"]),
                    "narrowed",
                ]
            },
            "scout": {"replies": [call("ls", path="."), call("read", path="a.txt"), "alpha"]},
        }
    }
    runner = scripted_runner(script)
    result = run_parent(runner)

    lacks, withheld, narrowed = tool_messages(result)
    assert lacks == (
        "Error: subagent call refused: task 'orchestrator > scout#1': allowed_tools names 'edit', which 'scout' "
        "does not have here; its tools are read, grep, find, ls: name only those, or leave allowed_tools out"
    )
    assert withheld == (  # the scout's file grants bash, its orchestrator does not pass it on
        "Error: subagent call refused: task 'orchestrator > scout#1': allowed_tools names 'bash', which 'scout' "
        "does not have here (withheld from it here: bash); its tools are read, grep, find, ls: name only those, or "
        "leave allowed_tools out"
    )
    assert narrowed.startswith("alpha\n\n[sub-agent run ")
    [child] = child_logs(result).values()
    ls, read = [m["content"] for m in child.messages if m["role"] == "tool"]
    assert ls == "Error: unknown tool 'ls'; available tools: read, parent_send"  # its channel to its parent stays
    assert read == "     1\talpha"


def test_a_system_prompt_is_added_to_the_childs_and_a_task_file_is_its_task(
    tmp_path: Path, scripted_runner: Any
) -> None:
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "find.md").write_text("Find every TODO in src/.\n")
    (tmp_path.parent / "outside.md").write_text("escape\n")
    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    call("subagent", agent="scout", task_file="../outside.md"),
                    call("subagent", agent="scout", task="look", task_file="jobs/find.md"),
                    call("subagent", agent="scout", task_file="jobs/find.md", system_prompt="Answer in French."),
                    "done",
                ]
            },
            "scout": {"replies": ["trouvé"]},
        }
    }
    host_runner = scripted_runner(script)
    result = run_parent(host_runner)

    outside, both, ran = tool_messages(result)
    assert outside.startswith("Error: invalid subagent call: task_file: ")
    assert "outside the workspace" in outside
    assert both.startswith("Error: invalid subagent call: 'task' and 'task_file' given together; give one of them;")
    assert ran.startswith("trouvé\n\n[sub-agent run ")
    [child] = child_logs(result).values()
    system, task = child.messages[0]["content"], child.messages[1]["content"]
    scout = host_runner.catalog.get("scout").system_prompt.rstrip()
    assert system.startswith(scout + "\n\nAnswer in French.\n\n")
    assert task.startswith("Task: Find every TODO in src/.\n")
    assert child.meta["task"] == "Find every TODO in src/.\n"


def test_a_single_shot_child_replies_once_with_no_tools(scripted_runner: Any) -> None:
    script = {
        "agents": {
            "orchestrator": {"replies": [call("subagent", agent="scout", task="is 2 prime?", single_shot=True), "ok"]},
            "scout": {"replies": ["yes"]},
        }
    }
    runner = scripted_runner(script)
    result = run_parent(runner)

    [answer] = tool_messages(result)
    assert answer.startswith("yes\n\n[sub-agent run ")
    [child] = child_logs(result).values()
    assert child.results[-1].usage.turns == 1
    # No tools were offered: nothing but its system prompt and its task went to the model.
    [prompt] = runner.preparer.hosts[ModelRef(runner.options.model)].history["orchestrator > scout#1"]
    assert [m["role"] for m in prompt] == ["system", "user"]


def test_a_thinking_budget_only_narrows(tmp_path: Path, scripted_runner: Any) -> None:
    runner = scripted_runner(["x"])
    parent = Parent(runner.catalog.get("orchestrator"), "lead", 0, ModelRef(runner.options.model), None, thinking=2048)

    async def prepare(thinking: int) -> Any:
        task = TaskSpec("scout", "look", label="lead > scout#1", thinking=thinking)
        [prepared] = await runner.preparer.prepare([task], workspace=Workspace(tmp_path), parent=parent, delegated=True)
        return prepared

    async def main() -> tuple[Any, str]:
        async with runner:
            less = await prepare(512)
            with pytest.raises(RequestError) as refused:
                await prepare(4096)
            return less, str(refused.value)

    less, refused = asyncio.run(main())
    assert less.limits.thinking == 512
    assert refused == (
        "task 'lead > scout#1': thinking 4096 is more than the 2048 tokens per reply 'scout' may think here; "
        "ask for at most 2048 (0: off), or leave thinking out"
    )


def test_a_fork_keeps_its_callers_prompt_tools_and_thinking(scripted_runner: Any) -> None:
    script = {
        "agents": {
            "orchestrator": {
                "replies": [call("subagent", fork=True, task="look", allowed_tools=["read"], thinking=0), "refused"]
            }
        }
    }
    result = run_parent(scripted_runner(script))

    [refused] = tool_messages(result)
    assert refused.startswith(
        "Error: invalid subagent call: 'fork' with allowed_tools, thinking: a fork keeps its caller's prompt, tools "
        "and thinking, so that it reuses this conversation's cache; leave them out, or start a named agent with them;"
    )


def test_the_schema_offers_each_choice_in_every_form_plainly(scripted_runner: Any, tmp_path: Path) -> None:
    runner = scripted_runner(["x"])
    parent = Parent(runner.catalog.get("orchestrator"), "lead", 0, ModelRef("m"), None)
    parameters = runner.board_tools(parent, Workspace(tmp_path))["subagent"].schema()["function"]["parameters"]

    properties = parameters["properties"]
    forms = [properties, *(properties[f]["items"]["properties"] for f in ("tasks", "chain", "steps"))]
    for fields in forms:
        assert {k: {n: v for n, v in fields[k].items() if n != "description"} for k in CHOICES if k in fields} == {
            "task_file": {"type": "string"},
            "output_schema": {"type": "object"},
            "allowed_tools": {"items": {"type": "string"}, "type": "array"},
            "system_prompt": {"type": "string"},
            "single_shot": {"type": "boolean"},
        }  # `thinking` only where the caller's model thinks (this one has no model)
    assert properties["max_turns"] == {
        "exclusiveMinimum": 0,
        "type": "integer",
        "description": "Fewer turns than its limit.",
    }
    jsonschema.Draft202012Validator.check_schema(parameters)
    thinks = delegation_schema(background=False, thinking=True)["properties"]
    for fields in [thinks, *(thinks[f]["items"]["properties"] for f in ("tasks", "chain", "steps"))]:
        assert {n: v for n, v in fields["thinking"].items() if n != "description"} == {"minimum": 0, "type": "integer"}


CHOICES = ("task_file", "output_schema", "allowed_tools", "system_prompt", "thinking", "single_shot")


def test_a_calls_schema_holds_a_random_childs_answer_on_the_tiny_model(forced_orchestrator: Any) -> None:
    """The child is not forced: the grammar alone holds the random model's one reply to the call's schema."""
    from mlx_subagents.testing import tool_call_text

    asked = {"agent": "scout", "task": "judge app.py", "single_shot": True, "output_schema": ANSWER}
    replies = {"orchestrator": [tool_call_text("subagent", asked), "Judged."]}
    result, scripts = forced_orchestrator(replies, context_window=16384)

    assert (result.status, result.output) == ("completed", "Judged.")
    [answer] = tool_messages(result)
    jsonschema.validate(json.loads(answer.split("\n\n[sub-agent run ")[0]), ANSWER)
    [child] = child_logs(result).values()
    usage = child.results[-1].usage
    assert (child.results[-1].status, usage.turns, usage.constrained_answers) == ("completed", 1, 1)
    jsonschema.validate(child.results[-1].parsed, ANSWER)
