"""`EngineHost` against the fake OpenAI-compatible engine (real HTTP on 127.0.0.1, real `openai`
client): streaming, tool calls through an agent session with real tools, cached-token usage,
the context window, and every fault with its one-line message and bounded retries."""

from __future__ import annotations

import asyncio
import importlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.agents.discovery import discover_agents
from mlx_subagents.agents.session import AgentSession, workspace_for
from mlx_subagents.errors import EngineError, PromptTooLongError, SubagentError
from mlx_subagents.host.engine.engine_host import EngineHost, engine_url
from mlx_subagents.host.engine.estimate import approx_tokens
from mlx_subagents.host.protocol import DEFAULT_CONTEXT_WINDOW, GenerateArgs
from mlx_subagents.testing.fake_engine import FAKE_MODEL, FakeEngine, Fault, Reply
from tests.helpers import REPO, texts

USER = [{"role": "user", "content": "Task: list the files"}]
LS = {"name": "ls", "arguments": {"path": "."}}
# Tells the client to retry after 10 ms instead of its default backoff, to keep the tests fast.
RETRY_SOON = (("retry-after-ms", "10"),)


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    with FakeEngine() as fake:
        yield fake


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


async def generate(
    host: EngineHost, messages: list[dict[str, Any]] = USER, *, tools: list[Any] | None = None, **args: Any
) -> Any:
    async with host:
        return await host.session("s").generate(messages, GenerateArgs(**args), tools=tools)


def failure(host: EngineHost, *, start_only: bool = False) -> str:
    async def go() -> None:
        if start_only:
            await host.start()
        else:
            await generate(host)

    with pytest.raises(SubagentError) as info:
        run(go())
    return str(info.value)


# --- streaming and usage ------------------------------------------------------------------------


def test_a_reply_streams_its_text_and_reports_the_engines_usage(engine: FakeEngine) -> None:
    engine.queue(Reply("The files are a.py and b.py.", prompt_tokens=120, cached_tokens=96, completion_tokens=9))
    pieces: list[str] = []
    reply = run(generate(EngineHost(engine.url, FAKE_MODEL), on_event=texts(pieces.append), max_tokens=50))
    assert pieces == ["The ", "file", "s ar", "e a.", "py a", "nd b", ".py."]
    assert reply.text == "The files are a.py and b.py."
    assert reply.finish_reason == "stop" and reply.tool_calls == []
    usage = reply.usage
    assert (usage.prompt_tokens, usage.cached_tokens, usage.prefilled_tokens, usage.generated_tokens) == (
        120,
        96,
        24,
        9,
    )
    body = engine.chat_requests()[0].body
    assert body["model"] == FAKE_MODEL and body["max_tokens"] == 50 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and "tools" not in body


def test_reasoning_content_deltas_stay_apart_from_the_text(engine: FakeEngine) -> None:
    engine.queue(Reply("It is a.py.", reasoning="Look at the list.", tool_calls=()))
    text: list[str] = []
    thought: list[str] = []
    reply = run(generate(EngineHost(engine.url, FAKE_MODEL), on_event=texts(text.append, thought.append)))
    assert (reply.text, reply.reasoning) == ("It is a.py.", "Look at the list.")
    assert "".join(text) == "It is a.py." and "".join(thought) == "Look at the list."
    assert reply.to_message()["reasoning_content"] == "Look at the list."


def test_a_reply_cut_by_the_token_limit_says_length(engine: FakeEngine) -> None:
    engine.queue(Reply("partial", finish_reason="length"))
    assert run(generate(EngineHost(engine.url, FAKE_MODEL))).finish_reason == "length"


def test_streamed_tool_call_deltas_are_assembled_and_the_schemas_are_sent(engine: FakeEngine) -> None:
    engine.queue(Reply("", tool_calls=(LS, {"name": "read", "arguments": {"path": "a.py", "limit": 5}})))
    schema = {"type": "function", "function": {"name": "ls", "description": "list", "parameters": {}}}
    reply = run(generate(EngineHost(engine.url, FAKE_MODEL), tools=[schema]))
    assert [(c.name, c.arguments, c.id) for c in reply.tool_calls] == [
        ("ls", {"path": "."}, "call_fake_0"),
        ("read", {"path": "a.py", "limit": 5}, "call_fake_1"),
    ]
    assert engine.chat_requests()[0].body["tools"] == [schema]


