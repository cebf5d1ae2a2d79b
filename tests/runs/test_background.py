"""Background tasks: `runner.start`, the `TaskHandle` (status, wait, cancel, send = steer or resume),
the `TaskBoard` (ids, the cap, notices), and the model-facing tools on a parent's children."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.errors import (
    AgentNotFoundError,
    InputTooLargeError,
    RequestError,
    TaskNotFoundError,
    TaskStateError,
)
from mlx_subagents.events import Event
from mlx_subagents.runs.tasks import TaskSpec
from mlx_subagents.runs.transcripts import child_runs, load_run, read_transcript
from tests.helpers import SLOW, alive, all_dead, call, make_runner, run_parent, scripted_host, task_text, write_agent


def user_texts(messages: list[dict[str, Any]]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


# -- the runner API ---------------------------------------------------------------------------------


def test_start_returns_at_once_with_predictable_ids_and_wait_gives_the_result(
    tmp_path: Path, scripted_runner: Any
) -> None:
    (tmp_path / "app.py").write_text("print('hi')\n")
    script = {"agents": {"scout": {"replies": [{"content": "found app.py", "delay": 0.3}]}}}
    runner = scripted_runner(script)

    notices: list[Any] = []

    async def main() -> Any:
        async with runner:
            runner.board.on_notice = notices.append
            first = await runner.start(TaskSpec("scout", "find the app"))
            second = await runner.start(TaskSpec("scout", "find it again"))
            named = await runner.start(TaskSpec("Scout", "and once more", label="third"))
            states = [h.status for h in (first, second, named)]
            assert await first.wait(timeout=0.01) is None  # still running at the timeout
            results = [await h.wait() for h in (first, second, named)]
            return first, second, named, states, results

    first, second, named, states, results = asyncio.run(main())
    assert [h.id for h in (first, second, named)] == ["scout#1", "scout#2", "third"]
    assert set(states) <= {"queued", "running"}
    assert [(r.status, r.output) for r in results] == [("completed", "found app.py")] * 3
    snap = first.snapshot()
    assert (snap.id, snap.agent, snap.status, snap.turn, snap.output) == (
        "scout#1",
        "scout",
        "completed",
        1,
        "found app.py",
    )
    assert snap.run_id == first.run_id and snap.elapsed_s >= 0.3
    assert sorted((n.id, n.status, n.output) for n in notices) == [
        ("scout#1", "completed", "found app.py"),
        ("scout#2", "completed", "found app.py"),
        ("third", "completed", "found app.py"),
    ]
    record = load_run(first.run_id)
    assert [(t.label, t.status) for t in record.tasks] == [("scout#1", "completed")]
    assert read_transcript(record.transcript_path(record.tasks[0])).messages[1]["content"] == task_text(
        "find the app", tmp_path
    )


def test_start_checks_everything_before_it_returns(scripted_runner: Any) -> None:
    runner = scripted_runner(["x"])

    async def main() -> None:
        async with runner:
            with pytest.raises(AgentNotFoundError, match="unknown agent 'nobody'; available: orchestrator, "):
                await runner.start(TaskSpec("nobody", "x"))
            with pytest.raises(InputTooLargeError, match="task 'scout#1' is 30,000 characters, over the limit"):
                await runner.start(TaskSpec("scout", "x" * 30_000))
            await runner.start(TaskSpec("scout", "x", label="a"))
            with pytest.raises(RequestError, match="a task named 'a' was already started here"):
                await runner.start(TaskSpec("scout", "y", label="a"))
            with pytest.raises(TaskNotFoundError, match="no task 'scout#9' here; the tasks started here are: a"):
                runner.board.get("scout#9")

    asyncio.run(main())


def test_a_message_reaches_a_running_task_at_its_next_turn(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text("print('hi')\n")
    host = scripted_host(
        {"agents": {"scout": {"replies": [{**call("ls", path="."), "delay": 0.4}, "done, and I checked tests too"]}}}
    )
    events: list[Event] = []
    runner = make_runner(tmp_path, host, events)

    async def main() -> Any:
        async with runner:
            handle = await runner.start(TaskSpec("scout", "list the files"))
            while handle.status != "running":
                await asyncio.sleep(0.01)
            handle.send("also look at the tests")
            result = await handle.wait()
            return handle, result, host.history["scout#1"]

    handle, result, history = asyncio.run(main())
    assert result.output == "done, and I checked tests too"
    # The first turn did not see it; the second got it after the ls result, as a user message.
    assert user_texts(history[0]) == [task_text("list the files", tmp_path)]
    assert [m["role"] for m in history[1]][-3:] == ["assistant", "tool", "user"]
    assert history[1][-1]["content"] == "also look at the tests"
    log = read_transcript(Path(result.transcript))
    kinds = [(r["type"], r.get("kind")) for r in log.records if r["type"] != "task"]
    at = kinds.index(("task_send", "task_send"))
    assert kinds[at - 1] == ("event", "tool_result") and kinds[at + 1] == ("event", "turn_start")
    assert [e.data["message"] for e in events if e.kind == "task_send"] == ["also look at the tests"]


def test_a_message_to_a_finished_task_resumes_it(tmp_path: Path) -> None:
    host = scripted_host({"agents": {"scout": {"replies": ["first answer", "second answer"]}}})
    runner = make_runner(tmp_path, host)

    async def main() -> Any:
        async with runner:
            handle = await runner.start(TaskSpec("scout", "look"))
            first = await handle.wait()
            handle.send("and now?")
            assert handle.status in ("queued", "running")
            second = await handle.wait()
            return handle, first, second, host.history["scout#1"]

    handle, first, second, history = asyncio.run(main())
    assert (first.output, second.output) == ("first answer", "second answer")
    assert user_texts(history[1]) == [task_text("look", tmp_path), "and now?"]
    assert handle.generations == 2
    log = read_transcript(Path(second.transcript))
    assert [r.output for r in log.results] == ["first answer", "second answer"]
    assert [r["data"]["message"] for r in log.records if r["type"] == "task_send"] == ["and now?"]


def test_cancel_aborts_a_task_and_a_message_to_it_is_refused(scripted_runner: Any) -> None:
    script = {"agents": {"scout": {"replies": [{"content": "never", "delay": 30}]}}}
    runner = scripted_runner(script)

    async def main() -> Any:
        async with runner:
            handle = await runner.start(TaskSpec("scout", "look"))
            while handle.status != "running":
                await asyncio.sleep(0.01)
            assert handle.cancel() is True
            result = await asyncio.wait_for(handle.wait(), 20)  # a bound, well under the reply's 30 s
            with pytest.raises(TaskStateError, match="task 'scout#1' was cancelled \\(cancelled\\) and takes no more"):
                handle.send("more")
            return handle, result

    handle, result = asyncio.run(main())
    assert (result.status, result.stop_reason, result.error) == ("aborted", "cancelled", "cancelled")
    assert handle.status == "aborted" and handle.cancel() is False
    record = load_run(handle.run_id)
    assert (record.status, record.tasks[0].status) == ("interrupted", "aborted")


def test_closing_the_runner_cancels_what_still_runs(scripted_runner: Any) -> None:
    script = {"agents": {"scout": {"replies": [{"content": "never", "delay": 30}]}}}
    runner = scripted_runner(script)

    async def main() -> Any:
        async with runner:
            running = await runner.start(TaskSpec("scout", "look"))
            while running.status != "running":
                await asyncio.sleep(0.01)
            return running, await runner.start(TaskSpec("scout", "look again"))

    running, queued = asyncio.run(asyncio.wait_for(main(), 20))  # a bound, well under the reply's 30 s
    assert (running.status, running.result.error) == ("aborted", "the runner closed")
    assert (queued.status, queued.result.error) == ("aborted", "the runner closed before it started")
    assert load_run(running.run_id).status == "interrupted"


# -- a parent agent and its background children (the model-facing tools) ------------------------------


def bg(**arguments: Any) -> dict[str, Any]:
    return call("subagent", background=True, **arguments)


def tool_messages(result: Any) -> list[str]:
    return [m["content"] for m in read_transcript(Path(result.transcript)).messages if m["role"] == "tool"]


@pytest.mark.slow
def test_a_parent_works_while_two_children_run_then_gets_one_notice_with_both_answers(
    tmp_path: Path, scripted_runner: Any
) -> None:
    (tmp_path / "notes.txt").write_text("remember the tests\n")
    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    bg(tasks=[{"agent": "scout", "task": "map auth"}, {"agent": "planner", "task": "plan it"}]),
                    call("read", path="notes.txt"),
                    "Waiting for the scout and the planner.",
                    "Auth is in auth.py; the plan has two steps.",
                ]
            },
            "scout": {"replies": [{"content": "auth is in auth.py\nmore detail", "delay": 0.6}]},
            "planner": {"replies": [{"content": "1. test 2. fix", "delay": 1.5}]},
        }
    }
    events: list[Event] = []
    runner = scripted_runner(script, events)
    result = run_parent(runner)

    assert (result.status, result.output) == ("completed", "Auth is in auth.py; the plan has two steps.")
    assert result.usage.turns == 4  # the call, the read, the answer while they ran, the answer on their notice
    started, read = tool_messages(result)
    assert started.startswith(
        "Started in the background: scout#1, planner#1. Carry on with other work; one notice with all their "
        "answers comes when the last ends."
    )
    assert read == "     1\tremember the tests"  # read while the children ran
    messages = read_transcript(Path(result.transcript)).messages
    notice = (
        "[notice] scout#1, planner#1 ended (2/2 completed):\nParallel: 2/2 tasks completed\n\n"
        "### [scout#1] completed\nauth is in auth.py\nmore detail\n\n### [planner#1] completed\n1. test 2. fix"
        "\n\n[task_send continues scout#1, planner#1]"
    )
    assert [m["content"] for m in messages if m["role"] == "user"][1:] == [notice]
    # It came right after the answer the parent gave while they ran, once the last had ended.
    at = next(i for i, m in enumerate(messages) if m["content"] == notice)
    assert messages[at - 1]["content"] == "Waiting for the scout and the planner."
    [event] = [e for e in events if e.kind == "task_notice"]
    assert (event.label, event.data["id"], event.data["status"], event.data["first_line"]) == (
        "orchestrator",
        "scout#1, planner#1",
        "completed",
        "Parallel: 2/2 tasks completed",
    )
    assert event.data["text"] == notice.removeprefix("[notice] ")
    log = read_transcript(Path(result.transcript))
    assert [r["data"]["id"] for r in log.records if r["type"] == "task_notice"] == ["scout#1, planner#1"]
    # The children are saved inside the parent's run, one run each, under their ids.
    children = sorted(t.label for c in child_runs(load_run(result.run_id)) for t in c.tasks)
    assert children == ["orchestrator > planner#1", "orchestrator > scout#1"]


def test_notify_each_gives_a_notice_per_end_and_an_answer_read_is_not_repeated(scripted_runner: Any) -> None:
    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    bg(tasks=[{"agent": "scout", "task": "a"}, {"agent": "planner", "task": "b"}], notify="each"),
                    "Waiting for both.",
                    "Waiting for the planner.",
                    bg(tasks=[{"agent": "scout", "task": "c", "label": "fast"}, {"agent": "planner", "task": "d"}]),
                    call("task_output", id="fast", wait=30),
                    "Waiting again.",
                    "Done.",
                ]
            },
            "scout": {"replies": [{"content": "scouted", "delay": 0.2}]},
            "planner": {"replies": [{"content": "planned", "delay": 1.2}]},
        }
    }
    result = run_parent(scripted_runner(script))

    assert (result.status, result.output) == ("completed", "Done.")
    notices = [m["content"] for m in read_transcript(Path(result.transcript)).messages if m["role"] == "user"][1:]
    assert notices == [
        "[notice] scout#1 completed:\nscouted\n\n[task_send continues scout#1]",
        "[notice] planner#1 completed:\nplanned\n\n[task_send continues planner#1]",
        "[notice] fast, planner#2 ended (2/2 completed):\nParallel: 2/2 tasks completed\n\n"
        "### [fast] completed\n(already read with task_output)\n\n### [planner#2] completed\nplanned\n\n"
        "[task_send continues fast, planner#2]",
    ]


def test_a_parent_that_answered_never_fails_because_a_child_ended_after_it(scripted_runner: Any) -> None:
    """With no turn left after its answer, the parent waits for its children and ends with that answer;
    with a turn left, it reads their notice, and a limit after that still ends it with its answer."""
    last_turn = {
        "agents": {
            "orchestrator": {"replies": [bg(agent="scout", task="look"), "Started the scout; it will report."]},
            "scout": {"replies": [{"content": "found it", "delay": 0.5}]},
        }
    }
    result = run_parent(scripted_runner(last_turn, max_turns=2))
    assert (result.status, result.output, result.usage.turns) == ("completed", "Started the scout; it will report.", 2)
    [child] = result.children.tasks
    assert (child.label, child.status) == ("orchestrator > scout#1", "completed")  # not cut short by its end

    limit_after = {
        "agents": {
            "orchestrator": {"replies": [bg(agent="scout", task="look"), "It is looking.", call("ls", path=".")]},
            "scout": {"replies": [{"content": "found it", "delay": 0.3}]},
        }
    }
    result = run_parent(scripted_runner(limit_after, max_turns=3))
    assert (result.status, result.stop_reason, result.output) == ("completed", "completed", "It is looking.")


@pytest.mark.slow
def test_a_parent_steers_and_cancels_its_children_and_errors_are_results(tmp_path: Path, scripted_runner: Any) -> None:
    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    bg(agent="scout", task="map auth"),
                    call("task_send", id="scout#1", message="look in middleware/ too"),
                    call("task_output", id="scout#1", wait=1),
                    call("task_status"),
                    call("task_cancel", id="scout#1"),
                    call("task_send", id="scout#1", message="are you there?"),
                    call("task_output", id="scout#1", wait=1000),
                    call("task_output", id="scout#7"),
                    call("task_cancel", id="scout#1"),
                    "Gave up on the scout.",
                ]
            },
            "scout": {
                "replies": [
                    {"content": "Looking around.", **call("ls", path="."), "delay": 0.5},
                    {"content": "never", "delay": 30},
                ]
            },
        }
    }
    runner = scripted_runner(script)
    result = run_parent(runner)

    assert result.output == "Gave up on the scout."
    started, sent, partial, status, cancelled, refused, too_long, unknown, again = tool_messages(result)
    assert sent == "scout#1 gets the message at its next turn"
    assert partial.startswith("scout#1 (scout) running: turn 2, ")
    assert partial.endswith(
        ", last: ls .\nIt has not finished; its output so far:\nLooking around.\n\n[call task_output again with "
        "wait (up to 300 s), steer it with task_send, or stop it with task_cancel]"
    )
    assert status.startswith("scout#1 (scout) running: turn 2, ")
    assert cancelled == "scout#1 is being cancelled; task_output shows what it had done"
    assert refused == (
        "Error: task 'scout#1' was cancelled (cancelled by its parent) and takes no more messages; its output so "
        "far can still be read, or start a new task"
    )
    assert too_long.startswith("Error: wait is at most 300 seconds, got 1000; wait 300 and call again")
    assert unknown == "Error: no task 'scout#7' here; the tasks started here are: scout#1"
    assert again == (
        "Error: task 'scout#1' is already cancelled (cancelled by its parent); task_output shows what it had done"
    )
    child = child_runs(load_run(result.run_id))[0]
    log = read_transcript(child.transcript_path(child.tasks[0]))
    kinds = [r["type"] for r in log.records if r["type"] in ("task_send", "task_cancel", "result")]
    assert kinds == ["task_send", "task_cancel", "result"]
    assert log.results[-1].error == "cancelled by its parent"
    assert [m["content"] for m in log.messages if m["role"] == "user"] == [
        task_text("map auth", tmp_path),
        "look in middleware/ too",
    ]


async def wait_for_pids(folder: Path) -> list[int]:
    for _ in range(600):
        if (folder / "sleep.pid").is_file() and (folder / "sleep.pid").read_text().strip():
            # bash writes its files before the tool has registered its process group (see test_chat)
            await asyncio.sleep(0.3)
            return [int((folder / name).read_text()) for name in ("bash.pid", "sleep.pid")]
        await asyncio.sleep(0.05)
    raise AssertionError("the bash command never started")


def test_cancelling_a_child_mid_bash_kills_its_processes_and_the_parent_carries_on(
    tmp_path: Path, scripted_runner: Any
) -> None:
    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    bg(agent="worker", task="run the slow check"),
                    call("task_output", id="worker#1", wait=60),
                    "The check was cancelled.",
                ]
            },
            "worker": {"replies": [call("bash", command=SLOW), "never"]},
        }
    }
    events: list[Event] = []
    runner = scripted_runner(script, events)

    async def main() -> Any:
        async with runner:
            parent = await runner.start(TaskSpec("orchestrator", "check"))
            pids = await wait_for_pids(tmp_path)
            assert all(alive(p) for p in pids)
            child = parent.board.get("worker#1")
            assert child.status == "running" and child.snapshot().last_tool == f"$ {SLOW}"
            assert child.cancel("stopped by the user") is True
            return pids, child, await parent.wait(timeout=30)

    pids, child, result = asyncio.run(main())
    assert all_dead(pids), "a process of the cancelled child's bash call outlived it"
    assert (child.status, child.result.error) == ("aborted", "stopped by the user")
    assert (result.status, result.output) == ("completed", "The check was cancelled.")
    assert tool_messages(result)[1] == "worker#1 aborted: stopped by the user\n\n(no answer)"
    cancels = [e for e in events if e.kind == "task_cancel"]
    assert [(e.label, e.data) for e in cancels] == [("orchestrator#1 > worker#1", {"reason": "stopped by the user"})]


def test_at_most_8_alive_per_parent_4_running_and_a_cancelled_parent_cancels_its_children(scripted_runner: Any) -> None:
    eight = [{"agent": "scout", "task": f"look {i}"} for i in range(8)]
    script = {
        "agents": {
            "orchestrator": {"replies": [bg(tasks=eight), bg(agent="scout", task="one more"), "Waiting."]},
            "scout": {"replies": [{"content": "never", "delay": 30}]},
        }
    }
    runner = scripted_runner(script)

    async def main() -> Any:
        async with runner:
            parent = await runner.start(TaskSpec("orchestrator", "look everywhere"))
            while parent.snapshot().output != "Waiting.":  # its final answer: it waits for its children
                await asyncio.sleep(0.02)
            children = parent.board.tasks()
            while sum(c.status == "running" for c in children) < 4:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            states = sorted(c.status for c in children)
            parent.cancel()
            await parent.wait(timeout=10)
            for child in children:
                await child.wait(timeout=10)
            return parent, children, states

    parent, children, states = asyncio.run(main())
    assert [c.id for c in children] == [f"scout#{i}" for i in range(1, 9)]
    assert states == ["queued"] * 4 + ["running"] * 4  # the waiting parent lends its slot
    refused = tool_messages(parent.result)[1]
    assert refused == (
        "Error: subagent call refused: 8 background tasks are alive here (scout#1, scout#2, scout#3, scout#4, "
        "scout#5, scout#6, scout#7, scout#8) and the limit is 8; wait for one to end (task_output with wait) "
        "or cancel one (task_cancel)"
    )
    # Stopped by their parent's cancel, they say so (not a Ctrl-C, not merely that it ended).
    stopped = "its parent task 'orchestrator#1' was stopped: cancelled"
    assert {c.result.error for c in children[:4]} == {stopped}
    assert {c.result.error for c in children[4:]} == {f"{stopped} before it started"}


def test_the_depth_limit_holds_for_background_children(tmp_path: Path, scripted_runner: Any) -> None:
    write_agent(tmp_path, "lead", "read, subagent")
    # Parent and child are both `lead`: each replays the same script from its first reply.
    script = {
        "agents": {
            "lead": {"replies": [bg(agent="lead", task="nested"), call("task_output", id="lead#1", wait=10), "done"]}
        }
    }
    runner = scripted_runner(script, max_depth=1, assume_yes=True)
    result = run_parent(runner, agent="lead")

    assert tool_messages(result) == [tool_messages(result)[0], "lead#1 completed\n\ndone"]
    child = child_runs(load_run(result.run_id))[0]
    child_log = read_transcript(child.transcript_path(child.tasks[0]))
    assert [m["content"] for m in child_log.messages if m["role"] == "tool"] == [
        "Error: delegation refused: this agent already runs at depth 1 and the limit is 1 (max_depth); do the task "
        "yourself with your other tools",
        "Error: unknown tool 'task_output'; available tools: read, parent_send",  # at the limit, no task tools
    ]


# -- the tiny real model --------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_message_to_a_finished_child_resumes_it_on_its_kv_cache(
    tmp_path: Path, tiny_qwen3_path: Path, tiny_qwen3: Any
) -> None:
    from mlx_subagents.testing import ForcedScripts

    scripts = ForcedScripts(tiny_qwen3[1], {"scout#1": ["app.py is the only file", "no tests"]})
    runner = make_runner(tmp_path, str(tiny_qwen3_path), processor_factory=scripts)

    async def main() -> Any:
        async with runner:
            handle = await runner.start(TaskSpec("scout", "list the files"))
            first = await handle.wait()
            handle.send("and the tests?")
            return first, await handle.wait()

    first, second = asyncio.run(main())
    assert (first.output, second.output) == ("app.py is the only file", "no tests")
    assert first.usage.cached_tokens == 0
    n_prompt = second.usage.input_tokens - first.usage.input_tokens
    n_cached = second.usage.cached_tokens - first.usage.cached_tokens
    n_message = len(tiny_qwen3[1].encode("and the tests?"))
    # The second generation reads the whole first conversation from the session's cache and
    # prefills only the new user message and the template's markers around it.
    assert n_cached == first.usage.input_tokens + first.usage.output_tokens
    assert n_message <= n_prompt - n_cached <= n_message + 12


@pytest.mark.slow
def test_a_forced_parent_starts_a_background_child_and_reads_its_answer_on_the_tiny_model(
    forced_orchestrator: Any,
) -> None:
    from mlx_subagents.testing import tool_call_text

    replies = {
        "orchestrator": [
            tool_call_text("subagent", {"agent": "scout", "task": "list the files", "background": True}),
            tool_call_text("task_output", {"id": "scout#1", "wait": 60}),
            "The scout found app.py.",
        ],
        "orchestrator > scout#1": [tool_call_text("ls", {"path": "."}), "app.py is the only file"],
    }
    # The orchestrator's prompt and tools take about 4,400 of the tiny tokenizer's tokens: over half of 8,192.
    result, scripts = forced_orchestrator(replies, context_window=16384)

    assert (result.status, result.output) == ("completed", "The scout found app.py.")
    started, output = tool_messages(result)
    assert started.startswith("Started in the background: scout#1. ")
    assert output == "scout#1 completed\n\napp.py is the only file"
    assert scripts.remaining("orchestrator") == scripts.remaining("orchestrator > scout#1") == 0
    child = child_runs(load_run(result.run_id))[0]
    assert read_transcript(child.transcript_path(child.tasks[0])).results[-1].usage.cached_tokens > 0


def test_three_background_scouts_cost_the_parent_one_turn_more_on_the_tiny_model(forced_orchestrator: Any) -> None:
    """Their answers come in one notice once the last has ended: the parent's turns are the call, the
    answer it gives while they run and the answer on their notice (a notice per end, each read with
    task_output, took six turns more)."""
    from mlx_subagents.testing import tool_call_text

    scouts = [{"agent": "scout", "task": f"look at part {n}"} for n in (1, 2, 3)]
    replies = {
        "orchestrator": [
            tool_call_text("subagent", {"tasks": scouts, "background": True}),
            "The scouts are looking.",
            "Parts 1, 2 and 3 are mapped.",
        ],
        **{f"orchestrator > scout#{n}": [f"part {n} is in p{n}.py"] for n in (1, 2, 3)},
    }
    result, scripts = forced_orchestrator(replies, context_window=16384)

    assert (result.status, result.output, result.usage.turns) == ("completed", "Parts 1, 2 and 3 are mapped.", 3)
    assert [scripts.remaining(name) for name in replies] == [0, 0, 0, 0]
    messages = read_transcript(Path(result.transcript)).messages
    [notice] = [m["content"] for m in messages if m["role"] == "user"][1:]
    assert notice.startswith("[notice] scout#1, scout#2, scout#3 ended (3/3 completed):\nParallel: 3/3 tasks")
    for n in (1, 2, 3):
        assert f"### [scout#{n}] completed\npart {n} is in p{n}.py" in notice
    assert [m["role"] for m in messages[-3:]] == ["assistant", "user", "assistant"]  # answer, notice, answer


# -- records: --events and `subagent show` ----------------------------------------------------------


@pytest.mark.slow
def test_run_events_and_show_record_sends_and_notices_in_order(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    import json

    model = write_script(
        {
            "agents": {
                "orchestrator": {
                    "replies": [
                        bg(agent="scout", task="map auth"),
                        call("task_send", id="scout#1", message="also the tests"),
                        "Waiting.",
                        call("task_output", id="scout#1"),
                        "Done: auth.py, tested.",
                    ]
                },
                "scout": {
                    "replies": [{"content": "Looking.", **call("ls", path="."), "delay": 0.6}, "auth.py, tested"]
                },
            }
        }
    )
    code, out, err = run_cli("run", "orchestrator", "go", "-m", model, "-C", str(tmp_path), "--events")

    assert code == 0, err
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    notes = [
        (e["kind"], e["label"], e["data"].get("message") or e["data"].get("text"))
        for e in events
        if e["kind"] in ("task_send", "task_notice")
    ]
    assert notes == [
        ("task_send", "orchestrator > scout#1", "also the tests"),
        ("task_notice", "orchestrator", "scout#1 completed:\nauth.py, tested\n\n[task_send continues scout#1]"),
    ]
    parent = load_run("last")
    code, shown, _ = run_cli("show", parent.run_id)
    assert code == 0
    assert "notice (generation 1, turn 3): scout#1 completed:\n" in shown
    assert shown.index("user: [notice] scout#1 completed") < shown.index("assistant: Done: auth.py, tested.")
    child = child_runs(parent)[0]
    code, shown, _ = run_cli("show", child.run_id)
    assert "message sent (generation 1, turn 1): also the tests" in shown
    assert shown.index("user: Task: map auth") < shown.index("user: also the tests") < shown.index("auth.py, tested")


@pytest.mark.slow
def test_a_background_chain_runs_its_steps_in_order_under_their_own_ids(tmp_path: Path, scripted_runner: Any) -> None:
    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    bg(
                        chain=[
                            {"agent": "scout", "task": "find the parser"},
                            {"agent": "planner", "task": "plan: {previous}"},
                        ]
                    ),
                    call("task_status"),
                    "Waiting.",
                    "The plan is ready.",
                ]
            },
            "scout": {"replies": [{"content": "the parser is in p.py", "delay": 0.5}]},
            "planner": {"replies": [{"content": "1. read p.py", "delay": 0.2}]},
        }
    }
    runner = scripted_runner(script)
    result = run_parent(runner)

    assert result.output == "The plan is ready."
    started, status = tool_messages(result)
    assert started.startswith("Started in the background: scout#1, planner#1. ")
    assert status.splitlines()[1].startswith("planner#1 (planner) queued: turn 0, 0 tokens")  # waits for step 1
    notice = [m["content"] for m in read_transcript(Path(result.transcript)).messages if m["role"] == "user"][-1]
    # As the chain would have answered in the foreground: its last step's answer.
    assert notice == (
        "[notice] scout#1, planner#1 ended (2/2 completed):\n1. read p.py\n\n[task_send continues scout#1, planner#1]"
    )
    planner = next(c for c in child_runs(load_run(result.run_id)) if c.tasks[0].agent == "planner")
    log = read_transcript(planner.transcript_path(planner.tasks[0]))
    assert log.messages[1]["content"] == task_text("plan: the parser is in p.py", tmp_path)


def test_a_cut_answer_of_a_foreground_child_is_read_on_with_task_output(scripted_runner: Any) -> None:
    from mlx_subagents.caps import cap_answer
    from mlx_subagents.tools.delegation import READ_MORE

    answer = "".join(f"{i:05d}\n" for i in range(10_000))  # 60,000 characters, over the 50 KiB cap
    shown = cap_answer(answer, None, read_more=READ_MORE.format(id="scout#1"))
    offset = len(shown.split("\n\n[answer truncated")[0])
    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    call("subagent", agent="scout", task="list everything"),
                    call("task_output", id="scout#1", offset=offset),
                    "Read it all.",
                ]
            },
            "scout": {"replies": [answer]},
        }
    }
    result = run_parent(scripted_runner(script))

    first, rest = tool_messages(result)
    assert first.startswith(answer[:offset])
    assert first.endswith(
        f'showing the first {offset:,}; read the rest with task_output {{"id": "scout#1", "offset": {offset}}}]'
        f"\n\n[sub-agent run {child_runs(load_run(result.run_id))[0].run_id}; task_send continues scout#1]"
    )
    assert "transcript" not in first  # never a path the parent's tools refuse
    assert rest == f"scout#1 completed (from character {offset})\n\n{answer[offset:]}"


def test_a_foreground_child_is_continued_with_task_send_on_its_own_session(
    tmp_path: Path, scripted_runner: Any
) -> None:
    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    call("subagent", agent="scout", task="find the app"),
                    call("task_send", id="scout#1", message="and run the tests"),
                    call("task_output", id="scout#1", wait=30),
                    "app.py, untested.",
                ]
            },
            "scout": {"replies": ["app.py:1", call("bash", command="touch ran.txt"), "no tests ran"]},
        }
    }
    runner = scripted_runner(script)
    result = run_parent(runner)

    assert result.output == "app.py, untested."
    [child] = child_runs(load_run(result.run_id))
    found, sent, output = tool_messages(result)
    assert found == f"app.py:1\n\n[sub-agent run {child.run_id}; task_send continues scout#1]"
    assert sent == "scout#1 had ended: it continues its conversation with the message, in the background"
    assert output == "scout#1 completed\n\nno tests ran"
    log = read_transcript(child.transcript_path(child.tasks[0]))
    assert log.generations == 2
    assert user_texts(log.messages) == [task_text("find the app", tmp_path), "and run the tests"]
    # Its parent withheld bash (the orchestrator has none): the continued scout still lacks it.
    refusal = [m["content"] for m in log.messages if m["role"] == "tool"]
    assert refusal == [log.meta["denied"]["bash"]] and not (runner.cwd / "ran.txt").exists()
    # One host session, held across both generations: the second prompt starts with the first conversation.
    [host] = runner.preparer.hosts.values()
    first, *later = host.history["orchestrator > scout#1"]
    assert len(later) == 2 and later[0][: len(first) + 1] == [*first, {"role": "assistant", "content": "app.py:1"}]


def test_task_send_with_wait_returns_the_continued_childs_answer_in_the_same_call(scripted_runner: Any) -> None:
    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    call("subagent", agent="scout", task="find the app"),
                    call("task_send", id="scout#1", message="and where is it tested?", wait=30),
                    bg(agent="planner", task="plan it"),
                    call("task_send", id="planner#1", message="keep it short", wait=30),
                    call("task_send", id="planner#1", message="again", wait=301),
                    "app.py, tested in test_app.py; plan: one step.",
                ]
            },
            "scout": {"replies": ["app.py:1", "test_app.py:3"]},
            "planner": {"replies": [{"content": "Planning.", **call("ls", path="."), "delay": 0.3}, "1. one step"]},
        }
    }
    events: list[Event] = []
    result = run_parent(scripted_runner(script, events))

    assert (result.status, result.usage.turns) == ("completed", 6)
    _, continued, _, steered, over = tool_messages(result)
    assert continued == "scout#1 completed\n\ntest_app.py:3"  # an ended child, continued and waited for
    assert steered == "planner#1 completed\n\n1. one step"  # a running one: the message at its next turn
    assert over == (
        "Error: wait is at most 300 seconds, got 301; wait 300 and call again with task_output, once it has read "
        "the message"
    )
    # Read in the call: no notice repeats either answer to the parent.
    assert not [m for m in user_texts(read_transcript(Path(result.transcript)).messages) if "[notice]" in m]


def test_the_oldest_foreground_conversations_are_let_go_and_a_message_to_one_is_refused(
    scripted_runner: Any,
) -> None:
    from mlx_subagents.runs.board import MAX_HELD

    eight = [{"agent": "scout", "task": f"look {n}"} for n in range(MAX_HELD)]
    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    call("subagent", tasks=eight),
                    call("subagent", agent="scout", task="one more"),
                    call("task_send", id="scout#1", message="and again"),
                    "done",
                ]
            },
            "scout": {"replies": ["seen"]},
        }
    }
    result = run_parent(scripted_runner(script))

    parallel, ninth, refused = tool_messages(result)
    assert parallel.endswith(f"; task_send continues {', '.join(f'scout#{n}' for n in range(1, 9))}]")
    assert ninth.endswith("; task_send continues scout#9]")
    assert refused == (
        "Error: task 'scout#1' ran in the foreground and its conversation was let go to make room (a parent holds "
        f"the conversations of its last {MAX_HELD} foreground children); its answer can be read, `subagent resume "
        f"{child_runs(load_run(result.run_id))[0].run_id}` continues it, or start a new task"
    )


def test_a_message_that_arrives_as_the_task_ends_starts_a_new_generation(tmp_path: Path, scripted_runner: Any) -> None:
    script = {"agents": {"scout": {"replies": ["first answer", "answer to the late message"]}}}
    handles: list[Any] = []

    def sink(event: Event) -> None:
        # The task has given its answer and is ending: too late for its last turn.
        if event.kind == "task_end" and event.label == "scout#1" and handles[0].generations == 1:
            handles[0].send("one more thing")

    runner = scripted_runner(script, sink)

    async def main() -> Any:
        async with runner:
            handles.append(await runner.start(TaskSpec("scout", "look")))
            return await handles[0].wait()

    result = asyncio.run(main())
    assert result.output == "answer to the late message"
    log = read_transcript(Path(result.transcript))
    assert [r.output for r in log.results] == ["first answer", "answer to the late message"]
    assert [m["content"] for m in log.messages if m["role"] == "user"] == [
        task_text("look", tmp_path),
        "one more thing",
    ]
    assert [(r["generation"], r["data"]["message"]) for r in log.records if r["type"] == "task_send"] == [
        (2, "one more thing")
    ]


def test_a_steer_message_reaches_a_forced_child_between_its_tool_result_and_next_turn(
    tmp_path: Path, tiny_qwen3_path: Path, tiny_qwen3: Any
) -> None:
    from mlx_subagents.testing import ForcedScripts, tool_call_text

    (tmp_path / "app.py").write_text("print('hi')\n")
    scripts = ForcedScripts(tiny_qwen3[1], {"scout#1": [tool_call_text("ls", {"path": "."}), "app.py, no tests"]})
    handles: list[Any] = []

    def sink(event: Event) -> None:
        if event.kind == "tool_call" and event.label == "scout#1":  # mid tool call: it must wait for the result
            handles[0].send("also look for tests")

    runner = make_runner(tmp_path, str(tiny_qwen3_path), sink, processor_factory=scripts)

    async def main() -> Any:
        async with runner:
            handles.append(await runner.start(TaskSpec("scout", "list the files")))
            return await handles[0].wait()

    result = asyncio.run(main())
    assert (result.status, result.output) == ("completed", "app.py, no tests")
    messages = read_transcript(Path(result.transcript)).messages
    assert [(m["role"], m.get("content")) for m in messages[3:]] == [
        ("tool", "app.py"),
        ("user", "also look for tests"),
        ("assistant", "app.py, no tests"),
    ]
    assert result.usage.turns == 2 and result.usage.cached_tokens > 0  # the second turn reused the first's cache


def test_two_background_calls_in_one_reply_get_their_own_ids(scripted_runner: Any) -> None:
    two = {
        "tool_calls": [
            {"name": "subagent", "arguments": {"agent": "scout", "task": "map auth", "background": True}},
            {"name": "subagent", "arguments": {"agent": "scout", "task": "map db", "background": True}},
        ]
    }
    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    two,
                    call("task_output", id="scout#1", wait=30),
                    call("task_output", id="scout#2", wait=30),
                    "Both mapped.",
                ]
            },
            "scout": {"replies": [{"content": "mapped", "delay": 0.3}]},
        }
    }
    result = run_parent(scripted_runner(script))

    first, second, out_1, out_2 = tool_messages(result)
    assert sorted([first.split(".")[0], second.split(".")[0]]) == [
        "Started in the background: scout#1",
        "Started in the background: scout#2",
    ]
    assert (out_1, out_2) == ("scout#1 completed\n\nmapped", "scout#2 completed\n\nmapped")
    assert result.output == "Both mapped."


def test_ids_are_reserved_as_they_are_planned_and_count_against_the_cap(scripted_runner: Any) -> None:
    board = scripted_runner(["x"]).board
    first = board.plan_ids([TaskSpec("scout", "a"), TaskSpec("planner", "b")])
    overlapping = board.plan_ids([TaskSpec("scout", "c")])  # planned before the first were added
    assert (first, overlapping) == (["scout#1", "planner#1"], ["scout#2"])
    board.release(overlapping)  # its start failed
    assert board.plan_ids([TaskSpec("scout", "d", label="auth")]) == ["auth"]
    with pytest.raises(RequestError, match="a task named 'auth' was already started here"):
        board.plan_ids([TaskSpec("scout", "e", label="auth")])
    with pytest.raises(RequestError) as refused:
        board.plan_ids([TaskSpec("scout", "f")] * 6)
    assert str(refused.value) == (
        "3 background tasks are alive here (auth, planner#1, scout#1) and the limit is 8; wait for one to end "
        "(task_output with wait) or cancel one (task_cancel)"
    )
    assert board.plan_ids([TaskSpec("scout", "g")]) == ["scout#2"]


# -- bounded conversations --------------------------------------------------------------------------


def test_a_continued_childs_turns_count_across_its_generations(scripted_runner: Any) -> None:
    script = {"agents": {"scout": {"replies": [call("ls", path="."), "one file", call("ls", path="."), "never"]}}}
    runner = scripted_runner(script)

    async def main() -> tuple[Any, Any, str]:
        async with runner:
            handle = await runner.start(TaskSpec("scout", "look", max_turns=3))
            first = await handle.wait()
            handle.send("and again")
            second = await handle.wait()
            with pytest.raises(TaskStateError) as refused:
                handle.send("once more")
            return first, second, str(refused.value)

    first, second, refused = asyncio.run(main())
    assert (first.status, first.output, first.usage.turns) == ("completed", "one file", 2)
    assert (second.status, second.stop_reason, second.usage.turns) == ("failed", "max_turns", 3)
    assert second.error == "reached the limit of 3 turns (2 of them in earlier generations) without a final answer"
    assert refused == (
        "task 'scout#1' has used its 3 turns (max_turns) across its generations and takes no more messages; "
        "start a new task"
    )


def test_a_child_takes_at_most_64_generations(scripted_runner: Any) -> None:
    from mlx_subagents.caps import MAX_GENERATIONS

    runner = scripted_runner({"agents": {"scout": {"replies": [f"answer {n}" for n in range(MAX_GENERATIONS)]}}})

    async def main() -> tuple[Any, str]:
        async with runner:
            handle = await runner.start(TaskSpec("scout", "look", max_turns=100))
            await handle.wait()
            for n in range(1, MAX_GENERATIONS):
                handle.send(f"more {n}")
                last = await handle.wait()
            with pytest.raises(TaskStateError) as refused:
                handle.send("one too many")
            return last, str(refused.value)

    last, refused = asyncio.run(main())
    assert (last.status, last.output) == ("completed", "answer 63")
    assert refused == (
        "task 'scout#1' has had 64 generations, the limit of 64 and takes no more messages; start a new task"
    )


def test_at_most_64_messages_wait_for_a_running_child(tmp_path: Path, scripted_runner: Any) -> None:
    from mlx_subagents.caps import MAX_QUEUED_MESSAGES

    script = {"agents": {"scout": {"replies": [{"content": "read them all", "delay": 0.3}]}}}
    runner = scripted_runner(script)

    async def main() -> tuple[Any, str]:
        async with runner:
            handle = await runner.start(TaskSpec("scout", "look"))
            for n in range(MAX_QUEUED_MESSAGES):
                handle.send(f"note {n}")
            with pytest.raises(RequestError) as refused:
                handle.send("one too many")
            return await handle.wait(), str(refused.value)

    result, refused = asyncio.run(main())
    assert refused == (
        "task 'scout#1' already has 64 messages waiting, the limit; wait until it has read them "
        "(task_output with wait) before sending more"
    )
    assert (result.status, result.output) == ("completed", "read them all")
    log = read_transcript(Path(result.transcript))  # none lost: all 64 reached it at its first turn
    assert user_texts(log.messages) == [
        "\n\n".join([task_text("look", tmp_path), *(f"note {n}" for n in range(MAX_QUEUED_MESSAGES))])
    ]
