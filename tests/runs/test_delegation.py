"""The `subagent` tool: a parent agent delegating in each mode, malformed calls, the recursion cut,
caps, and a parent on the tiny real model whose forced script delegates."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.agents.session import AgentSession
from mlx_subagents.caps import MAX_ANSWER_BYTES
from mlx_subagents.errors import RequestError
from mlx_subagents.events import Event
from mlx_subagents.runs.options import RunOptions
from mlx_subagents.runs.prepared import Parent
from mlx_subagents.runs.tasks import ModelRef
from mlx_subagents.runs.transcripts import child_runs, load_run, read_transcript, runs_dir
from mlx_subagents.tools import Workspace
from mlx_subagents.tools.subagent import SubagentTool
from tests.helpers import call, make_runner, run_parent, scripted_host, task_text, write_agent

# No named workflow in these workspaces: the error lines leave that form out (issue 44, item 7).
FORMS = (
    'use exactly one of these forms: {"agent": "NAME", "task": "TEXT"} for one task; '
    '{"tasks": [{"agent": "NAME", "task": "TEXT"}, ...]} for up to 8 independent tasks in parallel; '
    '{"chain": [{"agent": "NAME", "task": "TEXT"}, ...]} for steps in order, where {previous} in a task is '
    "the previous step's answer; "
    '{"steps": [{"name": "N", "agent": "NAME", "task": "TEXT", "needs": ["M"]}, ...]} for steps that start '
    "when the steps they need are done, where {M} in a task is step M's answer"
)
# The orchestrator may start these four (its agents: grant): the error lists what it may start (issue 26, item 4).
AGENTS = "Available agents: planner, reviewer, scout, worker"


def delegate(**arguments: Any) -> dict[str, Any]:
    return call("subagent", **arguments)


RUN_FOOTER = re.compile(r"\n\n\[sub-agent run ([^\s;\]]+)(; task_send continues [^\]]+)?\]\Z")


def answers(path: Path) -> list[str]:
    """The tool messages of a task's transcript, in order. A subagent result ends by naming the
    children's run, which must be saved in this task's run folder; that line is left out here."""
    contents = []
    for message in read_transcript(path).messages:
        if message["role"] != "tool":
            continue
        content = message["content"]
        if message.get("name") == "subagent" and (footer := RUN_FOOTER.search(content)):
            assert (runs_dir(path.parent) / footer.group(1) / "run.json").is_file()
            content = content[: footer.start()]
        contents.append(content)
    return contents


def tool_results(result: Any) -> list[str]:
    """The tool messages the parent received, in order."""
    return answers(Path(result.transcript))


# -- the three modes ------------------------------------------------------------------------------


def test_single_delegation_returns_the_childs_answer(tmp_path: Path, scripted_runner: Any) -> None:
    (tmp_path / "app.py").write_text("print('hi')\n")
    script = {
        "agents": {
            "orchestrator": {"replies": [delegate(agent="scout", task="where is the app?"), "It is app.py."]},
            "scout": {"replies": [call("ls", path="."), "Findings:\n- app.py:1 — the app"]},
        }
    }
    events: list[Event] = []
    result = run_parent(scripted_runner(script, events))

    assert (result.status, result.output) == ("completed", "It is app.py.")
    assert tool_results(result) == ["Findings:\n- app.py:1 — the app"]
    child_events = [
        (e.kind, e.data.get("description"))
        for e in events
        if e.label == "orchestrator > scout#1" and e.kind in ("task_start", "tool_call", "task_end")
    ]
    assert child_events == [("task_start", None), ("tool_call", "ls ."), ("task_end", None)]
    parent_call = next(e for e in events if e.label == "orchestrator" and e.kind == "tool_call")
    assert parent_call.data["description"] == "subagent scout: where is the app?"
    # The child's run is saved inside the parent's run: `last` stays the run the person started.
    parent = load_run("last")
    assert parent.run_id == result.run_id and parent.tasks[0].agent == "orchestrator"
    child = load_run("last", home=parent.folder)
    assert [(t.label, t.agent, t.status) for t in child.tasks] == [("orchestrator > scout#1", "scout", "completed")]
    assert read_transcript(child.transcript_path(child.tasks[0])).messages[1]["content"] == task_text(
        "where is the app?", tmp_path
    )


def test_parallel_delegation_has_one_section_per_task_and_marks_failures(scripted_runner: Any) -> None:
    bad = {"raw": "<tool_call>{not json</tool_call>"}
    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    delegate(
                        tasks=[
                            {"agent": "scout", "task": "map auth", "label": "auth"},
                            {"agent": "reviewer", "task": "review db.py"},
                            {"agent": "planner", "task": "plan it"},
                        ]
                    ),
                    "Summary.",
                ]
            },
            "scout": {"replies": [{"content": "auth is in auth.py", "delay": 0.1}]},
            "reviewer": {"replies": ["Verdict: approve"]},
            "planner": {"replies": [bad, bad, bad]},
        }
    }
    result = run_parent(scripted_runner(script))

    assert result.output == "Summary."
    assert tool_results(result) == [
        "Parallel: 2/3 tasks completed\n\n"
        "### [auth] completed\nauth is in auth.py\n\n"
        "### [reviewer#1] completed\nVerdict: approve\n\n"
        "### [planner#1] failed (format_errors): 3 malformed tool calls in a row\n<tool_call>{not json</tool_call>"
    ]


def test_chain_delegation_passes_previous_and_returns_the_last_answer(scripted_runner: Any) -> None:
    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    delegate(
                        chain=[
                            {"agent": "scout", "task": "find the parser"},
                            {"agent": "planner", "task": "plan a fix for: {previous}"},
                        ]
                    ),
                    delegate(
                        chain=[
                            {"agent": "scout", "task": "again"},
                            {"agent": "worker", "task": "fix {previous}"},
                            {"agent": "reviewer", "task": "review {previous}"},
                        ]
                    ),
                    "ok",
                ]
            },
            "scout": {"replies": ["parser in parse.py"]},
            "planner": {"replies": ["1. edit parse.py"]},
            "worker": {"replies": [call("ls", path=".")]},  # runs out of replies: the step fails
            "reviewer": {"replies": ["never"]},
        }
    }
    events: list[Event] = []
    result = run_parent(scripted_runner(script, events))

    first, second = tool_results(result)
    assert first == "1. edit parse.py"
    planner_start = next(e for e in events if e.label == "orchestrator > planner#1" and e.kind == "task_start")
    assert planner_start.data["task"] == "plan a fix for: parser in parse.py"
    error = (
        "scripted model: session 'orchestrator > worker#1' (agent 'worker') has no reply left after 1 replies in "
        "the in-memory script"
    )
    assert second == (
        f"Error: Chain stopped at step 2: {error}\n\n"
        "### [1: scout] completed\nparser in parse.py\n\n"
        f"### [2: worker] failed (error): {error}\n(no answer)\n\n"
        "### [3: reviewer] failed (skipped): not run: step '2' did not complete\n(no answer)"
    )


def test_the_footer_offers_only_the_children_task_send_can_continue(scripted_runner: Any) -> None:
    """A skipped chain step and a child out of turns were offered to task_send, which refused them, and
    the skipped step's refusal said it "ran in the foreground"."""
    chain = [
        {"agent": "scout", "task": "again"},
        {"agent": "worker", "task": "fix {previous}"},
        {"agent": "reviewer", "task": "review {previous}"},
    ]
    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    delegate(chain=chain),
                    call("task_send", id="reviewer#1", message="go on"),
                    delegate(agent="planner", task="plan", max_turns=1),
                    "ok",
                ]
            },
            "scout": {"replies": ["parser in parse.py"]},
            "worker": {"replies": [call("ls", path=".")]},  # runs out of replies: the step fails
            "planner": {"replies": [call("ls", path=".")]},  # a tool call at its only turn: out of turns
        }
    }
    result = run_parent(scripted_runner(script))

    contents = [m["content"] for m in read_transcript(Path(result.transcript)).messages if m["role"] == "tool"]
    chained, sent, planned = contents
    assert chained.endswith("; task_send continues scout#1, worker#1]")
    assert sent == "Error: task 'reviewer#1' never ran (not run: step '2' did not complete); start a new task"
    assert RUN_FOOTER.search(planned) and "task_send" not in planned


