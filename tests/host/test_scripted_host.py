"""The scripted host: replay order, per-agent scripts, errors and usage accounting."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from mlx_subagents.errors import PromptTooLongError, ScriptError
from mlx_subagents.host.calls.formats.hermes import hermes
from mlx_subagents.host.engine.estimate import approx_tokens
from mlx_subagents.host.protocol import GenerateArgs, HostSession, MalformedToolCall, ModelHost, Reply, ToolCall
from mlx_subagents.host.scripted import ScriptedHost
from tests.helpers import texts

TASK = [{"role": "system", "content": "You are a scout."}, {"role": "user", "content": "Look."}]


def write_json(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def gen(session: HostSession, messages: list[dict] = TASK, *, tools: list[dict] | None = None, **args) -> Reply:
    return asyncio.run(session.generate(messages, GenerateArgs(**args), tools=tools))


def test_protocols_and_basics(tmp_path: Path) -> None:
    path = write_json(tmp_path / "s.json", {"replies": ["hi"], "context_window": 4096})
    host = ScriptedHost(path)
    assert isinstance(host, ModelHost)
    assert host.model_id == f"scripted:{path}"
    assert host.context_window == 4096
    assert ScriptedHost(path, context_window=1000).context_window == 1000
    session = host.session("s1", agent="scout")
    assert isinstance(session, HostSession)
    assert session.name == "s1"
    assert session.kv_bytes == 0
    asyncio.run(host.start())
    asyncio.run(host.stop())
    assert ScriptedHost.from_model_id(f"scripted:{path}").path == path


def test_default_context_window(tmp_path: Path) -> None:
    assert ScriptedHost(write_json(tmp_path / "s.json", ["x"])).context_window == 32768


def test_replies_in_order_and_tool_calls(tmp_path: Path) -> None:
    path = write_json(
        tmp_path / "s.json",
        {
            "replies": [
                {"tool_calls": [{"name": "ls", "arguments": {"path": "."}}]},
                {
                    "content": "two calls",
                    "tool_calls": [
                        {"name": "read", "arguments": {"path": "a.py"}},
                        {"name": "grep", "arguments": '{"pattern": "auth"}'},
                    ],
                },
                {"content": "done"},
            ]
        },
    )
    session = ScriptedHost(path).session("main")
    first = gen(session)
    assert first.text == ""
    assert first.tool_calls == [ToolCall("ls", {"path": "."}, id="call_1")]
    assert first.malformed_tool_calls == []
    assert first.finish_reason == "stop"
    assert first.raw_text == '<tool_call>{"name": "ls", "arguments": {"path": "."}}</tool_call>'
    second = gen(session)
    assert second.text == "two calls"
    assert second.tool_calls == [
        ToolCall("read", {"path": "a.py"}, id="call_2"),
        ToolCall("grep", {"pattern": "auth"}, id="call_3"),
    ]
    assert second.to_message()["tool_calls"][0] == {
        "id": "call_2",
        "type": "function",
        "function": {"name": "read", "arguments": {"path": "a.py"}},
    }
    third = gen(session)
    assert (third.text, third.tool_calls) == ("done", [])


def test_per_agent_script_and_fallback(tmp_path: Path) -> None:
    path = write_json(
        tmp_path / "s.json",
        {
            "replies": ["fallback 1", "fallback 2"],
            "agents": {"scout": {"replies": ["scout 1"]}, "planner": {"replies": ["plan"]}},
        },
    )
    host = ScriptedHost(path)
    assert gen(host.session("a", agent="scout")).text == "scout 1"
    assert gen(host.session("b", agent="planner")).text == "plan"
    worker = host.session("c", agent="worker")
    assert [gen(worker).text, gen(worker).text] == ["fallback 1", "fallback 2"]
    assert gen(host.session("d")).text == "fallback 1"


def test_independent_cursors_for_sessions_of_one_agent(tmp_path: Path) -> None:
    path = write_json(tmp_path / "s.json", {"agents": {"scout": {"replies": ["one", "two"]}}})
    host = ScriptedHost(path)
    a, b = host.session("a", agent="scout"), host.session("b", agent="scout")
    assert gen(a).text == "one"
    assert gen(b).text == "one"
    assert gen(a).text == "two"
    assert gen(b).text == "two"


def test_raw_reply_is_a_malformed_tool_call(tmp_path: Path) -> None:
    raw = "<tool_call>not json</tool_call>"
    session = ScriptedHost(write_json(tmp_path / "s.json", [{"raw": raw}])).session("m")
    result = gen(session)
    assert result.text == ""
    assert result.tool_calls == []
    assert result.raw_text == raw
    assert result.malformed_tool_calls == [
        MalformedToolCall(raw, hermes().error("tool call is not valid JSON: Expecting value (line 1 column 1)"))
    ]


def test_running_out_raises_exact_message(tmp_path: Path) -> None:
    path = write_json(tmp_path / "s.json", {"agents": {"scout": {"replies": ["a", "b"]}}})
    session = ScriptedHost(path).session("s7", agent="scout")
    gen(session)
    gen(session)
    with pytest.raises(ScriptError) as info:
        gen(session)
    assert str(info.value) == (
        f"scripted model: session 's7' (agent 'scout') has no reply left after 2 replies in {path}"
    )


def test_yaml_and_json_give_the_same_replies(tmp_path: Path) -> None:
    data = {
        "replies": [{"tool_calls": [{"name": "ls", "arguments": {"path": "."}}]}, "done"],
        "agents": {"scout": {"replies": [{"content": "scouted"}]}},
    }
    yaml_path = tmp_path / "s.yml"
    yaml_path.write_text(
        "replies:\n"
        "  - tool_calls: [{name: ls, arguments: {path: .}}]\n"
        "  - done\n"
        "agents:\n"
        "  scout:\n"
        "    replies:\n"
        "      - content: scouted\n",
        encoding="utf-8",
    )
    for path in (write_json(tmp_path / "s.json", data), yaml_path):
        host = ScriptedHost(path)
        main = host.session("main")
        assert gen(main).tool_calls == [ToolCall("ls", {"path": "."}, id="call_1")]
        assert gen(main).text == "done"
        assert gen(host.session("x", agent="scout")).text == "scouted"
    (tmp_path / "s.yaml").write_text("- only\n", encoding="utf-8")
    assert gen(ScriptedHost(tmp_path / "s.yaml").session("y")).text == "only"


@pytest.mark.parametrize(
    ("name", "text", "problem"),
    [
        ("bad.json", "{", "invalid JSON at line 1 column 2: Expecting property name"),
        ("bad.yaml", "replies: [", "invalid YAML at line 1 column 11: expected the node content"),
        ("top.json", '"hello"', "expected a mapping with 'replies' and/or 'agents'"),
        ("empty.json", "{}", "the script has no replies"),
        ("field.json", '{"replies": [{"contnet": "x"}]}', "replies[0].contnet: Extra inputs"),
        (
            "call.json",
            '{"agents": {"scout": {"replies": [{"tool_calls": [{"arguments": {}}]}]}}}',
            "agents.scout.replies[0].tool_calls[0].name: Field required",
        ),
        ("raw.json", '[{"raw": "x", "content": "y"}]', "replies[0]: 'raw' cannot be combined"),
        ("delay.json", '[{"content": "x", "delay": -1}]', "replies[0].delay: Input should be"),
        ("window.json", '{"replies": ["x"], "context_window": 0}', "context_window: Input"),
    ],
)
def test_malformed_file_names_the_file(tmp_path: Path, name: str, text: str, problem: str) -> None:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ScriptError) as info:
        ScriptedHost(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert problem in message
    assert "\n" not in message


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(ScriptError, match=r"nope\.json: cannot read the scripted model file"):
        ScriptedHost(path)


def test_on_text_receives_the_content(tmp_path: Path) -> None:
    session = ScriptedHost(write_json(tmp_path / "s.json", ["hello", {"raw": "x"}])).session("t")
    seen: list[str] = []
    gen(session, on_event=texts(seen.append))
    gen(session, on_event=texts(seen.append))
    assert seen == ["hello"]


def test_usage_counts_cached_prefix(tmp_path: Path) -> None:
    path = write_json(tmp_path / "s.json", [{"tool_calls": [{"name": "ls", "arguments": {}}]}, "done"])
    session = ScriptedHost(path).session("u")
    tools = [{"type": "function", "function": {"name": "ls"}}]
    first = gen(session, TASK, tools=tools)
    prompt = approx_tokens(TASK, tools)
    assert first.usage.prompt_tokens == prompt
    assert (first.usage.cached_tokens, first.usage.prefilled_tokens) == (0, prompt)
    assert first.usage.generated_tokens == approx_tokens([first.to_message()])

    result = {"role": "tool", "tool_call_id": "call_1", "content": "a.py"}
    messages = [*TASK, first.to_message(), result]
    second = gen(session, messages, tools=tools)
    assert second.usage.prompt_tokens == approx_tokens(messages, tools)
    assert second.usage.cached_tokens == approx_tokens(messages[:3], tools)
    assert second.usage.prefilled_tokens == approx_tokens(messages, tools) - approx_tokens(messages[:3], tools)


def test_usage_changed_tools_or_history_is_not_cached(tmp_path: Path) -> None:
    session = ScriptedHost(write_json(tmp_path / "s.json", ["a", "b", "c"])).session("u")
    gen(session, TASK)
    other_tools = gen(session, TASK, tools=[{"type": "function", "function": {"name": "x"}}])
    assert other_tools.usage.cached_tokens == 0
    edited = [{"role": "system", "content": "changed"}, TASK[1]]
    assert gen(session, edited).usage.cached_tokens == 0


def test_approx_tokens_formula() -> None:
    message = {"role": "user", "content": "x" * 100}
    rendered = '{"content":"' + "x" * 100 + '","role":"user"}'
    assert approx_tokens([message]) == len(rendered) // 4 + 1
    assert approx_tokens([message, message]) == 2 * (len(rendered) // 4 + 1)
    assert approx_tokens([]) == 0


def test_count_tokens_matches_approx(tmp_path: Path) -> None:
    host = ScriptedHost(write_json(tmp_path / "s.json", ["x"]))
    tools = [{"type": "function", "function": {"name": "ls"}}]
    assert asyncio.run(host.count_tokens(TASK)) == approx_tokens(TASK)
    assert asyncio.run(host.count_tokens(TASK, tools)) == approx_tokens(TASK, tools)


def test_prompt_too_long(tmp_path: Path) -> None:
    host = ScriptedHost(write_json(tmp_path / "s.json", ["x"]), context_window=10)
    with pytest.raises(PromptTooLongError, match="does not fit the context window of 10 tokens"):
        gen(host.session("p"), [{"role": "user", "content": "y" * 100}])


def test_delay_cancellation_keeps_the_reply(tmp_path: Path) -> None:
    path = write_json(tmp_path / "s.json", [{"content": "slow", "delay": 0.2}, "fast"])
    session = ScriptedHost(path).session("d")

    async def scenario() -> list[str]:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(session.generate(TASK), timeout=0.01)
        # The cancelled call consumed nothing: the same reply comes next, then the rest.
        return [(await session.generate(TASK)).text, (await session.generate(TASK)).text]

    assert asyncio.run(scenario()) == ["slow", "fast"]


def test_delays_run_concurrently_across_sessions(tmp_path: Path) -> None:
    path = write_json(tmp_path / "s.json", [{"content": "x", "delay": 0.2}])
    host = ScriptedHost(path)

    async def scenario() -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        results = await asyncio.gather(*(host.session(f"s{i}").generate(TASK) for i in range(4)))
        assert [r.text for r in results] == ["x"] * 4
        return loop.time() - started

    assert asyncio.run(scenario()) < 0.75  # one after another would take at least 0.8 s


def test_one_generation_at_a_time_per_session(tmp_path: Path) -> None:
    path = write_json(tmp_path / "s.json", [{"content": "x", "delay": 0.1}, "y"])
    session = ScriptedHost(path).session("busy")

    async def scenario() -> None:
        first = asyncio.create_task(session.generate(TASK))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="already generating"):
            await session.generate(TASK)
        assert (await first).text == "x"

    asyncio.run(scenario())


def test_closed_session_refuses(tmp_path: Path) -> None:
    session = ScriptedHost(write_json(tmp_path / "s.json", ["x"])).session("c")
    asyncio.run(session.close())
    with pytest.raises(RuntimeError, match="closed"):
        gen(session)


# -- in memory -------------------------------------------------------------------------------------


def test_from_replies_serves_the_same_replies_as_a_file() -> None:
    host = ScriptedHost.from_replies(
        [{"tool_calls": [{"name": "ls", "arguments": {"path": "."}}]}, "done"],
        agents={"scout": ["scouted"]},
        context_window=4096,
    )
    assert isinstance(host, ModelHost)
    assert (host.model_id, host.path, host.context_window) == ("scripted:memory", None, 4096)
    main = host.session("main")
    assert gen(main).tool_calls == [ToolCall("ls", {"path": "."}, id="call_1")]
    assert gen(main).text == "done"
    assert gen(host.session("x", agent="scout")).text == "scouted"
    assert ScriptedHost.from_replies(["x"]).context_window == 32768
    with pytest.raises(ScriptError) as info:
        gen(main)
    assert str(info.value) == (
        "scripted model: session 'main' (agent 'None') has no reply left after 2 replies in the in-memory script"
    )


@pytest.mark.parametrize(
    ("replies", "agents", "message"),
    [
        ([{"contnet": "x"}], None, "scripted replies: replies[0].contnet: Extra inputs are not permitted"),
        ([], {"scout": []}, "scripted replies: the script has no replies: add 'replies' or 'agents.<name>.replies'"),
        ([], {"scout": [{"tool_calls": [{}]}]}, "scripted replies: agents.scout.replies[0].tool_calls[0].name: Field"),
    ],
)
def test_from_replies_refuses_bad_replies_in_one_line(replies: list, agents: dict | None, message: str) -> None:
    with pytest.raises(ScriptError) as info:
        ScriptedHost.from_replies(replies, agents=agents)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_history_records_what_each_session_was_sent() -> None:
    host = ScriptedHost.from_replies(["one", "two"])
    a, b = host.session("a"), host.session("b")
    conversation = [*TASK]
    gen(a, conversation)
    conversation.append({"role": "user", "content": "More."})  # a later change is not rewritten into the record
    gen(b, conversation)
    gen(a, conversation)
    with pytest.raises(ScriptError):
        gen(a, TASK)  # out of replies: still sent, so still recorded
    assert host.history == {"a": [TASK, conversation, TASK], "b": [conversation]}
    assert host.history["a"][0] is not TASK
