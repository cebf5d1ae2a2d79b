"""Children that speak up (issue 66): a sub-agent's `parent_send` message reaches its parent's next turn,
its views and its transcript; the parent answers with `task_send`; messages are bounded in size and in
how many wait unread."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

from rich.console import Console

from mlx_subagents.acp.updates import Updates
from mlx_subagents.caps import MAX_CHILD_MESSAGE_CHARS, MAX_CHILD_MESSAGES
from mlx_subagents.cli.show import note_line
from mlx_subagents.events import ChildMessageData, Event, TaskNoticeData
from mlx_subagents.render import EventLines
from mlx_subagents.runs.transcripts import child_runs, load_run, read_transcript
from tests.helpers import call, run_parent


def user_texts(messages: list[dict[str, Any]]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


def test_a_childs_message_reaches_its_parents_next_turn_and_the_parent_answers_it(scripted_runner: Any) -> None:
    question = "auth is in auth.py; should I look at its tests too?"
    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    call("subagent", agent="scout", task="map auth", background=True),
                    "Waiting for the scout.",
                    call("task_send", id="scout#1", message="yes, the tests too"),
                    "Still waiting.",
                    "Auth: auth.py, tested in test_auth.py.",
                ]
            },
            "scout": {
                "replies": [
                    {**call("parent_send", message=question), "delay": 0.5},
                    {"content": "", **call("ls", path="."), "delay": 1.5},  # its parent answers meanwhile
                    "auth.py, tested in test_auth.py",
                ]
            },
        }
    }
    events: list[Event] = []
    result = run_parent(scripted_runner(script, events))

    assert (result.status, result.output) == ("completed", "Auth: auth.py, tested in test_auth.py.")
    parent = read_transcript(Path(result.transcript))
    said = user_texts(parent.messages)[1]
    assert said == f"[message from scout#1] {question}"
    assert parent.messages[parent.messages.index({"role": "user", "content": said}) - 1]["content"] == (
        "Waiting for the scout."
    )  # the message woke the parent from its waiting answer: its next turn
    [event] = [e for e in events if e.kind == "child_message"]
    assert (event.label, event.agent, event.data) == (
        "orchestrator",
        "orchestrator",
        {"id": "scout#1", "message": question},
    )
    assert [r["data"]["id"] for r in parent.records if r["type"] == "child_message"] == ["scout#1"]
    [child] = child_runs(load_run(result.run_id))
    log = read_transcript(child.transcript_path(child.tasks[0]))
    tool_results = [m["content"] for m in log.messages if m["role"] == "tool"]
    assert tool_results[0] == (
        "Sent: your parent reads it at its next turn; an answer from it reaches you before your next step."
    )
    assert "yes, the tests too" in user_texts(log.messages)  # read before the child's next step


def test_a_childs_messages_are_bounded_in_size_and_in_how_many_wait_unread(scripted_runner: Any) -> None:
    n = MAX_CHILD_MESSAGES + 1
    replies = [
        call("parent_send", message="x" * (MAX_CHILD_MESSAGE_CHARS + 1)),
        *(call("parent_send", message=f"note {i}") for i in range(1, n + 1)),
        "all noted",
    ]
    script = {
        "agents": {
            "orchestrator": {"replies": [call("subagent", agent="scout", task="look"), "read them"]},
            "scout": {"replies": replies},
        }
    }
    result = run_parent(scripted_runner(script))

    [child] = child_runs(load_run(result.run_id))
    results = [
        m["content"] for m in read_transcript(child.transcript_path(child.tasks[0])).messages if m["role"] == "tool"
    ]
    assert results[0] == (
        f"Error: the message is {MAX_CHILD_MESSAGE_CHARS + 1:,} characters, over the limit of "
        f"{MAX_CHILD_MESSAGE_CHARS:,} for a message to your parent; shorten it, and keep the details for your final "
        "answer"
    )
    assert all(r.startswith("Sent: ") for r in results[1:n])
    assert results[n] == (
        f"Error: {MAX_CHILD_MESSAGES} of your messages wait unread by your parent, the limit; carry on with your "
        "task and put the rest in your final answer"
    )
    # The parent waited on the foreground call: the eight come at its next turn, after the answer.
    later = user_texts(read_transcript(Path(result.transcript)).messages)[1]
    assert later == "\n\n".join(f"[message from scout#1] note {i}" for i in range(1, n))


def test_only_a_child_with_tools_is_offered_parent_send(scripted_runner: Any) -> None:
    script = {
        "agents": {
            "orchestrator": {
                "replies": [
                    call("parent_send", message="hello?"),
                    call("subagent", agent="scout", task="one word", single_shot=True),
                    "done",
                ]
            },
            "scout": {"replies": ["word"]},
        }
    }
    runner = scripted_runner(script)
    result = run_parent(runner)

    refused = [m["content"] for m in read_transcript(Path(result.transcript)).messages if m["role"] == "tool"][0]
    assert refused.startswith("Error: unknown tool 'parent_send'; available tools: ")  # a task a person started
    [host] = runner.preparer.hosts.values()
    [prompt] = host.history["orchestrator > scout#1"]
    assert "parent_send" not in str(prompt)


def test_every_view_shows_a_childs_message(tmp_path: Path) -> None:
    said = Event(
        kind="child_message", label="o", agent="o", data=ChildMessageData(id="scout#1", message="found it\nmore")
    )
    console = Console(file=io.StringIO())
    for layout in ("chat", "task"):  # the chat's lines and `run`'s, as a notice's are
        assert EventLines(console, layout, root="o").line(said) == "[magenta]✉ scout#1:[/] found it"
    record = {"type": "child_message", "generation": 1, "turn": 2, "data": said.data}  # `subagent show`
    assert note_line(record) == "message from scout#1 (generation 1, turn 2): found it\nmore"

    notice = TaskNoticeData(
        id="scout#1", status="completed", first_line="found", text="scout#1 completed:\nfound", run_id=None
    )
    sent: list[Any] = []

    async def editor() -> None:  # an ACP editor gets both as the agent reads them, as thought chunks
        async def send(update: Any) -> None:
            sent.append(update)

        updates = Updates(send, "o", tmp_path, 4096)
        updates(said)
        updates(Event(kind="task_notice", label="o", agent="o", data=notice))
        await updates.close()

    asyncio.run(editor())
    assert [(u.session_update, u.content.text) for u in sent] == [
        ("agent_thought_chunk", "\n[message from scout#1] found it\nmore\n"),
        ("agent_thought_chunk", "\n[notice] scout#1 completed:\nfound\n"),
    ]
