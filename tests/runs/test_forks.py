"""Forks on the scripted host: the `subagent` tool's fork forms and rules, and a fork's conversation,
which extends its parent's exactly (what lets a real host reuse the parent's KV cache)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.agents.prompt import FORK_TASK
from mlx_subagents.errors import ToolError
from mlx_subagents.host import GenerateArgs, MlxModelHost
from mlx_subagents.host.protocol import ToolCall
from mlx_subagents.runs.transcripts import child_runs, load_run, read_transcript
from mlx_subagents.testing import ForcedScripts, make_tiny_model, tool_call_text
from mlx_subagents.tools import Workspace
from mlx_subagents.tools.delegation import FORK_PLACEHOLDER, fork_point, parse_delegation
from tests.helpers import call, go, make_runner, run_parent, scripted_host, write_agent
from tests.host.test_mlx_host import LS_SCHEMA, TASK, run, tool_result


def lead(tmp_path: Path, sessions: dict[str, list[Any]]) -> Any:
    """A runner in `tmp_path` whose agent `lead` (read, subagent) and its forks replay `sessions`."""
    write_agent(tmp_path, "lead", "read, subagent")
    host = scripted_host({"sessions": {name: {"replies": replies} for name, replies in sessions.items()}})
    return host, make_runner(tmp_path, host, assume_yes=True)


def test_a_fork_continues_its_parents_conversation_and_answers_like_a_child(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("alpha\n")
    host, runner = lead(
        tmp_path,
        {
            "lead": [call("read", path="notes.txt"), call("subagent", fork=True, task="sum it up"), "lead is done"],
            "lead > fork#1": ["it says alpha"],
        },
    )

    result = run_parent(runner, "read the notes", agent="lead")

    assert result.output == "lead is done"
    parent_sent = host.history["lead"]
    before_fork, after = parent_sent[1], parent_sent[2]
    fork_sent = host.history["lead > fork#1"][0]
    # The parent's messages as they were at the call, the call closed by the placeholder, then the task.
    assert fork_sent[: len(before_fork) + 1] == [*before_fork, after[len(before_fork)]]
    assert fork_sent[len(before_fork) + 1] == {
        "role": "tool",
        "tool_call_id": after[len(before_fork)]["tool_calls"][0]["id"],
        "name": "subagent",
        "content": FORK_PLACEHOLDER,
    }
    assert fork_sent[-1] == {"role": "user", "content": FORK_TASK.format(task="sum it up")}
    assert len(fork_sent) == len(before_fork) + 3
    # The parent reads the fork's answer as any child's, with its id on the board.
    assert after[-1]["content"].startswith("it says alpha\n\n[sub-agent run ")
    assert "task_send continues fork#1" in after[-1]["content"]


def test_a_background_fork_starts_at_the_call_and_its_notice_comes_like_a_childs(tmp_path: Path) -> None:
    host, runner = lead(
        tmp_path,
        {
            "lead": [
                call("subagent", fork=True, task="look deeper", background=True),
                "Waiting for the fork.",
                call("task_output", id="fork#1"),
                "lead is done",
            ],
            "lead > fork#1": [{"content": "deeper: nothing", "delay": 0.2}],
        },
    )

    result = run_parent(runner, "go", agent="lead")

    assert result.output == "lead is done"
    started, output = [m["content"] for m in host.history["lead"][-1] if m["role"] == "tool"]
    assert started.startswith("Started in the background: fork#1. Carry on with other work;")
    assert output == "fork#1 completed\n\ndeeper: nothing"
    fork_sent = host.history["lead > fork#1"][0]
    assert fork_sent[:3] == host.history["lead"][1][:3]  # system, task, the reply that made the call
    assert fork_sent[3]["content"] == FORK_PLACEHOLDER
    assert fork_sent[4] == {"role": "user", "content": FORK_TASK.format(task="look deeper")}


def test_show_marks_a_fork_of_its_parent_and_resume_continues_it(tmp_path: Path, run_cli: Any) -> None:
    _, runner = lead(
        tmp_path, {"lead": [call("subagent", fork=True, task="sum it up"), "lead is done"], "lead > fork#1": ["done"]}
    )
    run_parent(runner, "go", agent="lead")
    parent = load_run("last")
    child = child_runs(parent)[0]
    path = child.transcript_path(child.tasks[0])
    # On disk: a reference to the parent's first 3 messages (system, task, the call), then only the fork's own.
    task_record, *_, messages_record, _ = [json.loads(line) for line in path.read_text().splitlines()]
    fork_of = task_record["fork_of"]
    assert {k: fork_of[k] for k in ("parent", "run", "messages")} == {
        "parent": "lead",
        "run": parent.run_id,
        "messages": 3,
    }
    assert messages_record["from_parent"] == 3
    assert [m["content"] for m in messages_record["messages"]] == [
        FORK_PLACEHOLDER,
        FORK_TASK.format(task="sum it up"),
        "done",
    ]
    assert "system" not in path.read_text()  # the parent's system prompt is not copied

    code, out, err = run_cli("show", child.run_id)

    assert code == 0, err
    assert f"fork of lead (run {parent.run_id}): its first 3 messages are its parent's" in out
    assert "Task: go" in out and "Task: sum it up" in out  # the conversation as a whole
    code, out, _ = run_cli("show", child.run_id, "--json")
    shown = json.loads(out)["transcripts"][0]
    assert shown["meta"]["fork_of"] == fork_of
    whole = load_messages(parent)[:3] + messages_record["messages"]
    assert shown["messages"] == whole

    second = scripted_host(["more from the fork"])
    resumed = go(make_runner(tmp_path, second, assume_yes=True), "resume", child.run_id, "and then?")

    assert (resumed.status, resumed.output) == ("completed", "more from the fork")
    (sent,) = second.history.values()
    assert sent[0][:-1] == whole
    assert [m["content"] for m in sent[0][-3:]] == [FORK_TASK.format(task="sum it up"), "done", "and then?"]
    assert sent[0][3]["content"] == FORK_PLACEHOLDER  # the conversation it continues is the fork's own
    # The second generation is saved the same way, and reads back whole.
    last = json.loads(path.read_text().splitlines()[-2])
    assert (last["from_parent"], last["messages"][-1]["content"]) == (3, "more from the fork")
    assert read_transcript(path).messages == [
        *whole,
        sent[0][-1],
        {"role": "assistant", "content": "more from the fork"},
    ]

    # A fork whose parent's run is gone: one line naming that run.
    (parent.folder / "run.json").unlink()  # type: ignore[operator]
    code, out, err = run_cli("show", child.run_id)
    assert code != 0
    assert (
        f"this fork's first 3 messages are those of task 'lead' of run {parent.run_id}, and that run's transcript "
        f"is missing from {parent.folder}; restore that run folder to read this fork"
    ) in err


def load_messages(record: Any) -> list[dict[str, Any]]:
    """The saved conversation of a run's only task."""
    messages = read_transcript(record.transcript_path(record.tasks[0])).messages
    assert messages is not None
    return messages


