"""`subagent acp`: the real agent process over stdio (a fork of a process that imported it already:
conftest.py), driven by the ACP SDK's own client side, on scripted models (and the tiny real model,
started anew, where the KV cache is what is counted)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import acp
import pytest

from mlx_subagents import __version__
from mlx_subagents.runs.transcripts import load_run, read_transcript
from mlx_subagents.tools.editor import REJECTED
from tests.acp.helpers import EditorClient, agent_env, editor, run, worker_turn

pytestmark = [pytest.mark.slow, pytest.mark.process, pytest.mark.usefixtures("preloaded_agent")]


def test_a_prompt_streams_text_thinking_and_tool_calls_in_order(tmp_path: Path, write_script: Any) -> None:
    """initialize says the version, capabilities and agent; a prompt's updates stream in order."""
    (tmp_path / "app.py").write_text("print('hi')\n")
    model = write_script(
        {
            "agents": {
                "orchestrator": {
                    "replies": [
                        {
                            "reasoning": "look first",
                            "content": "Reading it.",
                            "tool_calls": [{"name": "read", "arguments": {"path": "app.py"}}],
                        },
                        "app.py prints hi",
                    ]
                }
            }
        }
    )
    client = EditorClient()

    async def main() -> Any:
        async with editor(client, "--model", model) as conn:
            session = await conn.new_session(cwd=str(tmp_path), mcp_servers=[])
            options = {o.id: o.current_value for o in session.config_options}
            answer = await conn.prompt(session_id=session.session_id, prompt=[acp.text_block("what does app.py do?")])
            return conn.initialized, options, session.modes, answer

    initialized, options, modes, answer = run(main)
    assert initialized.protocol_version == 1 and initialized.auth_methods == []  # nothing to sign in to
    assert initialized.agent_info.name == "mlx-subagents" and initialized.agent_info.version == __version__
    caps = initialized.agent_capabilities
    assert caps.load_session is True and caps.prompt_capabilities.embedded_context is True
    assert caps.session_capabilities.list is not None and caps.session_capabilities.resume is not None
    assert caps.session_capabilities.close is not None and caps.mcp_capabilities.http is True
    assert options == {"agent": "orchestrator", "model": "default", "mode": "default"}
    assert modes.current_mode_id == "default" and [m.id for m in modes.available_modes] == ["default", "plan"]
    assert answer.stop_reason == "end_turn" and answer.usage.input_tokens > 0
    assert (
        client.updates[0].session_update == "session_info_update" and client.updates[0].title == "what does app.py do?"
    )
    kinds = [k for k in client.kinds()[1:] if k != "usage_update"]
    assert kinds == [
        "agent_thought_chunk",
        "agent_message_chunk",
        "tool_call",
        "tool_call_update",
        "agent_message_chunk",
    ]
    start, end = client.tool_updates()
    assert (start.title, start.kind, start.status) == ("read app.py", "read", "in_progress")
    assert start.locations[0].path == str(tmp_path / "app.py") and start.raw_input == {"path": "app.py"}
    assert end.tool_call_id == start.tool_call_id and end.status == "completed"
    assert "print('hi')" in end.content[-1].content.text
    assert client.text() == "Reading it.app.py prints hi" and client.text("agent_thought_chunk") == "look first"
    thought, before, after = (u.message_id for u in client.updates if u.session_update.startswith("agent_"))
    assert len({thought, before, after}) == 3 and None not in (thought, before)  # a reply after a call: a new message
    usage = [u for u in client.updates if u.session_update == "usage_update"]
    assert usage and usage[-1].size == 32768 and 0 < usage[-1].used <= usage[-1].size


WRITE = {
    "agents": {
        "worker": {
            "replies": [{"tool_calls": [{"name": "write", "arguments": {"path": "a.txt", "content": "new\n"}}]}, "done"]
        }
    }
}