def test_a_failed_single_child_is_an_error_result_with_its_partial_answer(scripted_runner: Any) -> None:
    script = {
        "agents": {
            "orchestrator": {"replies": [delegate(agent="scout", task="look"), "sorry"]},
            "scout": {
                # different arguments each turn: not a repetition, so the turn limit ends it
                "replies": [
                    {"content": "halfway", "tool_calls": [{"name": "ls", "arguments": {"path": "." + "/." * i}}]}
                    for i in range(20)
                ]
            },
        }
    }
    result = run_parent(scripted_runner(script))
    assert tool_results(result) == [
        "Error: agent 'scout' failed (max_turns): reached the limit of 20 turns without a final answer\n\nhalfway"
    ]


# -- malformed calls ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ({}, "no task given"),
        (
            {"agent": "scout", "task": "a", "tasks": [{"agent": "scout", "task": "b"}]},
            "agent/task and tasks given together",
        ),
        ({"agent": "scout", "task": "  "}, "'task' is empty: say what scout should do"),
        ({"agent": "nobody", "task": "a"}, "unknown agent 'nobody'"),
        (
            {"tasks": [{"agent": "scout", "task": "a"}, {"agent": "planner", "task": ""}]},
            "'tasks[1].task' is empty: say what planner should do",
        ),
        ({"chain": [{"agent": "", "task": "a"}]}, "'chain[0].agent' is empty"),
        ({"agent": "scout", "query": "a"}, "unknown field 'query'"),
        ({"tasks": "scout"}, "'tasks': Input should be a valid list"),
        ({"tasks": [{"agent": "scout"}]}, "'tasks[0].task' is empty: say what scout should do"),
    ],
)
def test_malformed_calls_are_error_results_and_the_parent_goes_on(
    scripted_runner: Any, arguments: dict[str, Any], problem: str
) -> None:
    script = {"agents": {"orchestrator": {"replies": [delegate(**arguments), "I will do it myself."]}}}
    result = run_parent(scripted_runner(script))

    assert (result.status, result.output) == ("completed", "I will do it myself.")
    assert tool_results(result) == [f"Error: invalid subagent call: {problem}; {FORMS}. {AGENTS}"]
    assert load_run("last").folder is not None and not (load_run("last").folder / "runs").exists()  # no child ran


