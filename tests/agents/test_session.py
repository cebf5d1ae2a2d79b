"""The session tool loop: the tiny real model end to end, errors as observations, limits,
compaction and workspace confinement through real tool calls."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.agents.compaction import SUMMARY_HEADER, CompactionSettings
from mlx_subagents.agents.discovery import discover_agents
from mlx_subagents.agents.limits import Limits
from mlx_subagents.agents.prompt import system_prompt, task_message
from mlx_subagents.agents.session import AgentSession, workspace_for
from mlx_subagents.agents.spec import AgentSpec
from mlx_subagents.events import Event
from mlx_subagents.host import MlxModelHost
from mlx_subagents.host.engine.estimate import approx_tokens
from mlx_subagents.host.protocol import Message
from mlx_subagents.host.scripted import ScriptedHost
from mlx_subagents.results import RunResult
from mlx_subagents.testing import ForcedScripts, tool_call_text
from tests.helpers import call

APP_PY = "import json\n\ndef load_config(path):\n    return json.load(open(path))\n"
SECRET = "hunter2-do-not-leak"
SCOUT_TOOLS = "read, grep, find, ls, bash"


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    """A small project, and a sibling `outside/` holding a secret no tool may show."""
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    (root / "src" / "app.py").write_text(APP_PY)
    (root / "README.md").write_text("# Demo\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text(f"password={SECRET}\n")
    return root


def scout(ws: Path) -> AgentSpec:
    return discover_agents(ws).get("scout")


def run_session(session: AgentSession, task: str = "where is the config parsed?") -> RunResult:
    return asyncio.run(session.run(task))


def after_head(session: AgentSession) -> list[Message]:
    return session.messages[2:]


def assistant_call(name: str, arguments: dict[str, Any], call_id: str) -> Message:
    part = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": "", "tool_calls": [part]}


def tool(name: str, call_id: str, content: str) -> Message:
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


# -- the real model ---------------------------------------------------------------------------


@pytest.mark.slow
def test_scout_end_to_end_on_the_tiny_model(ws: Path, tiny_qwen3_path: Path, tiny_qwen3: Any) -> None:
    answer = "Config is parsed in src/app.py:1-3."
    scripts = ForcedScripts(
        tiny_qwen3[1],
        {
            "scout": [
                tool_call_text("ls", {"path": "."}),
                tool_call_text("read", {"path": "src/app.py"}),
                answer,
            ]
        },
    )
    events: list[Event] = []

    async def go() -> tuple[AgentSession, RunResult]:
        async with MlxModelHost(str(tiny_qwen3_path), processor_factory=scripts) as host:
            session = AgentSession(spec=scout(ws), host=host, workspace=workspace_for(ws), on_event=events.append)
            return session, await session.run("where is the config parsed?")

    session, result = asyncio.run(go())
    assert (result.status, result.stop_reason, result.error) == ("completed", "completed", None)
    assert result.output == answer
    assert (result.agent, result.label, result.model) == ("scout", "scout", str(tiny_qwen3_path))
    assert result.usage.turns == 3
    assert after_head(session) == [
        assistant_call("ls", {"path": "."}, "call_0"),
        tool("ls", "call_0", "README.md\nsrc/"),
        assistant_call("read", {"path": "src/app.py"}, "call_1"),
        tool(
            "read",
            "call_1",
            "     1\timport json\n     2\t\n     3\tdef load_config(path):\n     4\t    return json.load(open(path))",
        ),
        {"role": "assistant", "content": answer},
    ]
    assert [(e.data["name"], e.data["description"]) for e in events if e.kind == "tool_call"] == [
        ("ls", "ls ."),
        ("read", "read src/app.py"),
    ]
    # Usage events are cumulative: each later turn reuses everything the cache held (the
    # previous prompt and reply), so only the tool result and the new turn are prefilled.
    usage = [e.data for e in events if e.kind == "usage"]
    cached = [b["cached_tokens"] - a["cached_tokens"] for a, b in zip([{"cached_tokens": 0}] + usage, usage)]
    assert cached[0] == 0
    assert cached[1:] == [usage[0]["context_tokens"], usage[1]["context_tokens"]]
    assert cached[1] > 0 and result.usage.cached_tokens == sum(cached)
    assert result.usage.kv_bytes > 0
    assert scripts.remaining("scout") == 0


def test_sessions_in_two_workspaces_share_the_prompt_and_tools_prefix(
    tmp_path: Path, tiny_qwen3_path: Path, tiny_qwen3: Any
) -> None:
    # Two clients of one server, or two worktrees: the second session's first turn prefills its task
    # and little else, because no folder is named before the tools.
    roots = [tmp_path / "one" / "repo", tmp_path / "two" / "checkout"]
    for root in roots:
        root.mkdir(parents=True)
        (root / "app.py").write_text(APP_PY)
    scripts = ForcedScripts(tiny_qwen3[1], {"a": ["in app.py"], "b": ["in app.py too"]})

    async def go() -> tuple[list[RunResult], list[AgentSession], int, int]:
        async with MlxModelHost(str(tiny_qwen3_path), processor_factory=scripts) as host:
            sessions = [
                AgentSession(spec=scout(root), host=host, workspace=workspace_for(root), session_name=name)
                for name, root in zip("ab", roots)
            ]
            results = [await s.run("where is the config parsed?") for s in sessions]
            head = await host.count_tokens(sessions[0].messages[:1], sessions[0].schemas)
            task = await host.count_tokens(sessions[1].messages[:2], sessions[1].schemas) - head
            return results, sessions, head, task

    (first, second), sessions, n_head, n_task = asyncio.run(go())
    assert (first.output, second.output) == ("in app.py", "in app.py too")
    assert sessions[0].messages[0] == sessions[1].messages[0]  # one system prompt, no path in it
    assert [s.messages[1]["content"] for s in sessions] == [
        f"Task: where is the config parsed?\n\nWorkspace: {root.resolve()}" for root in roots
    ]
    assert first.usage.cached_tokens == 0
    # All of the prompt and tools came from the first session's cache: only the task was prefilled.
    assert second.usage.cached_tokens >= n_head - 8, (second.usage, n_head)
    assert second.usage.input_tokens - second.usage.cached_tokens <= n_task + 8, (second.usage, n_task)


# -- errors are observations -----------------------------------------------------------------


def test_tool_errors_go_back_to_the_model_and_the_loop_goes_on(ws: Path) -> None:
    host = ScriptedHost.from_replies(
        [
            call("delete", path="src/app.py"),
            call("read", path=123),
            {"raw": '<tool_call>{"name": "ls", "arguments": </tool_call>'},
            call("read", path="missing.py"),
            "Config is parsed in src/app.py:3-4.",
        ],
    )
    session = AgentSession(spec=scout(ws), host=host, workspace=workspace_for(ws))
    result = run_session(session)

    assert (result.status, result.stop_reason, result.usage.turns) == ("completed", "completed", 5)
    assert result.output == "Config is parsed in src/app.py:3-4."
    malformed = (
        "Error: your tool call could not be parsed (tool call is not valid JSON: Expecting value "
        "(line 1 column 29)). Write each call exactly in this format, with the tool's own name and arguments:\n"
        '<tool_call>\n{"name": "tool_name", "arguments": {"argument": "value"}}\n</tool_call>'
    )
    assert after_head(session) == [
        assistant_call("delete", {"path": "src/app.py"}, "call_1"),
        tool("delete", "call_1", f"Error: unknown tool 'delete'; available tools: {SCOUT_TOOLS}"),
        assistant_call("read", {"path": 123}, "call_2"),
        tool(
            "read",
            "call_2",
            "Error: invalid arguments for read: 'path' (string): Input should be a "
            "valid string, got 123; call read again with corrected arguments",
        ),
        {"role": "assistant", "content": '<tool_call>{"name": "ls", "arguments": </tool_call>'},
        {"role": "tool", "content": malformed},
        assistant_call("read", {"path": "missing.py"}, "call_3"),
        tool(
            "read",
            "call_3",
            "Error: path 'missing.py' does not exist in the workspace; use ls or find to see what is there",
        ),
        {"role": "assistant", "content": "Config is parsed in src/app.py:3-4."},
    ]
    # Each error is in the very next prompt the model sees.
    prompts = host.history["scout"]
    assert [p[-1]["content"].split(";")[0] for p in prompts[1:]] == [
        "Error: unknown tool 'delete'",
        "Error: invalid arguments for read: 'path' (string): Input should be a valid string, got 123",
        malformed,
        "Error: path 'missing.py' does not exist in the workspace",
    ]


def test_three_malformed_calls_in_a_row_fail_the_run(ws: Path) -> None:
    bad = {"raw": "<tool_call>not json</tool_call>"}
    # A good call in between resets the count: only the last three in a row end the run.
    host = ScriptedHost.from_replies([bad, bad, call("ls", path="."), bad, bad, bad, "never reached"])
    session = AgentSession(spec=scout(ws), host=host, workspace=workspace_for(ws))
    result = run_session(session)

    assert (result.status, result.stop_reason) == ("failed", "format_errors")
    assert result.error == "3 malformed tool calls in a row"
    assert result.usage.turns == 6 and len(host.history["scout"]) == 6
    errors = [m["content"] for m in session.messages if m["role"] == "tool" and "could not be parsed" in m["content"]]
    assert len(errors) == 5


def test_a_tool_the_agent_was_not_granted_is_refused(ws: Path) -> None:
    host = ScriptedHost.from_replies(
        [
            call("write", path="pwned.txt", content="x"),
            call("edit", path="src/app.py", old_text="json", new_text="yaml"),
            "I cannot write files.",
        ],
    )
    session = AgentSession(spec=scout(ws), host=host, workspace=workspace_for(ws))
    result = run_session(session)

    assert (result.status, result.output) == ("completed", "I cannot write files.")
    assert [s["function"]["name"] for s in session.schemas] == SCOUT_TOOLS.split(", ")
    refusals = [m["content"] for m in session.messages if m["role"] == "tool"]
    assert refusals == [
        f"Error: unknown tool 'write'; available tools: {SCOUT_TOOLS}",
        f"Error: unknown tool 'edit'; available tools: {SCOUT_TOOLS}",
    ]
    assert not (ws / "pwned.txt").exists()
    assert (ws / "src" / "app.py").read_text() == APP_PY
    assert sorted(p.name for p in ws.rglob("*")) == ["README.md", "app.py", "src"]


def test_max_turns_fails_with_the_last_text(ws: Path) -> None:
    host = ScriptedHost.from_replies(
        [
            {"content": "Looking around.", **call("ls", path=".")},
            call("ls", path="src"),
            "never reached",
        ],
    )
    session = AgentSession(spec=scout(ws), host=host, workspace=workspace_for(ws), limits=Limits(max_turns=2))
    result = run_session(session)

    assert (result.status, result.stop_reason) == ("failed", "max_turns")
    assert result.error == "reached the limit of 2 turns without a final answer"
    assert result.output == "Looking around."
    assert result.usage.turns == 2 and len(host.history["scout"]) == 2
    assert session.messages[-1] == tool("ls", "call_2", "app.py")  # the last tool still ran


def test_max_output_tokens_stops_before_the_next_turn(ws: Path) -> None:
    host = ScriptedHost.from_replies([call("ls", path="."), call("ls", path="src"), "never reached"])
    per_reply = approx_tokens([assistant_call("ls", {"path": "."}, "call_1")])
    limits = Limits(max_output_tokens=per_reply + 1)
    session = AgentSession(spec=scout(ws), host=host, workspace=workspace_for(ws), limits=limits)
    result = run_session(session)

    assert (result.status, result.stop_reason) == ("failed", "max_tokens")
    assert result.error == f"reached the limit of {per_reply + 1} generated tokens"
    # Two replies reached the model; the third turn was refused before it started.
    assert result.usage.turns == 2 and len(host.history["scout"]) == 2
    assert result.usage.output_tokens == 2 * per_reply


def test_a_reply_cut_by_the_token_budget_is_not_a_final_answer(ws: Path) -> None:
    cut = "Config is parsed in src/app.py, in the function load_config, which"
    host = ScriptedHost.from_replies([{"content": cut, "finish_reason": "length"}])
    session = AgentSession(spec=scout(ws), host=host, workspace=workspace_for(ws), limits=Limits(max_output_tokens=10))
    result = run_session(session)

    assert (result.status, result.stop_reason, result.output) == ("failed", "max_tokens", cut)
    assert result.usage.turns == 1


def test_an_answer_cut_by_the_per_reply_limit_fails_with_the_partial_text(ws: Path) -> None:
    cut = "Config is parsed in src/app.py, in the function"
    host = ScriptedHost.from_replies([{"content": cut, "finish_reason": "length"}])
    session = AgentSession(spec=scout(ws), host=host, workspace=workspace_for(ws), limits=Limits(max_reply_tokens=64))
    result = run_session(session)

    assert (result.status, result.stop_reason, result.output) == ("failed", "max_tokens", cut)
    assert result.error == (
        "the final answer was cut at the per-reply limit of 64 tokens; the output holds the partial text"
    )


def test_an_answer_cut_by_the_full_context_window_says_the_window_ran_out(ws: Path) -> None:
    """The host stops a reply where the window ends: that is not the per-reply limit of 2,048 tokens."""
    cut = "The config is parsed in " + "src/app.py and " * 60 + "tests"
    host = ScriptedHost.from_replies([{"content": cut, "finish_reason": "length"}], context_window=512)
    spec = scout(ws).model_copy(update={"tools": []})
    session = AgentSession(spec=spec, host=host, workspace=workspace_for(ws))
    result = run_session(session)

    assert (result.status, result.stop_reason, result.output) == ("failed", "context_window", cut)  # was max_tokens
    prompt = result.usage.input_tokens  # one turn: its prompt
    assert prompt < 512 <= prompt + result.usage.output_tokens
    assert result.error is not None and result.error.startswith(
        f"the context window of 512 tokens ran out during the final answer (the conversation took {prompt} of them); "
    )
    assert result.error.endswith(
        "the output holds the partial text; give the task less to read or fewer turns, or a model "
        "with a longer window (--context-window, as far as the KV budget allows)"
    )
    assert "per-reply limit" not in result.error


def test_running_out_of_script_fails_the_session_not_the_process(ws: Path) -> None:
    host = ScriptedHost.from_replies([call("ls", path=".")])
    session = AgentSession(spec=scout(ws), host=host, workspace=workspace_for(ws))
    result = run_session(session)

    assert (result.status, result.stop_reason) == ("failed", "error")
    assert result.error == (
        "scripted model: session 'scout' (agent 'scout') has no reply left after 1 replies in the in-memory script"
    )
    assert session.messages[-1] == tool("ls", "call_1", "README.md\nsrc/")


def test_an_unimplemented_granted_tool_is_not_offered(ws: Path) -> None:
    spec = scout(ws).model_copy(update={"tools": ("read", "subagent")})
    session = AgentSession(spec=spec, host=ScriptedHost.from_replies(["ok"]), workspace=workspace_for(ws))
    assert list(session.tools) == ["read"]


# -- compaction -------------------------------------------------------------------------------


def test_compaction_on_a_small_window_keeps_the_head_and_completes(ws: Path) -> None:
    big = "".join(f"line {i:03d}: settings value number {i} for the config parser\n" for i in range(200))
    (ws / "big.txt").write_text(big)
    reads = [call("read", path="big.txt", offset=1 + 20 * i, limit=20) for i in range(3)]
    summary = "## Goal\nFind the config parser.\n## Progress\nRead big.txt lines 1-40."
    host = ScriptedHost.from_replies(
        [reads[0], reads[1], summary, reads[2], summary, "Done: big.txt:1-60."], context_window=2000
    )
    events: list[Event] = []
    heads: list[str] = []
    session: AgentSession

    def on_event(event: Event) -> None:
        events.append(event)
        if event.kind in ("turn_start", "compaction"):
            heads.append(json.dumps(session.messages[:2]))

    session = AgentSession(
        spec=scout(ws),
        host=host,
        workspace=workspace_for(ws),
        on_event=on_event,
        compaction=CompactionSettings(keep_recent_tokens=400),
    )
    assert (session.compaction.reserve_tokens, session.compaction.keep_recent_tokens) == (500, 400)
    result = run_session(session, "find the config parser")

    assert (result.status, result.output) == ("completed", "Done: big.txt:1-60.")
    compactions = [e.data for e in events if e.kind == "compaction"]
    # The second summary folds in the first one.
    assert [c["n_summarized"] for c in compactions] == [2, 3]
    assert all(c["tokens_after"] < c["tokens_before"] for c in compactions)
    assert result.usage.compactions == 2 and result.usage.turns == 4
    head = [
        {"role": "system", "content": system_prompt(session.spec)},
        {"role": "user", "content": task_message("find the config parser", session.workspace)},
    ]
    assert len(heads) == 6 and set(heads) == {json.dumps(head)}
    # Every request, the two summary requests included, starts with the same head.
    prompts = host.history["scout"]
    assert len(prompts) == 6 and all(p[:2] == head for p in prompts)
    assert prompts[2][-1]["content"].startswith("Transcript of the earlier turns of this task:")
    assert session.messages[2] == {"role": "user", "content": SUMMARY_HEADER + summary}
    assert session.messages[3:] == [
        assistant_call("read", {"path": "big.txt", "offset": 41, "limit": 20}, "call_3"),
        session.messages[4],
        {"role": "assistant", "content": "Done: big.txt:1-60."},
    ]
    assert session.messages[4]["content"].startswith("    41\tline 040:")
    # The summary request and the turn after it each reuse the head (and only the head) the request
    # before left in the cache: the cumulative count grows by twice the head between those turns.
    head_tokens = approx_tokens(head, session.schemas)
    cached = [e.data["cached_tokens"] for e in events if e.kind == "usage"]
    assert [cached[2] - cached[1], cached[3] - cached[2]] == [2 * head_tokens] * 2


@pytest.mark.slow
def test_a_summary_cut_by_a_timeout_still_counts_the_prompt_it_read(ws: Path) -> None:
    (ws / "big.txt").write_text("".join(f"line {i:03d}: a value for the config parser\n" for i in range(200)))
    reads = [call("read", path="big.txt", offset=1 + 20 * i, limit=20) for i in range(2)]
    host = ScriptedHost.from_replies([*reads, {"content": "never delivered", "delay": 300}], context_window=2000)
    events: list[Event] = []
    session = AgentSession(
        spec=scout(ws),
        host=host,
        workspace=workspace_for(ws),
        on_event=events.append,
        compaction=CompactionSettings(keep_recent_tokens=400),
    )

    async def cut_during_the_summary() -> None:  # the timeout strikes as a cancel, as `wait_for`'s does
        work = asyncio.create_task(session.run("find the config parser"))
        while len(host.history.get("scout", [])) < 3:  # the summary request is sent: its reply is under way
            await asyncio.sleep(0.01)
        work.cancel()
        await work

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(asyncio.wait_for(cut_during_the_summary(), 60))
    result = session.partial_result("find the config parser", "timeout", "stopped by the timeout of 1s")

    prompts = host.history["scout"]
    assert len(prompts) == 3 and prompts[2][-1]["content"].startswith("Transcript of the earlier turns of this task:")
    read = [approx_tokens(p, session.schemas) for p in prompts]
    # Every prompt the model read counts, the summary request cut during its reply included.
    assert (result.usage.turns, result.usage.compactions) == (2, 0)
    assert result.usage.input_tokens == sum(read)
    usage = [e.data for e in events if e.kind == "usage"]
    assert [u["input_tokens"] for u in usage] == [read[0], read[0] + read[1], sum(read)]
    assert usage[-1]["output_tokens"] == usage[-2]["output_tokens"] == result.usage.output_tokens
    assert result.usage.context_tokens == read[2]  # the summary request is what the cache last held


# -- confinement ------------------------------------------------------------------------------


def test_paths_outside_the_workspace_are_refused_and_nothing_leaks(tmp_path: Path, ws: Path) -> None:
    secret = tmp_path / "outside" / "secret.txt"
    (ws / "link.txt").symlink_to(secret)
    (ws / "outside_dir").symlink_to(secret.parent, target_is_directory=True)
    attempts = [
        ("read", {"path": "../outside/secret.txt"}),
        ("read", {"path": str(secret)}),
        ("read", {"path": "link.txt"}),
        ("read", {"path": "outside_dir/secret.txt"}),
        ("ls", {"path": "outside_dir"}),
        ("grep", {"pattern": "password", "path": "link.txt"}),
        ("grep", {"pattern": "password"}),  # the walk does not follow links
        ("find", {"pattern": "*.txt", "path": ".."}),
    ]
    host = ScriptedHost.from_replies([call(n, **a) for n, a in attempts] + ["Nothing outside."])
    events: list[Event] = []
    session = AgentSession(spec=scout(ws), host=host, workspace=workspace_for(ws), on_event=events.append)
    result = run_session(session)

    assert (result.status, result.usage.turns) == ("completed", 9)
    results = [m["content"] for m in session.messages if m["role"] == "tool"]
    root = ws.resolve()
    assert results == [
        f"Error: path '../outside/secret.txt' is outside the workspace {root}; use a path inside it",
        f"Error: path '{secret}' is outside the workspace {root}; use a path inside it",
        f"Error: path 'link.txt' is outside the workspace {root} (it is a symlink to {secret.resolve()}); "
        "use a path inside it",
        f"Error: path 'outside_dir/secret.txt' is outside the workspace {root} (it is a symlink to "
        f"{secret.resolve()}); use a path inside it",
        f"Error: path 'outside_dir' is outside the workspace {root} (it is a symlink to "
        f"{secret.parent.resolve()}); use a path inside it",
        f"Error: path 'link.txt' is outside the workspace {root} (it is a symlink to {secret.resolve()}); "
        "use a path inside it",
        "No matches for 'password' in .",
        f"Error: path '..' is outside the workspace {root}; use a path inside it",
    ]
    everything = json.dumps(session.messages) + json.dumps([e.to_json() for e in events])
    assert SECRET not in everything
    assert SECRET not in result.model_dump_json()


def test_every_host_event_has_one_reader_that_makes_it_the_agents_event() -> None:
    """A new host event is one class in `HostEvent` (host/protocol.py), one place a host emits it, and one
    reader: the agent session's `Streamed` (agents/streamed.py), which turns each kind into the agent's own event. A kind it
    does not read is lost, and fails here."""
    from dataclasses import fields
    from typing import get_args

    from mlx_subagents.agents.streamed import Decoding, Streamed
    from mlx_subagents.host.protocol import HostEvent

    emitted: list[tuple[str, Any]] = []
    streamed = Streamed(
        lambda kind, data: emitted.append((kind, data)), None, Decoding(lambda n, tps: emitted.append(("decode", n)))
    )
    kinds = []
    for event_class in get_args(HostEvent):
        values = ["piece" if f.type == "str" else 3 for f in fields(event_class) if f.name != "kind"]
        event = event_class(*values)
        kinds.append(event.kind)
        before = len(emitted)
        streamed(event)
        assert len(emitted) == before + 1, event
    assert kinds == ["text", "reasoning", "prefill", "tokens"]
    assert [kind for kind, _ in emitted] == ["text", "reasoning", "prefill", "decode"]
    assert (streamed.text, streamed.reasoning, emitted[2][1]["tokens"], emitted[3][1]) == (["piece"], ["piece"], 3, 3)
