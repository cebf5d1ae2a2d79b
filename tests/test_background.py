"""Background tasks: `runner.start`, the `TaskHandle` (status, wait, cancel, send = steer or resume),
the `TaskBoard` (ids, the cap, notices), and the model-facing tools on a parent's children."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from helpers import call

from mlx_subagents.errors import (
    AgentNotFoundError,
    InputTooLargeError,
    RequestError,
    TaskNotFoundError,
    TaskStateError,
)
from mlx_subagents.events import Event
from mlx_subagents.options import RunOptions
from mlx_subagents.runner import Runner, TaskSpec
from mlx_subagents.transcripts import load_run, read_transcript


def make_runner(tmp_path: Path, model: str, events: list[Event] | None = None, **options: Any) -> Runner:
    sink = events.append if events is not None else (lambda _event: None)
    return Runner(cwd=tmp_path, options=RunOptions(model=model, **options), on_event=sink)


def user_texts(messages: list[dict[str, Any]]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


# -- the runner API ---------------------------------------------------------------------------------


def test_start_returns_at_once_with_predictable_ids_and_wait_gives_the_result(
    tmp_path: Path, write_script: Any
) -> None:
    (tmp_path / "app.py").write_text("print('hi')\n")
    model = write_script({"agents": {"scout": {"replies": [{"content": "found app.py", "delay": 0.3}]}}})
    runner = make_runner(tmp_path, model)

    async def main() -> Any:
        async with runner:
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
    record = load_run(first.run_id)
    assert [(t.label, t.status) for t in record.tasks] == [("scout#1", "completed")]
    assert read_transcript(record.transcript_path(record.tasks[0])).messages[1]["content"] == "Task: find the app"


def test_start_checks_everything_before_it_returns(tmp_path: Path, write_script: Any) -> None:
    runner = make_runner(tmp_path, write_script(["x"]))

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


def test_a_message_reaches_a_running_task_at_its_next_turn(tmp_path: Path, write_script: Any) -> None:
    (tmp_path / "app.py").write_text("print('hi')\n")
    model = write_script(
        {"agents": {"scout": {"replies": [{**call("ls", path="."), "delay": 0.4}, "done, and I checked tests too"]}}}
    )
    events: list[Event] = []
    runner = make_runner(tmp_path, model, events)

    async def main() -> Any:
        async with runner:
            handle = await runner.start(TaskSpec("scout", "list the files"))
            while handle.status != "running":
                await asyncio.sleep(0.01)
            handle.send("also look at the tests")
            result = await handle.wait()
            host = await runner.host_for(model)
            return handle, result, host.history["scout#1"]

    handle, result, history = asyncio.run(main())
    assert result.output == "done, and I checked tests too"
    # The first turn did not see it; the second got it after the ls result, as a user message.
    assert user_texts(history[0]) == ["Task: list the files"]
    assert [m["role"] for m in history[1]][-3:] == ["assistant", "tool", "user"]
    assert history[1][-1]["content"] == "also look at the tests"
    log = read_transcript(Path(result.transcript))
    kinds = [(r["type"], r.get("kind")) for r in log.records if r["type"] != "task"]
    at = kinds.index(("task_send", "task_send"))
    assert kinds[at - 1] == ("event", "tool_result") and kinds[at + 1] == ("event", "turn_start")
    assert [e.data["message"] for e in events if e.kind == "task_send"] == ["also look at the tests"]


def test_a_message_to_a_finished_task_resumes_it(tmp_path: Path, write_script: Any) -> None:
    model = write_script({"agents": {"scout": {"replies": ["first answer", "second answer"]}}})
    runner = make_runner(tmp_path, model)

    async def main() -> Any:
        async with runner:
            handle = await runner.start(TaskSpec("scout", "look"))
            first = await handle.wait()
            handle.send("and now?")
            assert handle.status in ("queued", "running")
            second = await handle.wait()
            host = await runner.host_for(model)
            return handle, first, second, host.history["scout#1"]

    handle, first, second, history = asyncio.run(main())
    assert (first.output, second.output) == ("first answer", "second answer")
    assert user_texts(history[1]) == ["Task: look", "and now?"]
    assert handle.generations == 2
    log = read_transcript(Path(second.transcript))
    assert [r.output for r in log.results] == ["first answer", "second answer"]
    assert [r["data"]["message"] for r in log.records if r["type"] == "task_send"] == ["and now?"]


def test_cancel_aborts_a_task_and_a_message_to_it_is_refused(tmp_path: Path, write_script: Any) -> None:
    model = write_script({"agents": {"scout": {"replies": [{"content": "never", "delay": 30}]}}})
    runner = make_runner(tmp_path, model)

    async def main() -> Any:
        async with runner:
            handle = await runner.start(TaskSpec("scout", "look"))
            while handle.status != "running":
                await asyncio.sleep(0.01)
            assert handle.cancel() is True
            result = await asyncio.wait_for(handle.wait(), 5)
            with pytest.raises(TaskStateError, match="task 'scout#1' was cancelled \\(cancelled\\) and takes no more"):
                handle.send("more")
            return handle, result

    handle, result = asyncio.run(main())
    assert (result.status, result.stop_reason, result.error) == ("aborted", "cancelled", "cancelled")
    assert handle.status == "aborted" and handle.cancel() is False
    record = load_run(handle.run_id)
    assert (record.status, record.tasks[0].status) == ("interrupted", "aborted")


def test_closing_the_runner_cancels_what_still_runs(tmp_path: Path, write_script: Any) -> None:
    model = write_script({"agents": {"scout": {"replies": [{"content": "never", "delay": 30}]}}})
    runner = make_runner(tmp_path, model)

    async def main() -> Any:
        async with runner:
            running = await runner.start(TaskSpec("scout", "look"))
            while running.status != "running":
                await asyncio.sleep(0.01)
            return running, await runner.start(TaskSpec("scout", "look again"))

    running, queued = asyncio.run(asyncio.wait_for(main(), 10))
    assert (running.status, running.result.error) == ("aborted", "the runner closed")
    assert (queued.status, queued.result.error) == ("aborted", "the runner closed before it started")
    assert load_run(running.run_id).status == "interrupted"