def test_nulls_for_unused_modes_are_accepted(scripted_runner: Any) -> None:
    script = {
        "agents": {
            "orchestrator": {"replies": [delegate(agent="scout", task="a", tasks=None, chain=None, cwd=None), "done"]},
            "scout": {"replies": ["found"]},
        }
    }
    assert tool_results(run_parent(scripted_runner(script))) == ["found"]


def test_caps_and_cwd_problems_are_error_results(tmp_path: Path, scripted_runner: Any) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "inner.txt").write_text("x")
    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    delegate(tasks=[{"agent": "scout", "task": f"t{i}"} for i in range(9)]),
                    delegate(agent="scout", task="x" * 20_001),
                    delegate(
                        tasks=[
                            {"agent": "scout", "task": "a", "label": "same"},
                            {"agent": "planner", "task": "b", "label": "same"},
                        ]
                    ),
                    delegate(agent="scout", task="look", cwd="../elsewhere"),
                    delegate(agent="scout", task="look", cwd="sub"),
                    delegate(tasks=[{"agent": "scout", "task": "a", "label": "x > api"}]),
                    "done",
                ]
            },
            "scout": {"replies": [call("ls", path="."), "listed"]},
        }
    }
    result = run_parent(scripted_runner(script))

    refused, too_long, clash, escape, inside, nested = tool_results(result)
    assert nested == (
        "Error: subagent call refused: task label 'x > api' holds ' > ', which joins a parent's label to its "
        "child's; choose a label without it"
    )
    assert (
        refused
        == "Error: subagent call refused: 9 tasks is more than the limit of 8 per run; split the work into several runs"
    )
    assert too_long == (
        "Error: subagent call refused: task 'orchestrator > scout#1' is 20,001 characters, over the limit "
        "of 20,000; shorten it, or put the details in a file the agent can read"
    )
    assert clash == "Error: subagent call refused: duplicate task label(s): same; give each task its own label"
    assert escape.startswith("Error: cwd: path '../elsewhere' is outside the workspace")
    assert inside == "listed"
    child = load_run("last", home=load_run("last").folder)
    log = read_transcript(child.transcript_path(child.tasks[0]))
    assert log.meta["cwd"] == str((tmp_path / "sub").resolve())
    ls_result = next(m for m in log.messages if m["role"] == "tool")
    assert ls_result["content"] == "inner.txt"