def test_a_fork_transcript_from_before_references_reads_as_it_was_saved(tmp_path: Path) -> None:
    path = tmp_path / "01-fork.jsonl"
    whole = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "Task: go"},
        {"role": "user", "content": "t"},
    ]
    records = [
        {
            "type": "task",
            "agent": "lead",
            "model": "m",
            "cwd": str(tmp_path),
            "fork_of": {"parent": "lead", "messages": 2},
        },
        {"type": "messages", "messages": whole},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert read_transcript(path).messages == whole


def test_forks_in_tasks_run_side_by_side_and_cannot_delegate_again(tmp_path: Path) -> None:
    host, runner = lead(
        tmp_path,
        {
            "lead": [
                call(
                    "subagent", tasks=[{"fork": True, "task": "one", "label": "first"}, {"fork": True, "task": "two"}]
                ),
                "both done",
            ],
            "lead > first": [call("subagent", fork=True, task="deeper"), "one done"],  # its label is its id
            "lead > fork#1": ["two done"],
        },
    )

    result = run_parent(runner, "split it", agent="lead")

    assert result.output == "both done"
    answer = host.history["lead"][1][-1]["content"]
    assert answer.startswith(
        "Parallel: 2/2 tasks completed\n\n### [first] completed\none done\n\n### [fork#1] completed\n"
    )
    refused = host.history["lead > first"][1][-1]
    assert refused["content"] == "Error: subagent: a fork does its task itself; use your other tools and answer"
    # The fork offers the very tools its parent did: the same prefix.
    first, fork = host.history["lead"][0], host.history["lead > first"][0]
    assert fork[0] == first[0]


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        (
            {"fork": True, "agent": "scout", "task": "x"},
            "'fork' names an agent: a different prompt or model cannot reuse this conversation's cache; "
            "leave out agent and model, or start a named agent without fork",
        ),
        (
            {"tasks": [{"fork": True, "task": "x", "model": "other"}]},
            "'tasks[0].fork' names a model: a different prompt or model cannot reuse this conversation's cache; "
            "leave out agent and model, or start a named agent without fork",
        ),
        (
            {"chain": [{"agent": "scout", "task": "a"}, {"fork": True, "task": "b"}]},
            "'chain[1].fork': only a chain's first step may be a fork",
        ),
        ({"fork": True, "task": " "}, "'task' is empty: say what the fork should do"),
        (
            {"fork": True, "tasks": [{"agent": "scout", "task": "a"}]},
            "'fork' at the top goes with 'task' only; in 'tasks' or 'chain', set it in the item",
        ),
    ],
)
def test_a_fork_that_names_an_agent_or_a_model_is_refused_with_why(
    tmp_path: Path, arguments: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ToolError) as caught:
        parse_delegation(arguments, Workspace(tmp_path), ["scout"])
    assert str(caught.value).startswith(f"invalid subagent call: {problem}; use exactly one of these forms")


