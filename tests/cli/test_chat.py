"""`subagent chat`: one turn with --once, the slash commands, resuming a chat, and Ctrl-C in a real
pseudo-terminal stopping a turn and its sub-agents while the chat goes on."""

from __future__ import annotations

import io
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.runs.transcripts import load_run, read_transcript
from tests.helpers import SLOW, Terminal, alive, all_dead, call, cli_env, wait_for_pids

# -- --once -------------------------------------------------------------------------------------------


def test_once_runs_one_turn_and_exits(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    model = write_script(
        {
            "agents": {
                "orchestrator": {
                    "replies": [call("subagent", agent="scout", task="find the app"), "The app is app.py."]
                },
                "scout": {"replies": ["app.py:1"]},
            }
        }
    )
    code, out, err = run_cli("chat", "--once", "where is the app?", "-m", model, "-C", str(tmp_path))

    assert (code, out) == (0, "The app is app.py.\n")
    record = load_run("last")
    assert err.splitlines() == [
        "▸ subagent scout: find the app",
        "  ↳ scout#1 (scout) started",
        "  ✓ scout#1 completed (1 turns)",
        err.splitlines()[3],  # the usage line
        f"saved as run {record.run_id}; continue with: subagent chat --resume {record.run_id}",
    ]
    assert err.splitlines()[3].startswith("orchestrator: 2 turns, ")
    assert (record.mode, record.status, record.tasks[0].status) == ("single", "finished", "completed")
    log = read_transcript(record.transcript_path(record.tasks[0]))
    assert [m["role"] for m in log.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert log.messages[1]["content"] == "where is the app?"
    child = load_run("last", home=record.folder)
    assert log.messages[3]["content"] == f"app.py:1\n\n[sub-agent run {child.run_id}; task_send continues scout#1]"


def test_a_run_on_a_relative_model_path_resumes_from_another_folder(
    tmp_path: Path, write_script: Any, run_cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's demo names its replay relative to the checkout; `resume` from elsewhere finds it."""
    write_script(["one"])
    monkeypatch.chdir(tmp_path)
    assert run_cli("run", "scout", "first", "-m", "scripted:script.json")[:2] == (0, "one\n")
    monkeypatch.chdir(tmp_path.parent)
    assert run_cli("resume", "last", "second")[:2] == (0, "one\n")  # a new process: its script from the start
    record = load_run("last")
    assert read_transcript(record.transcript_path(record.tasks[0])).meta["model"] == f"scripted:{tmp_path}/script.json"


def test_a_chat_continues_with_resume_and_chat_resume(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    # Each command is a new process: a new scripted session, replaying its script from the start.
    assert run_cli("chat", "--once", "first", "-m", write_script(["one"], "1.json"), "-C", str(tmp_path))[:2] == (
        0,
        "one\n",
    )
    run_id = load_run("last").run_id

    code, out, _ = run_cli("resume", run_id, "second", "-m", write_script(["two"], "2.json"))
    assert (code, out) == (0, "two\n")
    code, out, _ = run_cli("chat", "--resume", "last", "--once", "third", "-m", write_script(["three"], "3.json"))
    assert (code, out) == (0, "three\n")

    record = load_run("last")
    assert record.run_id == run_id
    log = read_transcript(record.transcript_path(record.tasks[0]))
    assert [m["content"] for m in log.messages if m["role"] in ("user", "assistant")] == [
        "first",
        "one",
        "second",
        "two",
        "third",
        "three",
    ]
    assert log.generations == 3 and [r.status for r in log.results] == ["completed"] * 3


def test_chat_errors_before_it_starts_are_one_line(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    model = write_script(["x"])
    code, out, err = run_cli("chat", "--agent", "nobody", "--once", "hi", "-m", model, "-C", str(tmp_path))
    assert (code, out) == (2, "")
    assert err == "error: unknown agent 'nobody'; available: orchestrator, planner, reviewer, scout, worker\n"
    code, _, err = run_cli("chat", "--once", " ", "-m", model, "-C", str(tmp_path))
    assert (code, err) == (2, "error: the message is empty; type what the agent should do\n")


# -- the prompt line, driven through stdin ------------------------------------------------------------


def test_slash_commands(tmp_path: Path, write_script: Any, run_cli: Any, monkeypatch: Any) -> None:
    model = write_script(
        {
            "agents": {
                "orchestrator": {
                    "replies": [
                        "first answer",
                        "second answer",
                        "## Goal\nthe summary",
                    ]
                }
            }
        }
    )
    lines = ["/compact", "hello", "/agents", "again", "/compact", "/usage", "/bogus", "/help", "/exit", "never sent"]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{line}\n" for line in lines)))
    code, out, err = run_cli("chat", "-m", model, "-C", str(tmp_path))

    assert code == 0
    record = load_run("last")
    usage = next(
        line for line in out.splitlines() if line.startswith("> orchestrator: ") or line.startswith("orchestrator: ")
    )
    assert out.split("\n") == [
        "> nothing to compact yet",
        "> first answer",
        "> orchestrator (this chat) [builtin]: Talks with you about the codebase and hands bounded jobs to other "
        "agents (scout, planner, reviewer, worker), alone or in parallel. Never edits files itself.",
        "planner [builtin]: Turns a task into a short, concrete plan (steps, files to touch, risks). Never edits files.",
        "reviewer [builtin]: Reviews a change or some code for bugs and reports each problem with its fix and a "
        "verdict. Never edits files.",
        "scout [builtin]: Finds where things are in the codebase and reports exact file locations. Never edits files.",
        "worker [builtin]: Makes the code change a task asks for, runs the tests, and reports what changed.",
        "> second answer",
        out.split("\n")[8],
        usage,
        "sub-agents: 0 started, 0 turns, 0 in (0 cached), 0 out",
        f"saved as run {record.run_id}",
        "> > /agents    list the agents the parent can delegate to",
        "/usage     tokens, context and KV cache of this chat and its sub-agents",
        "/compact   summarise the conversation so far, to free context",
        "/think     show the last reply's reasoning in full (the chat shows it folded)",
        '/workflow  /workflow NAME INPUT (or {"steps": [...]}): run a workflow as the parent\'s sub-agents; it reads '
        "their answers next",
        "/tasks     the sub-agents running in the background: id, agent, status, turn, tokens, last tool, time",
        "/send      /send ID TEXT: a message to a background sub-agent (read at its next turn, or it resumes)",
        "/cancel    /cancel ID: stop a background sub-agent (its bash commands are killed)",
        "/wake      /wake on|off: whether a background sub-agent's end starts the parent's next turn (on)",
        "/help      this list",
        "/exit      leave the chat (also Ctrl-D)",
        "> ",
    ]
    assert re.fullmatch(r"> compacted: [\d,]+ -> [\d,]+ tokens", out.split("\n")[8])
    assert re.fullmatch(r"> orchestrator: 2 turns, .* 1 compactions", usage)
    assert (
        "unknown command /bogus; commands: /agents, /usage, /compact, /think, /workflow, /tasks, /send, /cancel, /wake, "
        "/help, /exit" in err
    )
    log = read_transcript(record.transcript_path(record.tasks[0]))
    assert [m["content"] for m in log.messages[1:]] == [
        "hello",
        "[Summary of earlier work]\n## Goal\nthe summary",
        "second answer",
    ]


# -- Ctrl-C -------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.process
def test_ctrl_c_stops_the_turn_and_its_children_and_the_chat_goes_on(tmp_path: Path, write_script: Any) -> None:
    model = write_script(
        {
            "agents": {
                "orchestrator": {
                    "replies": [call("subagent", agent="worker", task="run the slow check"), "still here"]
                },
                "worker": {"replies": [call("bash", command=SLOW), "never"]},
            }
        }
    )
    term = Terminal(["chat", "-m", model, "-C", str(tmp_path)])
    try:
        term.expect("/exit leaves\n> ")
        term.send("run the slow check\n")
        pids = wait_for_pids(tmp_path, time.monotonic() + 60)
        assert all(alive(p) for p in pids)
        term.expect("$ echo $$ > bash.pid")  # the child's tool call, shown under the parent's
        term.send("\x03")
        shown = term.expect("the chat goes on (/exit leaves)\n> ")
        assert all_dead(pids), "a child's process survived Ctrl-C"
        assert "✗ worker#1 aborted: aborted by the user (Ctrl-C)" in shown
        term.send("/usage\n")
        assert "sub-agents: 1 started, 1 turns" in term.expect("saved as run ")
        term.send("are you there?\n")
        term.expect("still here\n> ")
        term.send("/exit\n")
        assert term.wait() == 0
    finally:
        term.close()

    record = load_run("last")
    assert (record.status, record.tasks[0].status) == ("finished", "completed")
    log = read_transcript(record.transcript_path(record.tasks[0]))
    assert [(r.status, r.stop_reason) for r in log.results] == [("aborted", "cancelled"), ("completed", "completed")]
    tool = next(m for m in log.messages if m["role"] == "tool")
    assert tool["content"] == "Error: this tool call was interrupted before it finished."
    child = load_run("last", home=record.folder)
    assert (child.status, child.tasks[0].status) == ("interrupted", "aborted")


@pytest.mark.slow
@pytest.mark.process
def test_sigint_during_once_stops_the_children_and_exits_130(tmp_path: Path, write_script: Any) -> None:
    model = write_script(
        {
            "agents": {
                "orchestrator": {
                    "replies": [
                        call(
                            "subagent", tasks=[{"agent": "worker", "task": "slow"}, {"agent": "scout", "task": "quick"}]
                        ),
                        "never",
                    ]
                },
                "worker": {"replies": [call("bash", command=SLOW), "never"]},
                "scout": {"replies": ["quick answer"]},
            }
        }
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_subagents.cli", "chat", "--once", "go", "-m", model, "-C", str(tmp_path)],
        env=cli_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pids = wait_for_pids(tmp_path, time.monotonic() + 60)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)  # a bound, not a measure: ignored, the SIGINT leaves exit 0
    finally:
        proc.kill()
        proc.wait()

    assert proc.returncode == 130, err
    assert out == ""
    assert all_dead(pids)
    assert "turn interrupted: what was done is kept" in err and "Traceback" not in err
    assert load_run("last").status == "interrupted"


def test_the_streamed_reply_is_written_as_it_comes() -> None:
    # Tool-call markup never reaches the stream: the host sends only visible text (the tiny-model
    # chat below shows it end to end).
    from mlx_subagents.cli.chat_view import ReplyStream

    file = io.StringIO()
    stream = ReplyStream(file)
    for chunk in ["\n ", " Let me", " look.\n"]:
        stream(chunk)
    assert file.getvalue() == "Let me look.\n"
    stream.end_line()  # the line is complete: nothing added
    stream.reset()
    for chunk in ["a < b", " <tool"]:
        stream(chunk)
        assert file.getvalue().endswith(chunk.lstrip())  # shown at once, nothing held back
    stream.end_line()
    assert file.getvalue() == "Let me look.\na < b <tool\n"


@pytest.mark.slow
def test_a_chat_on_the_tiny_real_model_streams_and_reuses_its_cache(forced_runner: Any) -> None:
    import asyncio

    from rich.console import Console

    from mlx_subagents.cli.chat_view import ChatView, ReplyStream
    from mlx_subagents.events import Fanout
    from mlx_subagents.runs.chat import Chat
    from mlx_subagents.testing import tool_call_text

    screen = io.StringIO()
    stream = ReplyStream(screen)
    view = ChatView(Console(file=screen, width=200), stream)
    sink = Fanout([view.handle])
    replies = {
        "orchestrator": [
            "Let me ask. " + tool_call_text("subagent", {"agent": "scout", "task": "list the files"}),
            "The scout found app.py.",
            "Nothing else.",
        ],
        "orchestrator > scout#1": ["app.py is the only file"],
    }
    # The orchestrator's prompt and tools (subagent and its four task tools) take about 4,400 of the tiny
    # tokenizer's tokens: over half of 8,192, the most a prompt may take.
    runner, _ = forced_runner(replies, on_event=sink, context_window=16384)

    async def main() -> tuple[Any, Any, Chat]:
        async with runner:
            chat = await Chat.start(runner, on_text=stream)
            view.parent = chat.label
            sink.targets.append(chat.observe)
            first = await chat.turn("what files are there?")
            stream.end_line()
            second = await chat.turn("anything else?")
            stream.end_line()
            return first, second, chat

    first, second, chat = asyncio.run(main())
    assert (first.output, second.output) == ("The scout found app.py.", "Nothing else.")
    assert screen.getvalue() == (
        "Let me ask. \n▸ subagent scout: list the files\n  ↳ scout#1 (scout) started\n"
        "  ✓ scout#1 completed (1 turns)\nThe scout found app.py.\nNothing else.\n"
    )
    assert second.usage.turns == 3 and second.usage.cached_tokens > first.usage.cached_tokens > 0
    assert chat.children_usage()[0] == 1 and chat.children_usage()[1].turns == 1


def test_usage_counts_a_continued_sub_agent_once_however_often_it_ends_or_is_observed(tmp_path: Path) -> None:
    """A foreground child the parent sends a message to ends twice, the second time with all its usage;
    and a caller that adds `chat.observe` to a sink the chat already feeds sees each event twice."""
    import asyncio

    from mlx_subagents.events import Fanout
    from mlx_subagents.runs.chat import Chat
    from tests.helpers import make_runner, scripted_host

    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    call("subagent", agent="scout", task="look"),
                    call("task_send", id="scout#1", message="and more"),
                    call("task_output", id="scout#1", wait=5),
                    "done",
                ]
            },
            "scout": {"replies": ["Findings: a\n\nSummary: b", "Findings: c\n\nSummary: d"]},
        }
    }
    sink = Fanout([])

    async def main() -> tuple[list[str], Any]:
        async with make_runner(tmp_path, scripted_host(script), sink, save_transcripts=False) as runner:
            chat = await Chat.start(runner)
            sink.targets += [chat.observe, chat.observe]
            assert (await chat.turn("hi")).output == "done"
            return chat.usage_lines(), chat.board.get("scout#1").session.usage

    lines, scout = asyncio.run(main())
    assert scout.turns == 2 and scout.output_tokens == 30
    assert lines[1] == (
        f"sub-agents: 1 started, 2 turns, {scout.input_tokens:,} in ({scout.cached_tokens:,} cached), 30 out"
    )