def test_a_write_rejected_in_the_editor_leaves_the_file_untouched(tmp_path: Path, write_script: Any) -> None:
    """A rejected write changes nothing; then plan mode takes the write tool away (no question asked), a bad
    option value is one error, and a closed session is gone."""
    (tmp_path / "a.txt").write_text("old\n")
    client = EditorClient(answer="reject_once")
    replies = WRITE["agents"]["worker"]["replies"]
    script = {"agents": {"worker": {"replies": [*replies, *replies]}}}

    async def main() -> tuple[Any, list[str]]:
        errors = []
        async with editor(client, "--model", write_script(script)) as conn:
            await worker_turn(conn, tmp_path, "rewrite a.txt")
            (saved,) = (await conn.list_sessions(cwd=str(tmp_path))).sessions
            await conn.set_session_mode(session_id=saved.session_id, mode_id="plan")  # the saved run, reopened
            planned = await conn.prompt(session_id=saved.session_id, prompt=[acp.text_block("try again")])
            for bad in (
                conn.set_config_option(config_id="mode", session_id=saved.session_id, value="fast"),
                conn.close_session(session_id=saved.session_id),
                conn.prompt(session_id=saved.session_id, prompt=[acp.text_block("still there?")]),
            ):
                try:
                    await bad
                except acp.RequestError as exc:
                    errors.append(str(exc))
        return planned, errors

    planned, errors = run(main)
    assert planned.stop_reason == "end_turn" and (tmp_path / "a.txt").read_text() == "old\n"
    assert errors[0] == "'fast' is not a value of mode; choose one of default, plan"
    assert len(errors) == 2 and errors[1].startswith("unknown session")  # closed
    first, then = [u for u in client.updates if u.session_update == "tool_call"]  # a new mode: a new chat
    assert first.tool_call_id != then.tool_call_id  # whose calls' ids are still the session's own
    ((asked, options),) = client.questions
    assert options == ["allow_once", "allow_always", "reject_once"]
    diff = asked.content[0]
    assert (diff.type, diff.path, diff.old_text, diff.new_text) == ("diff", str(tmp_path / "a.txt"), "old\n", "new\n")
    end, refused = [u for u in client.tool_updates() if u.session_update == "tool_call_update" and u.status]
    assert end.status == "failed" and end.content[-1].content.text == f"Error: {REJECTED}"
    assert (
        refused.status == "failed"
        and "write is not available to 'worker' in plan mode" in refused.content[-1].content.text
    )


def test_allowed_always_is_asked_once_and_writes(tmp_path: Path, write_script: Any) -> None:
    two = {"agents": {"worker": {"replies": [
        {"tool_calls": [{"name": "write", "arguments": {"path": "a.txt", "content": "one\n"}}]},
        {"tool_calls": [{"name": "bash", "arguments": {"command": "cat a.txt > b.txt"}}]},
        {"tool_calls": [{"name": "write", "arguments": {"path": "a.txt", "content": "two\n"}}]},
        "done",
    ]}}}  # fmt: skip
    client = EditorClient(answer="allow_always")

    async def main() -> None:
        async with editor(client, "--model", write_script(two)) as conn:
            await worker_turn(conn, tmp_path, "write twice")

    run(main)
    assert (tmp_path / "a.txt").read_text() == "two\n" and (tmp_path / "b.txt").read_text() == "one\n"
    assert [q.title for q, _ in client.questions] == ["write a.txt", "$ cat a.txt > b.txt"]  # each tool once


EDITING = {"agents": {"worker": {"replies": [
    {"tool_calls": [{"name": "read", "arguments": {"path": "a.txt"}}]},
    {"tool_calls": [{"name": "edit", "arguments": {"path": "a.txt", "old_text": "unsaved", "new_text": "edited"}}]},
    {"tool_calls": [{"name": "bash", "arguments": {"command": "echo from-the-terminal"}}]},
    "done",
]}}}  # fmt: skip


def test_the_editors_files_and_terminal_see_the_unsaved_buffer(tmp_path: Path, write_script: Any) -> None:
    (tmp_path / "a.txt").write_text("saved text\n")
    path = str(tmp_path / "a.txt")
    script = EDITING
    client = EditorClient(fs=True, terminal=True, buffers={path: "unsaved text\n"})

    async def main() -> None:
        async with editor(client, "--model", write_script(script)) as conn:
            await worker_turn(conn, tmp_path, "edit the buffer")

    run(main)
    read, edit, bash = [u for u in client.tool_updates() if u.session_update == "tool_call_update" and u.status]
    assert "unsaved text" in read.content[-1].content.text  # the buffer, not the disk
    assert client.buffers[path] == "edited text\n" and (tmp_path / "a.txt").read_text() == "saved text\n"
    assert edit.content[0].old_text == "unsaved text\n" and edit.content[0].new_text == "edited text\n"
    assert [c[0] for c in client.calls] == ["read", "read", "write", "terminal", "release"]
    assert client.calls[3][1][-1] == "echo from-the-terminal"
    assert bash.content[0].type == "terminal" and "from-the-terminal" in bash.content[-1].content.text