def test_parallel_answers_together_stay_under_the_cap(scripted_runner: Any) -> None:
    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    delegate(
                        tasks=[
                            {"agent": "scout", "task": "a"},
                            {"agent": "planner", "task": "b"},
                            {"agent": "reviewer", "task": "c"},
                        ]
                    ),
                    "done",
                ]
            },
            "scout": {"replies": ["short answer"]},
            "planner": {"replies": ["p" * 30_000]},
            "reviewer": {"replies": ["r" * 40_000]},
        }
    }
    text = tool_results(run_parent(scripted_runner(script)))[0]

    assert len(text.encode()) <= MAX_ANSWER_BYTES
    assert "### [scout#1] completed\nshort answer\n\n" in text
    assert "p" * 20_000 in text and "r" * 20_000 in text
    assert "[answer truncated: 30,000 bytes, showing the first " in text
    assert "[answer truncated: 40,000 bytes, showing the first " in text


def test_children_run_four_at_a_time(scripted_runner: Any) -> None:
    script = {
        "agents": {
            "orchestrator": {
                "replies": [delegate(tasks=[{"agent": "scout", "task": str(i)} for i in range(8)]), "done"]
            },
            "scout": {"replies": [{"content": "ok", "delay": 0.05}]},
        }
    }
    events: list[Event] = []
    text = tool_results(run_parent(scripted_runner(script, events)))[0]

    assert text.startswith("Parallel: 8/8 tasks completed\n\n### [scout#1] completed\nok")
    running, peak = set(), 0
    for e in events:
        if " > " in e.label and e.kind == "task_start":
            running.add(e.label)
            peak = max(peak, len(running))
        elif " > " in e.label and e.kind == "task_end":
            running.discard(e.label)
    assert peak == 4


# -- the recursion cut --------------------------------------------------------------------------------


def test_a_child_without_the_grant_cannot_delegate(scripted_runner: Any) -> None:
    script = {
        "agents": {
            "orchestrator": {"replies": [delegate(agent="scout", task="look"), "done"]},
            "scout": {"replies": [delegate(agent="worker", task="change everything"), "I cannot delegate"]},
        }
    }
    result = run_parent(scripted_runner(script))
    assert tool_results(result) == ["I cannot delegate"]
    child = load_run("last", home=load_run("last").folder)
    # Under the orchestrator, scout also lost `bash` (not granted with `scout!`): see test_delegation_rules.
    assert answers(child.transcript_path(child.tasks[0])) == [
        "Error: unknown tool 'subagent'; available tools: read, grep, find, ls, parent_send"
    ]
    assert not (child.folder / "runs").exists()


def test_the_tool_is_offered_only_to_agents_that_grant_it(tmp_path: Path) -> None:
    host = scripted_host(["x"])
    runner = make_runner(tmp_path, host)
    orchestrator, scout = runner.catalog.get("orchestrator"), runner.catalog.get("scout")
    workspace = Workspace(tmp_path)
    assert list(runner.board_tools(Parent(orchestrator, "o", 0, ModelRef("m"), None), workspace)) == [
        "subagent",
        "task_status",
        "task_output",
        "task_send",
        "task_cancel",
    ]
    # scout has bash: a bash that starts background commands, and the task tools that apply to them
    assert list(runner.board_tools(Parent(scout, "s", 0, ModelRef("m"), None), workspace)) == [
        "bash",
        "task_output",
        "task_cancel",
    ]
    planner = runner.catalog.get("planner")
    assert runner.board_tools(Parent(planner, "p", 0, ModelRef("m"), None), workspace) == {}

    async def sessions() -> tuple[AgentSession, AgentSession]:
        tool = SubagentTool(workspace, delegate=None, agents={}, depth=0)  # type: ignore[arg-type]
        given = [
            AgentSession(spec=s, host=host, workspace=workspace, extra_tools={"subagent": tool})
            for s in (scout, orchestrator)
        ]
        return given[0], given[1]

    scout_session, parent_session = asyncio.run(sessions())
    assert list(scout_session.tools) == ["read", "grep", "find", "ls", "bash"]
    assert [s["function"]["name"] for s in parent_session.schemas] == ["read", "grep", "find", "ls", "subagent"]


