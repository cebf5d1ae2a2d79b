"""A reply cut by a timeout, Ctrl-C or a signal keeps what it had said: in the result, the transcript
and `show`, marked as cut (the scripted host's `stall`, and the tiny real model forced mid-reply)."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.cli.show import CUT_NOTE
from mlx_subagents.runs.tasks import TaskSpec
from mlx_subagents.runs.transcripts import load_run, read_transcript
from tests.helpers import go, make_runner, spawn_cli

SAID = "The auth code is in src/auth.py, where"
THOUGHT = "the imports point at src/auth.py"
CUT = {"role": "assistant", "content": SAID, "reasoning_content": THOUGHT, "cut": True}


def last_message(result: Any) -> dict[str, Any]:
    messages = read_transcript(Path(result.transcript)).messages
    assert messages is not None
    return messages[-1]


@pytest.mark.slow
def test_a_reply_cut_by_the_timeout_keeps_its_text_and_reasoning(scripted_runner: Any) -> None:
    runner = scripted_runner({"replies": [{"reasoning": THOUGHT, "content": SAID, "stall": 60}]})
    result = go(runner, "run", TaskSpec("scout", "where is auth?", timeout=0.5))

    assert (result.status, result.stop_reason, result.output, result.reasoning) == ("failed", "timeout", SAID, THOUGHT)
    assert result.error == "stopped by the timeout of 0.5s; the output holds the reply it cut short"
    assert result.usage.output_tokens > 0  # what streamed was generated
    assert last_message(result) == CUT
    [saved] = read_transcript(Path(result.transcript)).results
    assert (saved.output, saved.reasoning, saved.error) == (SAID, THOUGHT, result.error)


def test_a_reply_cut_by_ctrl_c_keeps_its_text_after_the_earlier_turns(scripted_runner: Any) -> None:
    first = {"content": "Looking first.", "tool_calls": [{"name": "ls", "arguments": {"path": "."}}]}
    runner = scripted_runner({"replies": [first, {"content": SAID, "stall": 60}]})
    result = asyncio.run(_until_streamed(runner))
    assert (result.status, result.stop_reason, result.output) == ("aborted", "cancelled", SAID)
    assert result.error == "aborted by the user (Ctrl-C); the output holds the reply it cut short"
    assert [m["role"] for m in read_transcript(Path(result.transcript)).messages or []] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    assert last_message(result) == {"role": "assistant", "content": SAID, "cut": True}


async def _until_streamed(runner: Any) -> Any:
    """Run a scout until its second reply has streamed, then Ctrl-C (`runner.cancel()`)."""
    said = asyncio.Event()
    runner.on_event = lambda e: said.set() if e.kind == "tool_result" else None
    async with runner:
        work = asyncio.create_task(runner.run(TaskSpec("scout", "where is auth?")))
        await said.wait()
        await asyncio.sleep(0.2)  # the second reply streams at once, then stalls
        runner.cancel()
        return await work


@pytest.mark.slow
@pytest.mark.process
def test_a_reply_cut_by_sigterm_is_in_the_json_and_in_show(
    tmp_path: Path, isolated_home: Path, preloaded_python: list[str]
) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"replies": [{"reasoning": THOUGHT, "content": SAID, "stall": 60}]}))
    proc = spawn_cli("run", "scout", "where is auth?", "--json", "-m", f"scripted:{script}", "-C", str(tmp_path))
    try:
        runs = isolated_home / ".mlx-subagents" / "runs"
        deadline = time.monotonic() + 60
        while not any('"kind": "reasoning"' in p.read_text() for p in runs.glob("*/*.jsonl")):
            assert time.monotonic() < deadline, "the reply never streamed"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    assert proc.returncode == 143, err
    data = json.loads(out)
    assert (data["status"], data["output"], data["reasoning"]) == ("aborted", SAID, THOUGHT)
    assert data["error"] == "stopped by SIGTERM; the output holds the reply it cut short"
    record = load_run("last")
    assert read_transcript(record.transcript_path(record.tasks[0])).messages[-1] == CUT  # type: ignore[index]
    shown = spawn_cli("show", "last", python=preloaded_python).communicate(timeout=60)[0].splitlines()
    at = shown.index(f"assistant: {SAID}")
    assert shown[at - 1 : at + 2] == [f"thinking: {THOUGHT}", f"assistant: {SAID}", CUT_NOTE]


@pytest.mark.slow
def test_the_tiny_model_cut_by_the_timeout_keeps_what_it_generated(
    tmp_path: Path, tiny_qwen3_path: Path, tiny_qwen3: tuple[Any, Any]
) -> None:
    from mlx_subagents.testing import make_forced_processor

    script = " ".join(f"word{i}" for i in range(600))
    reached = threading.Event()

    def slow(session_name: str, prompt_ids: Any) -> list[Any]:
        """The script forced token by token; from the tenth token on, each takes 20 ms (the timeout lands mid-reply)."""
        forced = make_forced_processor(tiny_qwen3[1], script)
        calls = [0]

        def processor(tokens: Any, logits: Any) -> Any:
            calls[0] += 1
            if calls[0] > 10:
                reached.set()
                time.sleep(0.02)
            return forced(tokens, logits)

        return [processor]

    runner = make_runner(tmp_path, str(tiny_qwen3_path), processor_factory=slow)
    result = go(runner, "run", TaskSpec("scout", "talk", timeout=8))

    assert reached.is_set()
    assert (result.status, result.stop_reason) == ("failed", "timeout")
    assert result.error == "stopped by the timeout of 8s; the output holds the reply it cut short"
    assert result.output and script.startswith(result.output) and result.output != script
    assert result.usage.output_tokens >= len(tiny_qwen3[1].encode(result.output))
    assert last_message(result) == {"role": "assistant", "content": result.output, "cut": True}