def test_with_subagent_serve_running_the_session_runs_there_through_the_editor(
    serve_process: Any, tmp_path: Path, write_script: Any, preloaded_python: list[str]
) -> None:
    from acp.schema import McpServerStdio

    from mlx_subagents.serve.state import serve_paths
    from tests.cli.test_attach import served_clients
    from tests.tools.test_mcp_tools import SERVER

    (tmp_path / "a.txt").write_text("saved text\n")
    path = str(tmp_path / "a.txt")
    replies = EDITING["agents"]["worker"]["replies"]
    asking = {"tool_calls": [{"name": "mcp__demo__ask_name", "arguments": {}}]}  # its form, in the editor
    script = {"agents": {"worker": {"replies": [*replies[:-1], asking, "done"]}}}
    serve_process("--no-http", "--model", write_script(script))  # only the server knows this model
    form = {"name": "Grace", "age": 37, "colour": "green"}
    client = EditorClient(fs=True, terminal=True, buffers={path: "unsaved text\n"}, form=form)
    demo = McpServerStdio(name="demo", command=preloaded_python[0], args=[*preloaded_python[1:], SERVER], env=[])

    async def main() -> None:
        async with editor(client) as conn:
            session = await conn.new_session(cwd=str(tmp_path), mcp_servers=[demo])
            await conn.set_config_option(config_id="agent", session_id=session.session_id, value="worker")
            await conn.prompt(session_id=session.session_id, prompt=[acp.text_block("edit the buffer")])

    run(main)
    assert client.buffers[path] == "edited text\n" and (tmp_path / "a.txt").read_text() == "saved text\n"
    assert [c[0] for c in client.calls] == ["read", "read", "write", "terminal", "release", "form"]
    consent, *asked = [q.title for q, _ in client.questions]
    assert "the editor's session starts MCP server(s) demo" in consent
    assert asked == ["edit a.txt", "$ echo from-the-terminal"]
    ends = [u for u in client.tool_updates() if u.session_update == "tool_call_update" and u.status]
    assert [e.status for e in ends] == ["completed"] * 4 and "from-the-terminal" in ends[2].content[-1].content.text
    (message, mode) = client.calls[-1][1]  # the server's form, on the call that asked, filled in the editor
    assert message == "demo: What is your name?" and mode.tool_call_id == ends[3].tool_call_id
    assert json.loads(ends[3].content[-1].content.text) == {"action": "accept", "content": form, "meta": None}
    assert [c.split(" (pid")[0] for c in served_clients(serve_paths().log.read_text())] == ["chat"]


def test_cancel_ends_the_turn_and_saves_it(tmp_path: Path, write_script: Any) -> None:
    """session/cancel ends a turn; so does `$/cancel_request` of its prompt (ACP's request cancellation)."""
    # A reply cut short is the scripted host's next reply again: the second turn stalls as well.
    model = write_script({"agents": {"orchestrator": {"replies": [{"content": "I will look", "stall": 60}]}}})
    client = EditorClient()

    async def main() -> tuple[Any, Any, Any, str]:
        async with editor(client, "--model", model) as conn:
            session = await conn.new_session(cwd=str(tmp_path), mcp_servers=[])
            turn = asyncio.ensure_future(
                conn.prompt(session_id=session.session_id, prompt=[acp.text_block("look around")])
            )
            await client.wait_for("agent_message_chunk")
            try:  # a second prompt while the turn runs: one clear error, the turn goes on
                await conn.prompt(session_id=session.session_id, prompt=[acp.text_block("and?")])
            except acp.RequestError as exc:
                busy = str(exc)
            await conn.cancel(session_id=session.session_id)
            answer = await asyncio.wait_for(turn, 20)
            again = asyncio.ensure_future(conn.prompt(session_id=session.session_id, prompt=[acp.text_block("again")]))
            await client.wait_until(lambda: client.kinds().count("agent_message_chunk") == 2)
            (prompt_id,) = conn._conn._pending  # the JSON-RPC id of the prompt running
            await conn._conn.send_notification("$/cancel_request", {"requestId": prompt_id})
            second = await asyncio.wait_for(again, 20)
            listed = await conn.list_sessions(cwd=str(tmp_path))
            return answer, second, listed, busy

    answer, second, listed, busy = run(main)
    assert answer.stop_reason == "cancelled" and second.stop_reason == "cancelled"
    assert "is running a turn; wait for its end or send session/cancel" in busy
    (saved,) = listed.sessions
    assert saved.title == "look around" and saved.cwd == str(tmp_path)
    record = load_run(saved.session_id)
    log = read_transcript(record.transcript_path(record.tasks[0]))
    assert record.status == "interrupted" and [r.status for r in log.results] == ["aborted", "aborted"]
    assert "cancelled in the editor (session/cancel)" in log.results[0].error
    assert "cancelled in the editor ($/cancel_request of its prompt)" in log.results[1].error