def test_a_forks_chain_step_and_its_call_parse() -> None:
    workspace = Workspace(Path.cwd())
    chain = parse_delegation(
        {"chain": [{"fork": True, "task": "a"}, {"agent": "scout", "task": "{previous}"}]}, workspace, ["scout"]
    )
    assert [(t.fork, t.agent) for t in chain.tasks] == [(True, ""), (False, "scout")]
    single = parse_delegation({"fork": True, "task": "a", "label": "mine"}, workspace, ["scout"])
    assert (single.mode, single.tasks[0].fork, single.tasks[0].label) == ("single", True, "mine")


# -- the host: a fork starts from its parent's KV cache ------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gemma3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny gemma3-like folder: a sliding window shorter than the prompts (a rotating KV cache)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3_text")


@pytest.mark.slow
@pytest.mark.parametrize("arch_fixture", ["tiny_qwen3_path", "tiny_qwen35_path", "tiny_gemma3_path"])
def test_a_fork_prefills_only_its_placeholder_and_task_and_matches_a_cold_run(
    arch_fixture: str, request: pytest.FixtureRequest, tiny_qwen3: Any
) -> None:
    path: Path = request.getfixturevalue(arch_fixture)
    scripts = ForcedScripts(tiny_qwen3[1], {"p": [tool_call_text("ls", {"path": "."})]})
    args = GenerateArgs(max_tokens=12)

    async def go() -> tuple[Any, ...]:
        async with MlxModelHost(str(path), processor_factory=scripts) as host:
            parent = host.session("p")
            first = await parent.generate(TASK, GenerateArgs(max_tokens=64), tools=[LS_SCHEMA])
            forking = TASK + [first.to_message()]
            fork_messages = [*fork_point(forking), {"role": "user", "content": FORK_TASK.format(task="count them")}]
            forked = await host.session("p > fork#1", fork_of="p").generate(fork_messages, args, tools=[LS_SCHEMA])
            going_on = [*forking, tool_result(0)]
            after = await parent.generate(going_on, args, tools=[LS_SCHEMA])
            async with MlxModelHost(str(path), reuse=False) as cold:
                cold_fork = await cold.session("a").generate(fork_messages, args, tools=[LS_SCHEMA])
                cold_after = await cold.session("b").generate(going_on, args, tools=[LS_SCHEMA])
            return first, forked, after, cold_fork, cold_after

    first, forked, after, cold_fork, cold_after = run(go())
    assert first.tool_calls == [ToolCall("ls", {"path": "."}, "call_0")]
    held = first.usage.prompt_tokens + first.usage.generated_tokens
    # The fork starts at exactly the parent's ids and prefills only the placeholder and its task.
    assert forked.usage.cached_tokens == held
    assert forked.usage.prompt_tokens == cold_fork.usage.prompt_tokens
    assert forked.usage.prefilled_tokens == cold_fork.usage.prompt_tokens - held
    assert forked.token_ids == cold_fork.token_ids and len(forked.token_ids) > 0
    # The parent goes on from its own cache, untouched by the fork.
    assert after.usage.cached_tokens == held
    assert after.token_ids == cold_after.token_ids


