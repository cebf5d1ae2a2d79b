"""An MCP server's elicitation reaches the person in `subagent chat` (issue 45): a form on the terminal,
field by field, its defaults kept by Enter, a wrong answer asked again; Ctrl-C dismisses it. The server
is tests/tools/mcp_demo_server.py; the chat runs on a pseudo-terminal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.runs.transcripts import load_run, read_transcript
from tests.helpers import Terminal, call, write_agent
from tests.tools.test_mcp_tools import inline_demo

pytestmark = [pytest.mark.slow, pytest.mark.process]


def tool_results() -> list[Any]:
    record = load_run("last")
    log = read_transcript(record.transcript_path(record.tasks[0]))
    return [json.loads(m["content"]) for m in log.messages or [] if m["role"] == "tool" and m["content"][0] == "{"]


def test_the_person_fills_the_servers_form_in_the_chat(tmp_path: Path, write_script: Any) -> None:
    write_agent(tmp_path, "demo-user", front=inline_demo(tmp_path / "pids"))
    again = call("mcp__demo__ask_name", question="Who are you?")  # not the same call three times in a row
    asks = [call("mcp__demo__ask_name"), "thanks", call("mcp__demo__ask_name"), "ok", again]
    model = write_script({"replies": [*asks, "never"]})
    term = Terminal(["chat", "--agent", "demo-user", "-m", model, "-C", str(tmp_path), "--yes"])
    try:
        term.expect("/exit leaves\n> ")
        term.send("ask me\n")
        assert "mcp demo asks: What is your name?" in term.expect("Name (required) [Ada]: ")
        term.send("Grace\n")
        term.expect("age (in years; a whole number, 0 to 150): ")
        term.send("200\n")
        term.expect("out of range, 0 to 150")
        term.expect("age (in years; a whole number, 0 to 150): ")
        term.send("37\n")
        term.expect("colour (one of: red, green) [green]: ")
        term.send("\n")  # Enter keeps the default
        term.expect("send this to demo? [Y]es / [n]o, decline / [c]ancel: ")
        term.send("\n")
        term.expect("thanks\n> ")
        term.send("again\n")
        term.expect("Name (required) [Ada]: ")
        term.send("/decline\n")
        term.expect("ok\n> ")
        term.send("once more\n")
        term.expect("Name (required) [Ada]: ")
        term.send("\x03")  # Ctrl-C: the turn stops and the form with it
        term.expect("the form was cancelled")
        term.expect("turn interrupted")
        term.send("/exit\n")
        assert term.wait() == 0
    finally:
        term.close()
    assert tool_results() == [
        {"action": "accept", "content": {"name": "Grace", "age": 37, "colour": "green"}, "meta": None},
        {"action": "decline", "content": None, "meta": None},
    ]  # the third call was interrupted: its result is the interruption's error, not JSON