def test_resume_continues_a_saved_run_and_load_shows_it_again(tmp_path: Path, write_script: Any) -> None:
    # A scripted host replays its script from the start in each process.
    model = write_script({"agents": {"orchestrator": {"replies": ["first answer"]}}}, "one.json")
    again = write_script({"agents": {"orchestrator": {"replies": ["second answer"]}}}, "two.json")
    first, second, third = EditorClient(), EditorClient(), EditorClient()

    async def main() -> tuple[str, Any]:
        async with editor(first, "--model", model) as conn:
            session = await conn.new_session(cwd=str(tmp_path), mcp_servers=[])
            await conn.prompt(session_id=session.session_id, prompt=[acp.text_block("one")])
        async with editor(second, "--model", again) as conn:  # another process, as an editor restarted
            (saved,) = (await conn.list_sessions(cwd=str(tmp_path))).sessions
            await conn.resume_session(cwd=str(tmp_path), session_id=saved.session_id, mcp_servers=[])
            answer = await conn.prompt(session_id=saved.session_id, prompt=[acp.text_block("two")])
        async with editor(third, "--model", model) as conn:
            await conn.load_session(cwd=str(tmp_path), session_id=saved.session_id, mcp_servers=[])
        return saved.session_id, answer

    run_id, answer = run(main)
    assert answer.stop_reason == "end_turn" and second.text() == "second answer"
    assert second.kinds()[0] != "user_message_chunk"  # resume shows nothing again; load does
    shown = [(u.session_update, u.content.text) for u in third.updates]
    assert shown == [
        ("user_message_chunk", "one"), ("agent_message_chunk", "first answer"),
        ("user_message_chunk", "two"), ("agent_message_chunk", "second answer"),
    ]  # fmt: skip
    record = load_run(run_id)
    assert len(read_transcript(record.transcript_path(record.tasks[0])).results) == 2


BAD_LINES = [
    b"this is not json\n",
    b"[1, 2]\n",
    b'{"jsonrpc": "2.0", "id": 7, "method": "no/such_method", "params": {}}\n',
    b'{"jsonrpc": "2.0", "id": 8, "method": "session/prompt", "params": {"sessionId": "nope", "prompt": []}}\n',
    b'{"jsonrpc": "2.0", "id": 9, "method": "session/new", "params": {"cwd": "relative/folder", "mcpServers": []}}\n',
    b'{"jsonrpc": "2.0", "id": 10, "method": "session/load", "params": {"cwd": "/", "sessionId": "no-such-run", "mcpServers": []}}\n',
    b'{"jsonrpc": "2.0", "id": 11, "method": "session/new", "params": {"cwd": 5}}\n',
    b'{"jsonrpc": "2.0", "id": {"a": 1}, "method": "initialize", "params": {"protocolVersion": 1}}\n',
    b'{"jsonrpc": "2.0", "method": "$/cancel_request", "params": {"requestId": {"x": 1}}}\n',
    b'{"jsonrpc": "2.0", "method": "$/cancel_request", "params": 5}\n',
    b'{"jsonrpc": "2.0", "method": "$/cancel_request", "params": {"requestId": 99}}\n',
    b'{"jsonrpc": "2.0", "id": 12, "method": "initialize", "params": {"protocolVersion": 1}}\n',
]