@pytest.mark.slow
def test_four_forks_on_the_tiny_model_start_from_their_parents_cache(
    tmp_path: Path, forced_runner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_agent(tmp_path, "lead", "ls, subagent")
    made: list[MlxModelHost] = []  # the runner's host, kept to read its scheduler after the run
    init = MlxModelHost.__init__
    monkeypatch.setattr(MlxModelHost, "__init__", lambda self, *a, **k: (made.append(self), init(self, *a, **k))[1])
    events: list[Any] = []
    forks = [{"fork": True, "task": f"check part {i}"} for i in range(4)]
    runner, scripts = forced_runner(
        {
            "lead": [tool_call_text("ls", {"path": "."}), tool_call_text("subagent", {"tasks": forks}), "lead is done"],
            **{f"lead > fork#{i + 1}": [f"part {i} is fine"] for i in range(4)},
        },
        events,
        assume_yes=True,
        context_window=8192,  # the parent reads four answers on top of its long prompt
    )

    result = run_parent(runner, "look around", agent="lead")

    assert (result.status, result.error, result.output) == ("completed", None, "lead is done")
    usage = [(e.label, e.data) for e in events if e.kind == "usage"]
    parent_at_fork = [d for label, d in usage if label == "lead"][1]  # after the reply that made the call
    firsts = {label: d for label, d in reversed(usage) if label.startswith("lead > fork")}
    assert sorted(firsts) == ["lead > fork#1", "lead > fork#2", "lead > fork#3", "lead > fork#4"]
    for first in firsts.values():
        assert first["cached_tokens"] == parent_at_fork["context_tokens"]
        # Prefilled: only the placeholder result, the task message and the reply's opening (a token is
        # at least a character here; their exact count is the host test's), never the parent's again.
        tail = len(FORK_PLACEHOLDER) + len(FORK_TASK.format(task="check part 0")) + 60
        assert 0 < first["input_tokens"] - first["cached_tokens"] < tail
    assert [scripts.remaining(f"lead > fork#{i + 1}") for i in range(4)] == [0, 0, 0, 0]
    # Arriving together, the four decoded together: one batch held all of them at once.
    (host,) = made
    assert host._scheduler.decode.most_decoding == 4


def test_a_prompt_starts_from_the_longest_shared_prefix_it_extends() -> None:
    from mlx_subagents.host.kv.prefix_cache import SharedPrefixes
    from tests.host.test_kv_pool import cache_holding

    prefixes = SharedPrefixes()
    prefixes.add([1, 2], cache_holding(2, 1.0))  # the agent's prefix, first in
    prefixes.add([1, 2, 3, 4], cache_holding(4, 2.0))  # its conversation at a fork
    got = prefixes.start([1, 2, 3, 4, 5])
    assert got is not None and (got[1], got[0][0].offset) == (4, 4)
    got = prefixes.start([1, 2, 9])
    assert got is not None and got[1] == 2


def test_fork_is_offered_only_where_a_calling_agent_exists() -> None:
    from mlx_subagents.tools.delegation import delegation_schema

    agent, client = delegation_schema(background=True), delegation_schema(background=False, forks=False)
    assert "fork" in agent["properties"] and "fork" in agent["properties"]["tasks"]["items"]["properties"]
    assert "fork" not in client["properties"]
    assert "fork" not in client["properties"]["tasks"]["items"]["properties"]
    assert "fork" not in client["properties"]["chain"]["items"]["properties"]


@pytest.mark.slow
def test_a_background_fork_on_the_tiny_model_starts_at_the_call_while_its_parent_goes_on(
    tmp_path: Path, forced_runner: Any
) -> None:
    write_agent(tmp_path, "lead", "ls, subagent")
    events: list[Any] = []
    runner, _ = forced_runner(
        {
            "lead": [
                tool_call_text("subagent", {"fork": True, "task": "check app.py", "background": True}),
                tool_call_text("task_output", {"id": "fork#1", "wait": True}),
                "lead is done",
            ],
            "lead > fork#1": ["app.py prints hi"],
        },
        events,
        assume_yes=True,
        context_window=8192,  # the tiny tokenizer spends about a token a byte on the lead's prompt
    )

    result = run_parent(runner, "look around", agent="lead")

    assert (result.status, result.error, result.output) == ("completed", None, "lead is done")
    usage = [(e.label, e.data) for e in events if e.kind == "usage"]
    parent_at_fork = [d for label, d in usage if label == "lead"][0]
    fork_first = next(d for label, d in usage if label == "lead > fork#1")
    assert fork_first["cached_tokens"] == parent_at_fork["context_tokens"]


def test_forks_spilled_under_kv_pressure_are_restored_and_continue_token_identically(tiny_qwen3_path: Path) -> None:
    from tests.host.test_batching import task

    async def go(budget: int) -> tuple[list[Any], Any, dict[str, int]]:
        async with MlxModelHost(str(tiny_qwen3_path), kv_budget=budget, max_sessions=1, share_prefix=False) as host:
            # Short conversations (the tiny model's greedy tokens vary there, so a wrong cache shows),
            # spilled rather than dropped however short.
            host._pool.drop_below_tokens = 0
            parent = host.session("p")
            reply = await parent.generate(task(0), GenerateArgs(max_tokens=16))
            at_fork = [*task(0), reply.to_message()]
            held = {"parent": parent.held_tokens, "parent_bytes": parent.kv_bytes}

            async def fork(i: int, session: Any) -> list[Any]:
                mine, replies = [*at_fork, {"role": "user", "content": FORK_TASK.format(task=f"check part {i}")}], []
                for turn in range(2):  # the second turn finds its cache spilled while the other fork ran
                    replies.append(await session.generate(mine, GenerateArgs(max_tokens=16)))
                    mine = [*mine, replies[-1].to_message(), {"role": "user", "content": f"and part {i + turn}?"}]
                return replies

            forks = {i: host.session(f"p > fork#{i}", fork_of="p") for i in (1, 2)}  # both of the parent as it is now
            out = list(await asyncio.gather(*(fork(i, session) for i, session in forks.items())))
            stats = await host.memory_stats()
            held["prefixes"], held["prefix_bytes"] = len(host._scheduler.prefixes), host._scheduler.prefixes.nbytes()
            return out, stats, held

    unbounded, free_stats, _ = asyncio.run(go(0))
    # Room for the parent's prefix and one fork's turn, not for the other fork's idle cache as well.
    budget = 448 * 1024
    bounded, stats, held = asyncio.run(go(budget))
    assert free_stats.pool["evictions"] == 0
    assert [[r.token_ids for r in f] for f in bounded] == [[r.token_ids for r in f] for f in unbounded]
    assert len({r.token_ids for f in bounded for r in f}) > 1  # the turns differ: a wrong cache would show
    assert stats.pool["peak_bytes"] <= budget
    # Both forks were spilled and restored (the parent, spilled too, has no turn to restore it for).
    assert stats.pool["restores"] == 2 and stats.pool["spills"] >= 3 and stats.pool["drops"] == 0
    for first, second in bounded:
        assert first.usage.cached_tokens == held["parent"]  # from the parent's cache
        # Restored, not cold: the second turn starts at every id its first held.
        assert second.usage.cached_tokens == first.usage.prompt_tokens + first.usage.generated_tokens
    # The parent's conversation at the fork point is one shared prefix, counted once for both forks (under
    # 256 tokens a copy of the parent's cache, not held once: `prefixed_cache.MIN_SHARED_TOKENS`).
    assert (held["prefixes"], held["prefix_bytes"]) == (1, held["parent_bytes"])
    assert stats.kv_bytes_total == sum(stats.kv_bytes_by_session.values()) + held["prefix_bytes"]