def test_the_description_lists_the_other_agents(tmp_path: Path, scripted_runner: Any) -> None:
    runner = scripted_runner(["x"])
    tool = runner.board_tools(
        Parent(runner.catalog.get("orchestrator"), "o", 0, ModelRef("m"), None), Workspace(tmp_path)
    )["subagent"]
    description = tool.schema()["function"]["description"]
    assert description.endswith(
        "Agents:\n"
        "- planner: Turns a task into a short, concrete plan (steps, files to touch, risks). Never edits files.\n"
        "- reviewer: Reviews a change or some code for bugs and reports each problem with its fix and a verdict. Never edits files.\n"
        "- scout: Finds where things are in the codebase and reports exact file locations. Never edits files.\n"
        "- worker: Makes the code change a task asks for, runs the tests, and reports what changed."
    )
    assert "Delegate when a job is bounded and self-contained" in description
    assert "up to 8 independent tasks, 4 at a time" in description
    assert "$defs" not in str(tool.schema())


@pytest.mark.parametrize("max_depth", [1, 2])
def test_depth_beyond_the_limit_is_refused(tmp_path: Path, scripted_runner: Any, max_depth: int) -> None:
    write_agent(tmp_path, "relay", "ls, subagent")
    script = {"agents": {"relay": {"replies": [delegate(agent="relay", task="pass it on"), "done"]}}}
    result = run_parent(scripted_runner(script, assume_yes=True, max_depth=max_depth), agent="relay")

    refusal = (
        f"Error: delegation refused: this agent already runs at depth {max_depth} and the limit is {max_depth} "
        "(max_depth); do the task yourself with your other tools"
    )
    folder = load_run("last").folder
    assert tool_results(result) == ["done"]
    for depth in range(1, max_depth + 1):  # each level's child answered its parent
        child = load_run("last", home=folder)
        assert child.tasks[0].label == " > ".join(["relay", *["relay#1"] * depth])
        folder = child.folder
        assert answers(child.transcript_path(child.tasks[0])) == ([refusal] if depth == max_depth else ["done"])
    assert not (folder / "runs").exists()


def test_max_depth_zero_turns_delegation_off_and_a_bad_value_is_refused(scripted_runner: Any) -> None:
    script = {"agents": {"orchestrator": {"replies": [delegate(agent="scout", task="a"), "alone"]}}}
    result = run_parent(scripted_runner(script, max_depth=0))
    assert tool_results(result) == [
        "Error: delegation refused: this agent already runs at depth 0 and the limit is 0 (max_depth); "
        "do the task yourself with your other tools"
    ]
    with pytest.raises(RequestError, match="max_depth must be a whole number >= 0, got -1"):
        RunOptions(max_depth=-1)


# -- the CLI ------------------------------------------------------------------------------------------