def test_bad_input_is_answered_and_never_kills_the_agent(
    tmp_path: Path, write_script: Any, preloaded_agent: list[str]
) -> None:
    command = [*preloaded_agent, "-m", "mlx_subagents.cli", "acp", "--model", write_script(["unused"])]
    proc = subprocess.run(
        command,
        input=b"".join(BAD_LINES),
        capture_output=True,
        env=agent_env(),
        timeout=60,
    )
    answers = [json.loads(line) for line in proc.stdout.splitlines()]
    errors = [(a.get("id"), a["error"]["code"], a["error"]["message"]) for a in answers if "error" in a]
    unnamed = [(code, text) for n, code, text in errors if n is None]  # answered by the reader, in order
    named = {n: (code, text) for n, code, text in errors if n is not None}  # by the SDK, as each ends
    assert unnamed[0][0] == -32700 and "not JSON" in unnamed[0][1]
    assert unnamed[1:] == [
        (-32600, "Invalid request: a message must be a JSON object"),
        (-32600, "Invalid request: 'id' must be a string or a number"),
    ]
    assert named[7][0] == -32601 and named[11][0] == -32602
    assert named[8][0] == -32602 and "unknown session 'nope'" in named[8][1]
    assert named[9][0] == -32602 and "is not an absolute path of a folder" in named[9][1]
    assert named[10][0] == -32602 and "no saved run 'no-such-run'" in named[10][1]
    assert len(errors) == 8  # a $/cancel_request of nothing running is a notification: no answer
    assert answers[-1]["id"] == 12 and answers[-1]["result"]["protocolVersion"] == 1  # alive to the end
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr
    with (tmp_path / "requests.jsonl").open("wb+") as file:  # a file, not a pipe: one line
        file.write(BAD_LINES[-1])
        file.seek(0)
        wrong = subprocess.run(command, stdin=file, capture_output=True, env=agent_env(), timeout=60)
    assert wrong.returncode != 0 and wrong.stdout == b"" and b"Traceback" not in wrong.stderr
    assert b"stdin and stdout must be pipes (a file was given)" in wrong.stderr


DELEGATING = {
    "agents": {
        "orchestrator": {
            "replies": [
                {"tool_calls": [{"name": "subagent", "arguments": {"agent": "scout", "task": "find the entry point"}}]},
                "main.py is the entry point",
            ]
        },
        "scout": {"replies": [{"tool_calls": [{"name": "ls", "arguments": {"path": "."}}]}, "main.py"]},
    }
}


def test_sub_agents_work_shows_under_the_call_that_started_them_and_as_the_plan(
    tmp_path: Path, write_script: Any
) -> None:
    (tmp_path / "main.py").write_text("print(1)\n")
    client = EditorClient()

    async def main() -> Any:
        async with editor(client, "--model", write_script(DELEGATING)) as conn:
            session = await conn.new_session(cwd=str(tmp_path), mcp_servers=[])
            return await conn.prompt(session_id=session.session_id, prompt=[acp.text_block("where does it start?")])

    assert run(main).stop_reason == "end_turn"
    starts = [u for u in client.updates if u.session_update == "tool_call"]
    assert [s.title for s in starts] == ["subagent scout: find the entry point", "scout#1: ls ."]
    delegating, child = starts
    assert child.field_meta["mlx_subagents"]["parentToolCallId"] == delegating.tool_call_id
    plans = [[(e.content, e.status) for e in u.entries] for u in client.updates if u.session_update == "plan"]
    assert plans == [
        [("scout: find the entry point", "pending")],
        [("scout: find the entry point", "in_progress")],
        [("scout: find the entry point", "completed")],
    ]
    work = [
        u
        for u in client.updates
        if u.session_update == "tool_call_update" and u.tool_call_id == delegating.tool_call_id
    ]
    lines = work[-1].content[0].content.text.splitlines()
    assert lines == ["scout#1 started: find the entry point", "scout#1: ls .", "scout#1 completed"]
    assert work[-1].status == "completed" and client.text() == "main.py is the entry point"


def test_a_client_that_goes_away_cancels_its_turn_and_saves_it(tmp_path: Path, write_script: Any) -> None:
    model = write_script({"agents": {"orchestrator": {"replies": [{"content": "I will look", "stall": 60}]}}})
    client = EditorClient()

    async def main() -> None:
        async with editor(client, "--model", model) as conn:
            session = await conn.new_session(cwd=str(tmp_path), mcp_servers=[])
            turn = asyncio.ensure_future(conn.prompt(session_id=session.session_id, prompt=[acp.text_block("look")]))
            await client.wait_for("agent_message_chunk")
        turn.cancel()  # the editor closed its end; the agent saw stdin close

    run(main)
    from mlx_subagents.runs.transcripts import list_runs

    (record,) = list_runs()
    log = read_transcript(record.transcript_path(record.tasks[0]))
    assert record.status == "interrupted" and log.results[-1].status == "aborted"
    assert log.results[-1].error.startswith("the editor went away") and "I will look" in log.results[-1].output