def test_tool_choice_top_p_and_a_seed_are_sent_as_openai_names_them(engine: FakeEngine) -> None:
    tool = {"type": "function", "function": {"name": "ls", "description": "list", "parameters": {}}}

    async def go() -> None:
        async with EngineHost(engine.url, FAKE_MODEL) as host:
            for args in ({}, {"tool_choice": "required", "top_p": 0.5, "seed": 7}, {"tool_choice": "ls"}):
                engine.queue(Reply("", tool_calls=(LS,)))
                await host.session("s").generate(USER, GenerateArgs(**args), tools=[tool])

    run(go())
    sent = [{k: r.body.get(k) for k in ("tool_choice", "top_p", "seed")} for r in engine.chat_requests()]
    assert sent == [
        {"tool_choice": None, "top_p": None, "seed": None},
        {"tool_choice": "required", "top_p": 0.5, "seed": 7},
        {"tool_choice": {"type": "function", "function": {"name": "ls"}}, "top_p": None, "seed": None},
    ]


def test_an_answer_schema_goes_as_response_format_only_with_the_grammar_on_and_no_tools(engine: FakeEngine) -> None:
    schema = {"type": "object", "properties": {"files": {"type": "array"}}, "required": ["files"]}
    tool = {"type": "function", "function": {"name": "ls", "description": "list", "parameters": {}}}
    cases = [({"answer_schema": schema}, None), ({"answer_schema": schema, "grammar": False}, None), ({}, None)]
    cases.append(({"answer_schema": schema}, [tool]))  # a call is the engine's parser's to read, not a format's
    for args, tools in cases:
        engine.queue(Reply('{"files": []}'))
        reply = run(generate(EngineHost(engine.url, FAKE_MODEL), tools=tools, **args))
        assert reply.text == '{"files": []}'
    sent = [r.body.get("response_format") for r in engine.chat_requests()]
    assert sent == [
        {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
        None,
        None,
        None,
    ]


def test_calls_written_as_text_are_parsed_and_never_shown(engine: FakeEngine) -> None:
    markup = '<tool_call>{"name": "ls", "arguments": {"path": "src"}}</tool_call>'
    engine.queue(Reply(f"Looking.{markup} Done", chunk=3), Reply('Again <tool_call>{"name": ls}</tool_call>'))
    pieces: list[str] = []

    async def two_turns() -> tuple[Any, Any]:
        async with EngineHost(engine.url, FAKE_MODEL) as host:
            session = host.session("s")
            return await session.generate(USER, GenerateArgs(on_event=texts(pieces.append))), await session.generate(
                USER
            )

    good, bad = run(two_turns())
    assert "".join(pieces) == "Looking. Done"
    assert good.text == "Looking. Done"
    assert [(c.name, c.arguments) for c in good.tool_calls] == [("ls", {"path": "src"})]
    assert bad.tool_calls == [] and bad.malformed_tool_calls[0].raw == '<tool_call>{"name": ls}</tool_call>'
    assert bad.malformed_tool_calls[0].error.startswith(
        "Error: your tool call could not be parsed (JSONDecodeError: Expecting value"
    )
    assert bad.malformed_tool_calls[0].error.endswith(
        '{"name": "tool_name", "arguments": {"argument": "value"}}\n</tool_call>'
    )


def test_engine_tool_call_arguments_that_are_not_json_come_back_as_an_error_to_fix(engine: FakeEngine) -> None:
    engine.queue(Reply(tool_calls=({"name": "ls", "arguments": "{'path': '.'}"},)))
    reply = run(generate(EngineHost(engine.url, FAKE_MODEL)))
    assert reply.tool_calls == []
    (bad,) = reply.malformed_tool_calls
    assert bad.error == (
        "Error: the arguments of your call to ls are not a JSON object (JSONDecodeError: Expecting property name "
        "enclosed in double quotes: line 1 column 2 (char 1)). Call the tool again with its arguments as one JSON "
        "object."
    )


def test_an_agent_runs_real_tools_on_engine_tool_calls_and_messages_stay_byte_stable(
    engine: FakeEngine, tmp_path: Path
) -> None:
    (tmp_path / "notes.txt").write_text("alpha\nbeta\n")
    engine.queue(
        Reply("", tool_calls=({"name": "read", "arguments": {"path": "notes.txt"}},), prompt_tokens=300),
        Reply("", tool_calls=({"name": "write", "arguments": {"path": "out.txt", "content": "gamma\n"}},)),
        Reply("Copied: out.txt holds gamma.", prompt_tokens=420, cached_tokens=380),
    )
    spec = discover_agents(tmp_path).get("worker")

    async def go() -> Any:
        async with EngineHost(engine.url, FAKE_MODEL) as host:
            return await AgentSession(spec, host, workspace_for(tmp_path)).run("copy the notes")

    result = run(go())
    assert result.status == "completed" and result.output == "Copied: out.txt holds gamma."
    assert (tmp_path / "out.txt").read_text() == "gamma\n"
    first, second, third = (r.body["messages"] for r in engine.chat_requests())
    assert second[: len(first)] == first and third[: len(second)] == second  # the engine's prefix cache hits
    assert second[-2]["tool_calls"] == [
        {"id": "call_fake_0", "type": "function", "function": {"name": "read", "arguments": '{"path": "notes.txt"}'}}
    ]
    assert second[-1] == {"role": "tool", "tool_call_id": "call_fake_0", "content": second[-1]["content"]}
    assert "alpha" in second[-1]["content"] and "beta" in second[-1]["content"]
    assert result.usage.turns == 3 and result.usage.cached_tokens == 380


def test_concurrent_sessions_send_their_requests_at_once(engine: FakeEngine) -> None:
    for i in range(4):
        engine.queue(Reply(f"answer {i}", together=4), when=f"task {i}")

    async def go() -> list[Any]:
        async with EngineHost(engine.url, FAKE_MODEL) as host:
            replies = [host.session(f"c{i}").generate([{"role": "user", "content": f"task {i}"}]) for i in range(4)]
            return await asyncio.gather(*replies)

    assert [g.text for g in run(go())] == [f"answer {i}" for i in range(4)]
    assert engine.peak_in_flight == 4  # the engine had all four at once, to batch them


# --- context window and token counts ---------------------------------------------------------------


def test_the_context_window_comes_from_the_listing_and_may_only_be_lowered() -> None:
    with FakeEngine(listing={"max_model_len": 8192}) as engine:

        async def window(context_window: int | None) -> int:
            async with EngineHost(engine.url, FAKE_MODEL, context_window=context_window) as host:
                return host.context_window

        assert run(window(None)) == 8192
        assert run(window(4096)) == 4096
        with pytest.raises(SubagentError, match=r"serves at most 8192 tokens of context; lower --context-window"):
            run(window(16384))


@pytest.mark.parametrize("listing", [{}, {"max_model_len": None}, {"max_model_len": "big"}])
def test_without_a_listed_window_the_configured_one_or_the_default_applies(listing: dict[str, Any]) -> None:
    async def window(engine: FakeEngine, context_window: int | None) -> int:
        async with EngineHost(engine.url, FAKE_MODEL, context_window=context_window) as host:
            return host.context_window

    with FakeEngine(listing=listing) as engine:
        assert run(window(engine, None)) == DEFAULT_CONTEXT_WINDOW
        assert run(window(engine, 6000)) == 6000


def test_token_counts_are_scaled_to_what_the_engine_reported(engine: FakeEngine) -> None:
    engine.queue(Reply("ok"))

    async def go() -> tuple[int, int, int]:
        async with EngineHost(engine.url, FAKE_MODEL) as host:
            before = await host.count_tokens(USER)
            reply = await host.session("s").generate(USER)
            return before, await host.count_tokens(USER), reply.usage.prompt_tokens

    before, after, reported = run(go())
    assert after == reported != before


def test_the_url_gets_v1_only_when_it_has_no_path() -> None:
    assert engine_url("http://gpu-box:8000") == "http://gpu-box:8000/v1"
    assert engine_url("https://h/api/v1/") == "https://h/api/v1"
    with pytest.raises(SubagentError, match=r"--engine 'gpu-box:8000' is not an http\(s\) URL"):
        engine_url("gpu-box:8000")


# --- faults ---------------------------------------------------------------------------------------------


def test_connection_refused_is_one_line_naming_the_engine() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    message = failure(EngineHost(f"http://127.0.0.1:{port}/v1", FAKE_MODEL, max_retries=1), start_only=True)
    assert message == (
        f"engine http://127.0.0.1:{port}/v1: connection refused; start the engine, or check the host and port "
        "in --engine"
    )


def test_a_host_name_that_does_not_resolve_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    real = socket.getaddrinfo

    def resolve(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "gpu-box.invalid":  # answered here: the test never asks a DNS server
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    message = failure(EngineHost("http://gpu-box.invalid:8000/v1", FAKE_MODEL, max_retries=1), start_only=True)
    assert message == (
        "engine http://gpu-box.invalid:8000/v1: cannot resolve the host name 'gpu-box.invalid'; check the host "
        "in --engine"
    )


def test_a_refused_key_is_one_line_and_the_env_key_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeEngine(api_key="s3cret") as engine:
        message = failure(EngineHost(engine.url, FAKE_MODEL, api_key="wrong"), start_only=True)
        assert message == (
            f"engine {engine.url}: the API key was refused (401: Incorrect API key provided.); pass the engine's "
            "key with --api-key or $MLX_SUBAGENTS_API_KEY"
        )
        monkeypatch.setenv("MLX_SUBAGENTS_API_KEY", "s3cret")
        monkeypatch.setenv("OPENAI_API_KEY", "sk-never-sent")
        engine.queue(Reply("ok"))
        assert run(generate(EngineHost(engine.url, FAKE_MODEL))).text == "ok"
        assert {r.headers["authorization"] for r in engine.requests} == {"Bearer wrong", "Bearer s3cret"}


def test_403_fails_at_once_without_retrying(engine: FakeEngine) -> None:
    engine.queue(Fault("status", 403, "model access denied"))
    message = failure(EngineHost(engine.url, FAKE_MODEL))
    assert message == (
        f"engine {engine.url}: access to model 'fake-model' was denied (403: model access denied); use a key "
        "that may use it (--api-key or $MLX_SUBAGENTS_API_KEY)"
    )
    assert len(engine.chat_requests()) == 1


def test_an_unknown_model_lists_the_models_the_engine_serves() -> None:
    with FakeEngine(models=("qwen3-coder", "llama-3.1-8b")) as engine:
        message = failure(EngineHost(engine.url, "qwen3"))
        assert message == (
            f"engine {engine.url}: model 'qwen3' not found; it serves qwen3-coder, llama-3.1-8b; pass one with --model"
        )
        assert len(engine.chat_requests()) == 1


@pytest.mark.parametrize("status", [429, 503])
def test_rate_limits_and_unavailability_are_retried_a_bounded_number_of_times(engine: FakeEngine, status: int) -> None:
    engine.queue(*[Fault("status", status, "busy", headers=RETRY_SOON)] * 5)
    message = failure(EngineHost(engine.url, FAKE_MODEL, max_retries=2))
    assert len(engine.chat_requests()) == 3  # one request + two retries, then a clear failure
    expected = {
        429: "still rate limited (429) after 2 retries; lower --concurrency or retry later",
        503: "unavailable (503: busy) after 2 retries; wait until the engine is up, or lower --concurrency",
    }
    assert message == f"engine {engine.url}: {expected[status]}"


def test_a_retried_503_that_recovers_returns_the_reply(engine: FakeEngine) -> None:
    engine.queue(Fault("status", 503, "loading", headers=RETRY_SOON), Reply("ready"))
    assert run(generate(EngineHost(engine.url, FAKE_MODEL, max_retries=2))).text == "ready"
    assert len(engine.chat_requests()) == 2


def test_a_stream_cut_mid_reply_is_one_line_and_not_retried(engine: FakeEngine) -> None:
    engine.queue(Fault("cut", content="I found three fi"), Reply("never sent"))
    message = failure(EngineHost(engine.url, FAKE_MODEL))
    assert message == (
        f"engine {engine.url}: the stream was cut mid-reply after 16 characters; the engine may have crashed or "
        "restarted (check its logs), then retry"
    )
    assert len(engine.chat_requests()) == 1


def test_an_error_event_mid_stream_is_one_line(engine: FakeEngine) -> None:
    engine.queue(Fault("error", message="CUDA out of memory", content="Partial"))
    message = failure(EngineHost(engine.url, FAKE_MODEL))
    assert message == (
        f"engine {engine.url}: the engine failed mid-reply (CUDA out of memory); check its logs, then retry"
    )


@pytest.mark.slow
def test_a_stalled_stream_times_out(engine: FakeEngine) -> None:
    engine.queue(Fault("stall", content="thinking", seconds=5), Fault("stall", seconds=5), Fault("stall", seconds=5))
    message = failure(EngineHost(engine.url, FAKE_MODEL, timeout=0.5, max_retries=1))
    assert message == (
        f"engine {engine.url}: the engine sent nothing for 0.5 s mid-reply; check that it is not overloaded or "
        "stuck (its logs), then retry"
    )
    assert len(engine.chat_requests()) == 1  # a reply under way is not sent again


@pytest.mark.slow
def test_a_reply_cancelled_mid_stream_keeps_an_estimate_of_what_it_spent(engine: FakeEngine) -> None:
    engine.queue(Fault("stall", content="Looking at the files now", seconds=300))
    shown: list[str] = []

    async def go() -> Any:
        async with EngineHost(engine.url, FAKE_MODEL) as host:
            session = host.session("s")
            reply = asyncio.create_task(session.generate(USER, GenerateArgs(on_event=texts(shown.append))))
            while "".join(shown) != "Looking at the files now":  # streamed; the engine now stalls 300 s
                assert not reply.done(), reply
                await asyncio.sleep(0.01)
            reply.cancel()  # what a timeout or Ctrl-C does
            with pytest.raises(asyncio.CancelledError):
                await reply
            return session.cut

    cut = run(go())
    assert cut.prompt_tokens == approx_tokens(USER, None) > 0
    assert cut.generated_tokens == approx_tokens([{"content": "Looking at the files now"}]) > 0


@pytest.mark.slow
def test_an_engine_that_never_answers_times_out_after_bounded_retries(engine: FakeEngine) -> None:
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        message = failure(EngineHost(url, FAKE_MODEL, timeout=0.3, max_retries=1))
    assert message == (
        f"engine {url}: no reply within 0.3 s after 1 retry; check that it is not overloaded or stuck (its logs), "
        "then retry"
    )


def test_a_prompt_over_the_engines_window_is_prompt_too_long(engine: FakeEngine) -> None:
    engine.queue(Fault("status", 400, "This model's maximum context length is 8192 tokens."))
    with pytest.raises(PromptTooLongError, match=r"lower --context-window so that compaction starts earlier$"):
        run(generate(EngineHost(engine.url, FAKE_MODEL)))


def test_a_failing_session_leaves_its_siblings_alone(engine: FakeEngine) -> None:
    engine.queue(Fault("cut", content="half"), when="task A")
    engine.queue(Reply("B is done", chunk=1), when="task B")

    async def go() -> list[Any]:
        async with EngineHost(engine.url, FAKE_MODEL) as host:
            a = host.session("a").generate([{"role": "user", "content": "task A"}])
            b = host.session("b").generate([{"role": "user", "content": "task B"}])
            return await asyncio.gather(a, b, return_exceptions=True)

    a, b = run(go())
    assert isinstance(a, EngineError) and "cut mid-reply after 4 characters" in str(a)
    assert b.text == "B is done"


def test_listing_failures_other_than_reachability_and_keys_do_not_stop_the_start(engine: FakeEngine) -> None:
    async def go() -> int:
        host = EngineHost(engine.url.removesuffix("/v1") + "/api", FAKE_MODEL)  # /api/models is a 404 here
        await host.start()
        await host.stop()
        return host.context_window

    assert run(go()) == DEFAULT_CONTEXT_WINDOW
    assert json.loads(json.dumps([r.path for r in engine.requests])) == ["/api/models"]


# --- the benchmark's engine rows ------------------------------------------------------------------------


def test_the_throughput_benchmark_measures_an_engine(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    throughput = importlib.import_module("throughput")
    engine.queue(*[Reply("0123456789abcdef", chunk=1, completion_tokens=16, cached_tokens=90)] * 11)
    model_id, runs = run(throughput.measure_engine(engine.url, None, 16, 1))
    assert model_id == FAKE_MODEL  # the first model the engine lists
    assert len(engine.chat_requests()) == 4 + 1 + 2 + 4  # a warm-up round, then 1, 2 and 4 sessions
    in_process = {"results": {"batched": {n: {"decode_tok_s": 100.0, "e2e_tok_s": 50.0} for n in ("1", "2", "4")}}}
    report = throughput.engine_report(in_process, engine.url, model_id, runs)
    rows = report["results"]
    assert [rows[n]["generated_tokens"] for n in ("1", "2", "4")] == [16, 32, 64]
    assert rows["4"]["cached_tokens"] == [90] * 4 and all(r["decode_tok_s"] > 0 for r in rows.values())
    assert report["ratio_host_vs_engine"]["4"] == round(100.0 / rows["4"]["decode_tok_s"], 3)