def test_run_shows_children_under_the_parents_tool_call(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    model = write_script(
        {
            "agents": {
                "orchestrator": {"replies": [delegate(agent="scout", task="look"), "all good"]},
                "scout": {"replies": [call("ls", path="."), "nothing here"]},
            }
        }
    )
    code, out, err = run_cli("run", "orchestrator", "check", "-m", model, "-C", str(tmp_path))

    assert (code, out.strip()) == (0, "all good")
    lines = err.splitlines()
    assert lines[:3] == [
        "subagent scout: look",
        "  [orchestrator > scout#1] ls .",
        "  [orchestrator > scout#1] completed",
    ]
    code, _, err = run_cli("run", "orchestrator", "check", "-m", model, "-C", str(tmp_path), "--max-depth", "0")
    assert code == 0 and "delegation refused: this agent already runs at depth 0 and the limit is 0" in err


# -- the tiny real model --------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_forced_parent_delegates_on_the_tiny_real_model(forced_orchestrator: Any) -> None:
    from mlx_subagents.testing import tool_call_text

    result, scripts = forced_orchestrator(
        {
            "orchestrator": [
                tool_call_text("subagent", {"agent": "scout", "task": "list the files"}),
                "The scout found app.py.",
            ],
            "orchestrator > scout#1": [tool_call_text("ls", {"path": "."}), "app.py is the only file"],
        },
        # The tiny tokenizer spends about a token a byte: the orchestrator's prompt and nine tools (about
        # 4,400 tokens) are over half of 8,192, the most a prompt may take.
        context_window=16384,
    )

    assert (result.status, result.output) == ("completed", "The scout found app.py.")
    assert tool_results(result) == ["app.py is the only file"]
    child = load_run("last", home=load_run("last").folder)
    child_log = read_transcript(child.transcript_path(child.tasks[0]))
    assert [m["content"] for m in child_log.messages if m["role"] == "tool"] == ["app.py"]
    assert child_log.results[-1].usage.cached_tokens > 0  # the child's second turn reused its KV cache
    assert scripts.remaining("orchestrator") == scripts.remaining("orchestrator > scout#1") == 0
    assert len(list(runs_dir().iterdir())) == 1


@pytest.mark.slow
def test_two_children_of_one_agent_in_one_reply_each_reuse_their_own_kv_cache(forced_orchestrator: Any) -> None:
    from mlx_subagents.testing import tool_call_text

    both = "\n".join(tool_call_text("subagent", {"agent": "scout", "task": f"list the files {n}"}) for n in (1, 2))
    scout = [tool_call_text("ls", {"path": "."}), "app.py is the only file"]
    replies = {"orchestrator": [both, "Both found app.py."], "orchestrator > scout#1": scout}
    replies["orchestrator > scout#2"] = list(scout)
    # The orchestrator's prompt and tools take about 4,400 of the tiny tokenizer's tokens: over half of 8,192.
    result, scripts = forced_orchestrator(replies, context_window=16384)

    assert (result.status, result.output) == ("completed", "Both found app.py.")
    assert tool_results(result) == ["app.py is the only file", "app.py is the only file"]
    assert scripts.remaining("orchestrator > scout#1") == scripts.remaining("orchestrator > scout#2") == 0
    children = child_runs(load_run(result.run_id))
    assert len(children) == 2
    for child in children:
        log = read_transcript(child.transcript_path(child.tasks[0]))
        first, second = [r["data"] for r in log.records if r.get("kind") == "usage"]
        # Each scout's second turn reads its whole first turn (prompt and reply) from its own cache and
        # prefills only the tool result: the other scout never took that cache over.
        assert second["cached_tokens"] - first["cached_tokens"] == first["input_tokens"] + first["output_tokens"]


def test_concurrent_top_level_calls_naming_one_agent_get_a_host_session_each(tmp_path: Path) -> None:
    from mlx_subagents.tools.delegation import parse_delegation

    host = scripted_host({"agents": {"scout": {"replies": [call("ls", path="."), "seen"]}}})
    runner = make_runner(tmp_path, host)

    async def main() -> list[Any]:
        async with runner:
            calls = [
                parse_delegation(
                    {"agent": "scout", "task": f"look {n}"}, runner.workspace, ["scout"], tool="run_agents"
                )
                for n in (1, 2)
            ]
            return await asyncio.gather(*(runner.delegate(c, None) for c in calls))  # as `subagent mcp` does

    outcomes = asyncio.run(main())
    assert [o.results[0].output for o in outcomes] == ["seen", "seen"]
    assert sorted(host.history) == ["scout", "scout (2)"]
    assert sorted(m[1]["content"] for m, _ in host.history.values()) == [
        task_text("look 1", tmp_path),
        task_text("look 2", tmp_path),
    ]