def test_the_clients_mcp_servers_are_offered_after_consent_in_the_editor(
    tmp_path: Path, write_script: Any, preloaded_python: list[str]
) -> None:
    from acp.schema import McpServerStdio

    from tests.tools.test_mcp_tools import SERVER

    script = {"agents": {"scout": {"replies": [
        {"tool_calls": [{"name": "mcp__demo__echo", "arguments": {"text": "from the editor"}}]},
        {"tool_calls": [{"name": "mcp__demo__ask_name", "arguments": {}}]}, "done",
    ]}}}  # fmt: skip
    server = McpServerStdio(name="demo", command=preloaded_python[0], args=[*preloaded_python[1:], SERVER], env=[])
    form = {"name": "Grace", "age": 37, "colour": "green"}
    declined, allowed = EditorClient(answer="reject_once"), EditorClient(answer="allow_once", form=form)

    async def turn(client: EditorClient) -> Any:
        async with editor(client, "--model", write_script(script)) as conn:
            session = await conn.new_session(cwd=str(tmp_path), mcp_servers=[server])
            await conn.set_config_option(config_id="agent", session_id=session.session_id, value="scout")
            try:
                return await conn.prompt(session_id=session.session_id, prompt=[acp.text_block("echo")])
            except acp.RequestError as exc:
                return str(exc)

    refused, answer = run(lambda: turn(declined)), run(lambda: turn(allowed))
    assert "the editor's session starts MCP server(s) demo" in declined.questions[0][0].title
    assert declined.questions[0][1] == ["allow_once", "reject_once"]
    assert "were not allowed to start (declined)" in refused
    assert answer.stop_reason == "end_turn"
    echoed, asked = [u for u in allowed.tool_updates() if u.session_update == "tool_call_update"]
    assert echoed.status == "completed" and echoed.content[-1].content.text == "echo: from the editor"
    # The server's form is the editor's, on the call that asked; what the person filled goes back.
    ((message, mode),) = [request for kind, request in allowed.calls if kind == "form"]
    assert message == "demo: What is your name?" and mode.tool_call_id == asked.tool_call_id
    assert list(mode.requested_schema.properties) == ["name", "age", "colour"]
    assert json.loads(asked.content[-1].content.text) == {"action": "accept", "content": form, "meta": None}


# The tiny real model's agent: `serve_stdio` with forced decoding (the only thing a flag cannot pass).
TINY_AGENT = """
import asyncio, json, sys
from pathlib import Path
from mlx_lm.utils import load_tokenizer
from mlx_subagents.acp.stdio import runner_factory, serve_stdio
from mlx_subagents.runs.options import RunOptions
from mlx_subagents.testing import ForcedScripts

model, scripts = sys.argv[1], json.loads(sys.argv[2])
options = RunOptions(model=model)
asyncio.run(serve_stdio(runner_factory(options, ForcedScripts(load_tokenizer(Path(model)), scripts)), options, "0"))
"""


@pytest.mark.model
def test_load_continues_a_saved_run_on_its_kv_cache(tmp_path: Path, tiny_qwen3_path: Path) -> None:
    first, later = EditorClient(), EditorClient()

    def command(*replies: str) -> list[str]:
        return ["-c", TINY_AGENT, str(tiny_qwen3_path), json.dumps({"scout": list(replies)})]

    async def main() -> tuple[Any, Any, Any]:
        async with editor(first, command=command("app.py is the only file", "still app.py")) as conn:
            session = await conn.new_session(cwd=str(tmp_path), mcp_servers=[])
            await conn.set_config_option(config_id="agent", session_id=session.session_id, value="scout")
            await conn.prompt(session_id=session.session_id, prompt=[acp.text_block("list")])
            again = await conn.prompt(session_id=session.session_id, prompt=[acp.text_block("again")])
        async with editor(later, command=command("third", "fourth")) as conn:
            (saved,) = (await conn.list_sessions(cwd=str(tmp_path))).sessions
            await conn.load_session(cwd=str(tmp_path), session_id=saved.session_id, mcp_servers=[])
            more = await conn.prompt(session_id=saved.session_id, prompt=[acp.text_block("more")])
            most = await conn.prompt(session_id=saved.session_id, prompt=[acp.text_block("and more")])
        return again, more, most

    again, more, most = run(main)
    assert again.usage.cached_read_tokens > 0  # the second turn went on from the first's cache
    shown = [u.content.text for u in later.updates if u.session_update == "agent_message_chunk"]
    assert shown[:2] == ["app.py is the only file", "still app.py"] and "".join(shown[2:]) == "thirdfourth"
    # Loaded in a new process, the conversation is prefilled once; the next turn reuses all of it.
    assert most.usage.cached_read_tokens >= more.usage.input_tokens > more.usage.cached_read_tokens
