"""The Python API of many agents at once: order, isolation, concurrency, chains, limits, caps,
cancellation and structured output, on the scripted model."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.caps import MAX_ANSWER_BYTES, cap_answer, utf8_head
from mlx_subagents.errors import AgentNotFoundError, InputTooLargeError, RequestError, SchemaFileError
from mlx_subagents.events import Event
from mlx_subagents.mcp_server.tasks import window
from mlx_subagents.runs.tasks import TaskSpec, label_tasks, load_tasks_file
from mlx_subagents.runs.transcripts import read_transcript, runs_dir
from tests.helpers import call, go, make_runner, scripted_host, task_text


def max_running(events: list[Event]) -> int:
    running: set[str] = set()
    peak = 0
    for e in events:
        if e.kind == "task_start":
            running.add(e.label)
            peak = max(peak, len(running))
        elif e.kind == "task_end":
            running.discard(e.label)
    return peak


# -- parallel -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_parallel_results_come_back_in_input_order(scripted_runner: Any) -> None:
    script = {
        "agents": {
            "scout": {"replies": [{"content": "slow scout", "delay": 1.2}]},
            "planner": {"replies": [{"content": "quick plan", "delay": 0.0}]},
            "reviewer": {"replies": [{"content": "mid review", "delay": 0.6}]},
        }
    }
    events: list[Event] = []
    tasks = [TaskSpec("scout", "a"), TaskSpec("planner", "b"), TaskSpec("reviewer", "c")]
    outcome = go(scripted_runner(script, events), "parallel", tasks)

    assert [r.output for r in outcome.results] == ["slow scout", "quick plan", "mid review"]
    assert [r.label for r in outcome.results] == ["scout", "planner", "reviewer"]
    assert [e.label for e in events if e.kind == "task_end"] == ["planner", "reviewer", "scout"]
    assert (outcome.mode, outcome.succeeded, outcome.total, outcome.interrupted) == ("parallel", 3, 3, False)


def test_a_failing_task_never_discards_the_others(scripted_runner: Any) -> None:
    bad = {"raw": "<tool_call>{not json</tool_call>"}
    script = {
        "agents": {
            "scout": {"replies": [call("ls", path="."), "found it"]},
            "planner": {"replies": [bad, bad, bad]},
            "reviewer": {"replies": []},  # runs out of replies at once: a host error
        },
        "replies": ["fallback"],
    }
    tasks = [TaskSpec("scout", "a"), TaskSpec("planner", "b"), TaskSpec("reviewer", "c"), TaskSpec("worker", "d")]
    outcome = go(scripted_runner(script), "parallel", tasks)

    assert [(r.status, r.stop_reason) for r in outcome.results] == [
        ("completed", "completed"),
        ("failed", "format_errors"),
        ("failed", "error"),
        ("completed", "completed"),
    ]
    assert [r.output for r in outcome.results][::3] == ["found it", "fallback"]
    assert "no reply left" in outcome.results[2].error
    assert (outcome.succeeded, outcome.total, outcome.ok) == (2, 4, False)


@pytest.mark.parametrize("concurrency", [1, 2, 4])
def test_the_concurrency_limit_is_never_exceeded(scripted_runner: Any, concurrency: int) -> None:
    script = {"replies": [call("ls", path="."), {"content": "done", "delay": 0.05}]}
    events: list[Event] = []
    tasks = [TaskSpec("scout", f"task {i}") for i in range(8)]
    outcome = go(scripted_runner(script, events), "parallel", tasks, concurrency=concurrency)

    assert outcome.succeeded == 8
    assert max_running(events) == concurrency
    assert [r.label for r in outcome.results] == [f"scout-{i}" for i in range(1, 9)]


def test_more_than_eight_tasks_or_a_bad_concurrency_is_refused(scripted_runner: Any) -> None:
    runner = scripted_runner(["done"])
    with pytest.raises(RequestError, match="9 tasks is more than the limit of 8 per run"):
        go(runner, "parallel", [TaskSpec("scout", "x")] * 9)
    with pytest.raises(RequestError, match=r"concurrency must be from 1 to 4 \(up to 8 with --engine\), got 5"):
        go(runner, "parallel", [TaskSpec("scout", "x")], concurrency=5)
    with pytest.raises(RequestError, match="no tasks given"):
        go(runner, "parallel", [])
    assert not runs_dir().exists()  # nothing started, nothing saved


def test_labels_number_shared_agents_and_refuse_duplicates() -> None:
    tasks = label_tasks(
        [
            TaskSpec("scout", "a"),
            TaskSpec("Scout", "b"),
            TaskSpec("planner", "c"),
            TaskSpec("planner", "d", label="mine"),
        ]
    )
    assert [(t.agent, t.label) for t in tasks] == [
        ("scout", "scout-1"),
        ("scout", "scout-2"),
        ("planner", "planner"),
        ("planner", "mine"),
    ]
    with pytest.raises(RequestError, match="duplicate task label"):
        label_tasks([TaskSpec("scout", "a", label="x"), TaskSpec("planner", "b", label="x")])


def test_an_unknown_agent_is_refused_before_anything_runs(scripted_runner: Any) -> None:
    runner = scripted_runner(["done"])
    with pytest.raises(AgentNotFoundError, match="unknown agent 'nobody'"):
        go(runner, "parallel", [TaskSpec("scout", "a"), TaskSpec("nobody", "b")])
    with pytest.raises(AgentNotFoundError):
        go(runner, "run", TaskSpec("nobody", "b"))
    assert not runs_dir().exists()


def test_tasks_file(tmp_path: Path) -> None:
    path = tmp_path / "tasks.yaml"
    path.write_text(
        "tasks:\n  - {agent: scout, task: map auth, label: auth}\n  - {agent: reviewer, task: review, timeout: 5}\n"
    )
    assert load_tasks_file(path) == [
        TaskSpec("scout", "map auth", label="auth"),
        TaskSpec("reviewer", "review", timeout=5.0),
    ]
    path.write_text("- {agent: scout}\n")
    with pytest.raises(RequestError, match=r"tasks.yaml: tasks\[0\].task: Field required"):
        load_tasks_file(path)


# -- chain ----------------------------------------------------------------------------------------


def test_chain_passes_the_previous_answer(tmp_path: Path, scripted_runner: Any) -> None:
    script = {
        "agents": {
            "scout": {"replies": [call("ls", path="."), "the parser is in src/parse.py"]},
            "planner": {"replies": ["1. fix src/parse.py"]},
            "reviewer": {"replies": ["looks right"]},
        }
    }
    steps = [
        TaskSpec("scout", "find the parser"),
        TaskSpec("planner", "plan a fix for: {previous}"),
        TaskSpec("reviewer", "check this plan:\n{previous}"),
    ]
    outcome = go(scripted_runner(script), "chain", steps)

    assert outcome.ok and outcome.error is None and outcome.mode == "chain"
    assert [r.task for r in outcome.results] == [
        "find the parser",
        "plan a fix for: the parser is in src/parse.py",
        "check this plan:\n1. fix src/parse.py",
    ]
    assert [r.step_id for r in outcome.results] == ["1", "2", "3"]
    messages = read_transcript(Path(outcome.results[1].transcript)).messages
    assert messages[1] == {
        "role": "user",
        "content": task_text("plan a fix for: the parser is in src/parse.py", tmp_path),
    }


def test_chain_stops_at_the_first_failed_step(scripted_runner: Any) -> None:
    script = {
        "agents": {
            "scout": {"replies": ["found"]},
            "planner": {"replies": [call("ls", path="."), call("ls", path=".")]},
            "reviewer": {"replies": ["never"]},
        }
    }
    steps = [
        TaskSpec("scout", "a"),
        TaskSpec("planner", "b {previous}", max_turns=1),
        TaskSpec("reviewer", "c {previous}"),
    ]
    outcome = go(scripted_runner(script), "chain", steps)

    assert [(r.status, r.stop_reason) for r in outcome.results] == [
        ("completed", "completed"),
        ("failed", "max_turns"),
        ("failed", "skipped"),
    ]
    assert outcome.error == "Chain stopped at step 2: reached the limit of 1 turns without a final answer"
    assert outcome.results[2].error == "not run: step '2' did not complete"
    assert outcome.results[2].usage.turns == 0 and outcome.results[2].transcript is None
    assert (outcome.succeeded, outcome.total) == (1, 3)


def test_previous_in_the_first_step_is_refused(scripted_runner: Any) -> None:
    with pytest.raises(RequestError, match=r"step 1 uses \{previous\}"):
        go(scripted_runner(["x"]), "chain", [TaskSpec("scout", "do {previous}")])


# -- limits ---------------------------------------------------------------------------------------


def test_max_turns_max_tokens_and_timeout_each_name_their_limit(scripted_runner: Any) -> None:
    script = {"replies": [call("ls", path="."), call("ls", path="."), {"content": "late", "delay": 60}]}
    tasks = [
        TaskSpec("scout", "turns", label="turns", max_turns=2),
        TaskSpec("scout", "tokens", label="tokens", max_output_tokens=5),
        TaskSpec("scout", "time", label="time", timeout=0.3),
    ]
    started = time.perf_counter()
    outcome = go(scripted_runner(script), "parallel", tasks)

    assert time.perf_counter() - started < 30  # cut at the 0.3 s timeout, not after the 60 s reply (load slack)
    turns, tokens, timeout = outcome.results
    assert (turns.status, turns.stop_reason, turns.error) == (
        "failed",
        "max_turns",
        "reached the limit of 2 turns without a final answer",
    )
    assert (tokens.status, tokens.stop_reason, tokens.error) == (
        "failed",
        "max_tokens",
        "reached the limit of 5 generated tokens",
    )
    assert (timeout.status, timeout.stop_reason, timeout.error) == (
        "failed",
        "timeout",
        "stopped by the timeout of 0.3s",
    )
    assert timeout.usage.turns == 3  # what was done before the timeout is kept
    assert outcome.succeeded == 0


def test_runner_wide_limits_apply_to_every_task(scripted_runner: Any) -> None:
    script = {"replies": [{"content": "late", "delay": 5}]}
    outcome = go(scripted_runner(script, timeout=0.2), "parallel", [TaskSpec("scout", "a"), TaskSpec("planner", "b")])
    assert [r.stop_reason for r in outcome.results] == ["timeout", "timeout"]


def test_input_caps_are_checked_before_anything_starts(tmp_path: Path, write_script: Any, scripted_runner: Any) -> None:
    runner = scripted_runner(["done"])
    with pytest.raises(InputTooLargeError, match="task 'scout' is 20,001 characters, over the limit of 20,000"):
        go(runner, "run", TaskSpec("scout", "x" * 20_001))
    tasks = [TaskSpec("scout", "y" * 19_000) for _ in range(4)]
    with pytest.raises(
        InputTooLargeError, match=r"the whole request is 7\d,\d{3} characters .* over the limit of 60,000"
    ):
        go(runner, "parallel", tasks)
    agents = tmp_path / ".mlx-subagents" / "agents"
    agents.mkdir(parents=True)
    (agents / "verbose.md").write_text("---\nname: verbose\ndescription: talks\n---\n" + "z" * 8_001)
    # A user's agent file is checked against the model's context window, not a character cap.
    assert go(scripted_runner(["done"], assume_yes=True), "run", TaskSpec("verbose", "hi")).output == "done"
    # On a file, so that the run's context_window reaches the scripted host that `model` names.
    model = write_script(["done"], "small.json")
    runner = make_runner(tmp_path, model, assume_yes=True, context_window=2_048)
    with pytest.raises(
        InputTooLargeError,
        match=rf"agent 'verbose' has a system prompt and 9 tools of [\d,]+ tokens \([\d,]+ of them the prompt\), "
        rf"over half the context window of 2,048 tokens of {re.escape(model)}; shorten the body of "
        rf"{re.escape(str(agents / 'verbose.md'))} or grant it fewer tools",
    ):
        go(runner, "run", TaskSpec("verbose", "hi"))
    assert len(list(runs_dir().iterdir())) == 1  # the refused run never started


def test_the_prompt_fit_counts_the_tool_schemas(tmp_path: Path) -> None:
    """A system prompt of about 560 tokens fits half of a 2,048-token window, but with the schemas of its
    nine tools (its seven, and the task tools its `bash` brings for background commands: about 1,080
    more) it does not: refused before anything starts, not at its first turn."""
    agents = tmp_path / ".mlx-subagents" / "agents"
    agents.mkdir(parents=True)
    (agents / "medium.md").write_text("---\nname: medium\ndescription: has tools\n---\n" + "w " * 1_000)
    host = scripted_host({"replies": ["done"], "context_window": 2_048})
    runner = make_runner(tmp_path, host, assume_yes=True)
    with pytest.raises(InputTooLargeError) as refused:
        go(runner, "run", TaskSpec("medium", "hi"))
    numbers = re.search(r"and 9 tools of ([\d,]+) tokens \(([\d,]+) of them the prompt\)", str(refused.value))
    assert numbers is not None, str(refused.value)
    total, prompt = (int(n.replace(",", "")) for n in numbers.groups())
    assert prompt < 1_024 < total
    assert host.history == {}  # no turn was asked of the model


def test_a_long_answer_is_capped_and_kept_whole_in_the_transcript(scripted_runner: Any) -> None:
    answer = "é" * 40_000  # 80,000 bytes of UTF-8
    result = go(scripted_runner([answer]), "run", TaskSpec("scout", "a"))

    head, note = result.output.split("\n\n[answer truncated: ")
    # The answer and its note fill the cap; a 2-byte character that does not fit whole is left out.
    assert MAX_ANSWER_BYTES - 1 <= len(result.output.encode()) <= MAX_ANSWER_BYTES
    assert head == "é" * len(head)
    shown = len(head.encode())
    assert note == f"80,000 bytes, showing the first {shown:,}; the full text is in the transcript {result.transcript}]"
    assert read_transcript(Path(result.transcript)).results[-1].output == answer


def test_answers_and_pieces_are_cut_between_characters_by_one_rule() -> None:
    text = "aé€😀\udc80z"  # characters of 1, 2, 3 and 4 bytes, a lone surrogate (3 as written), 1
    heads = ["", "a", "a", "aé", "aé", "aé", "aé€", "aé€", "aé€", "aé€", "aé€😀", "aé€😀", "aé€😀"]
    assert [utf8_head(text, n) for n in range(-1, 16)] == ["", *heads, "aé€😀\udc80", text, text]
    # agent_output's pieces: the text from an offset in characters, and where the next piece starts.
    assert [window(text, 1, 5), window(text, 3, 7), window(text, 5, 7), window(text, 6, 7)] == [
        ("é€", 3),
        ("😀\udc80", 5),
        ("z", None),
        ("", None),
    ]
    # A capped answer keeps a lone surrogate too, so the offset to read on from counts it.
    capped = cap_answer("\udc80" + "é" * 60, None, 100, read_more="read on from {offset}")
    assert capped == "\udc80" + "é" * 13 + "\n\n[answer truncated: 123 bytes, showing the first 29; read on from 14]"


# -- cancellation ----------------------------------------------------------------------------------


def test_cancel_aborts_running_and_queued_tasks_and_keeps_what_was_done(scripted_runner: Any) -> None:
    script = {"replies": [call("ls", path="."), {"content": "never", "delay": 300}]}
    events: list[Event] = []
    runner = scripted_runner(script, events)

    async def second_turns() -> None:  # both running tasks wait in their 300 s reply: the ls turn is done
        while sum(e.kind == "turn_start" and e.turn == 2 for e in events) < 2:
            await asyncio.sleep(0.01)

    async def main() -> Any:
        async with runner:
            work = asyncio.create_task(runner.parallel([TaskSpec("scout", str(i)) for i in range(3)], concurrency=2))
            await asyncio.wait_for(second_turns(), 60)
            assert runner.cancel()
            return await work

    started = time.perf_counter()
    outcome = asyncio.run(main())

    assert time.perf_counter() - started < 60  # stopped at the cancel, not after the 300 s replies (load slack)
    assert outcome.interrupted and outcome.succeeded == 0
    assert [(r.status, r.stop_reason) for r in outcome.results] == [("aborted", "cancelled")] * 3
    assert [r.error for r in outcome.results] == [
        "aborted by the user (Ctrl-C)",
        "aborted by the user (Ctrl-C)",
        "aborted by the user (Ctrl-C) before it started",
    ]
    assert outcome.results[0].usage.turns == 2
    log = read_transcript(Path(outcome.results[0].transcript))
    assert log.results[-1].status == "aborted"
    assert [m["role"] for m in log.messages] == ["system", "user", "assistant", "tool"]
    assert runner.cancel() is False  # nothing is running any more


# -- structured output -------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"files": {"type": "array", "items": {"type": "string"}}},
    "required": ["files"],
}


def test_schema_retry_then_parsed(scripted_runner: Any) -> None:
    script = ["here you go: files a.py", '```json\n{"files": ["a.py"]}\n```']
    result = go(scripted_runner(script), "run", TaskSpec("scout", "list files", schema=SCHEMA))

    assert (result.status, result.parsed) == ("completed", {"files": ["a.py"]})
    messages = read_transcript(Path(result.transcript)).messages
    assert messages[1]["content"].startswith("Task: list files\n\nYour final answer")
    assert json.dumps(SCHEMA) in messages[1]["content"]
    assert messages[3]["content"].startswith(
        "Your final answer does not match the required JSON schema: the answer is not valid JSON: Expecting value"
    )


def test_schema_fails_clearly_after_one_retry(scripted_runner: Any) -> None:
    script = ['{"files": "a.py"}', '{"files": [1]}', "never asked"]
    result = go(scripted_runner(script), "run", TaskSpec("scout", "list files", schema=SCHEMA))

    assert (result.status, result.stop_reason, result.parsed) == ("failed", "schema", None)
    assert result.error == (
        "the final answer is not valid against the output schema after one retry: at $.files[0]: 1 is not of type 'string'"
    )
    assert result.usage.turns == 2


def test_an_agents_output_schema_applies(tmp_path: Path, scripted_runner: Any) -> None:
    agents = tmp_path / ".mlx-subagents" / "agents"
    agents.mkdir(parents=True)
    (agents / "counter.md").write_text(
        "---\nname: counter\ndescription: counts\ntools: ls\noutput_schema: {type: integer}\n---\nCount things.\n"
    )
    assert go(scripted_runner(["42"], assume_yes=True), "run", TaskSpec("counter", "count")).parsed == 42
    (agents / "counter.md").write_text(
        "---\nname: counter\ndescription: counts\noutput_schema: {type: 12}\n---\nCount things.\n"
    )
    with pytest.raises(SchemaFileError, match="output schema of task 'counter': not a valid JSON schema"):
        go(scripted_runner(["42"], assume_yes=True), "run", TaskSpec("counter", "count"))


# -- the tiny real model ---------------------------------------------------------------------------


@pytest.mark.slow
def test_parallel_on_the_tiny_real_model(tmp_path: Path, tiny_qwen3_path: Path, tiny_qwen3: Any) -> None:
    from mlx_subagents.testing.forced import ForcedScripts, tool_call_text

    (tmp_path / "app.py").write_text("print('hi')\n")
    scripts = ForcedScripts(
        tiny_qwen3[1],
        {
            "scout-1": [tool_call_text("ls", {"path": "."}), "app.py is the app"],
            "scout-2": ["nothing else"],
            "planner": ["1. edit app.py"],
        },
    )
    events: list[Event] = []
    runner = make_runner(tmp_path, str(tiny_qwen3_path), events, processor_factory=scripts)
    tasks = [TaskSpec("scout", "map"), TaskSpec("scout", "more"), TaskSpec("planner", "plan")]
    outcome = go(runner, "parallel", tasks, concurrency=2)

    assert [(r.label, r.status, r.output) for r in outcome.results] == [
        ("scout-1", "completed", "app.py is the app"),
        ("scout-2", "completed", "nothing else"),
        ("planner", "completed", "1. edit app.py"),
    ]
    assert outcome.results[0].usage.turns == 2 and outcome.results[0].usage.cached_tokens > 0
    assert max_running(events) == 2


def test_cancel_stops_a_tiny_real_model_generation_at_the_next_token(
    tmp_path: Path, tiny_qwen3_path: Path, tiny_qwen3: Any
) -> None:
    from mlx_subagents.testing.forced import ForcedScripts

    scripts = ForcedScripts(tiny_qwen3[1], {"scout": ["word " * 2000]})
    events: list[Event] = []
    runner = make_runner(tmp_path, str(tiny_qwen3_path), events, processor_factory=scripts)

    async def main() -> Any:
        async with runner:
            work = asyncio.create_task(runner.run(TaskSpec("scout", "talk")))
            while not any(e.kind == "text" for e in events):  # mid-reply: the first words are out
                await asyncio.sleep(0.01)
            runner.cancel()
            return await work

    result = asyncio.run(main())
    assert (result.status, result.stop_reason, result.error) == (
        "aborted",
        "cancelled",
        "aborted by the user (Ctrl-C); the output holds the reply it cut short",
    )
    # Counted in tokens, not seconds (a loaded machine slows the decode and the cancel alike): a few tokens
    # came before the cancel and at most the next one after it, against the 2,000 words of the whole reply.
    assert 0 < result.usage.output_tokens < 100
    assert ("word " * 2000).startswith(result.output)


def test_a_turn_cut_by_the_timeout_keeps_the_tokens_it_read(scripted_runner: Any) -> None:
    slow = scripted_runner({"replies": [{"content": "late", "delay": 5}]})
    quick = scripted_runner({"replies": ["late"]})

    [cut] = go(slow, "parallel", [TaskSpec("scout", "look", timeout=0.3)]).results
    [done] = go(quick, "parallel", [TaskSpec("scout", "look")]).results

    assert (cut.stop_reason, cut.usage.turns, cut.usage.output_tokens) == ("timeout", 1, 0)
    assert cut.usage.input_tokens == done.usage.input_tokens > 0  # the same prompt, read before the cut


def test_a_reopened_task_is_held_until_it_is_let_go(tmp_path: Path) -> None:
    """`reopen` holds the saved task (no other process continues it meanwhile) until `let_go`, not only
    until its runner closes; `let_go` was undocumented and left the hold in place."""
    from mlx_subagents.errors import TaskStateError

    script = {"agents": {"scout": {"replies": ["first", "second"]}}}

    async def main() -> tuple[str, str]:
        first = make_runner(tmp_path, scripted_host(script))
        other = make_runner(tmp_path, scripted_host(script))
        async with first, other:
            done = await first.run(TaskSpec("scout", "look"))
            task = await first.reopen(done.run_id or "")
            answer = (await task.ask("and then?")).output
            with pytest.raises(TaskStateError, match="is being continued elsewhere"):
                await other.reopen(done.run_id or "")
            await task.let_go("done with it")
            again = await other.reopen(done.run_id or "")
            return answer, (await again.ask("and at last?")).output

    # Each continuation is a new host session of its runner's own host: it replays from the first reply.
    assert asyncio.run(main()) == ("first", "first")
