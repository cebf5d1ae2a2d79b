"""Engines that answer wrongly, and the bounds on every wait for one: each is one `EngineError` line that
says what came back, through the CLI (in this process and as a real process) and the Python API, and
nothing is left running after it. Real HTTP against the fake engine on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.errors import EngineError
from mlx_subagents.host.engine.engine_host import DEFAULT_REPLY_TIMEOUT, DEFAULT_START_TIMEOUT, EngineHost
from mlx_subagents.host.protocol import DEFAULT_CONTEXT_WINDOW, GenerateArgs
from mlx_subagents.testing.fake_engine import FAKE_MODEL, FakeEngine, Fault, Reply
from tests.helpers import spawn_cli, texts

LOGIN = (
    "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>Sign in &middot; Corp Proxy</title></head>\n"
    "<body><form action='/login'>user: <input name=u></form></body></html>\n"
)
NOT_AN_ENGINE = "check that --engine is the engine's API root (usually ending in /v1), not a proxy's login page"
GARBLED = "the engine (or a proxy in between) does not speak the chat-completions protocol; check its logs"
RETRY_SOON = (("retry-after-ms", "10"),)
USER = [{"role": "user", "content": "Task: list the files"}]


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    with FakeEngine() as fake:
        yield fake
        assert no_stream_left(fake)


def no_stream_left(engine: FakeEngine, bound: float = 20.0) -> bool:
    """Every chat stream the engine served has ended (a stream the client closed ends at its next write)."""
    deadline = time.monotonic() + bound
    while engine.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine.in_flight == 0


def run_on(engine: FakeEngine, run_cli: Any, tmp_path: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    code, out, err = run_cli(
        "run", "scout", "list the files", "-C", str(tmp_path), "--engine", engine.url, "--model", FAKE_MODEL, "--json",
        *args,
    )  # fmt: skip
    return code, json.loads(out) if out else {}, err


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


# --- answers that are not an event stream --------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "what"),
    [
        (
            Fault("body", 200, body=LOGIN),
            "the engine answered with an HTML page (status 200), not an event stream: 'Sign in · Corp Proxy'",
        ),
        (
            Fault("body", 200, body="<html><body><h1>Access denied</h1> <p>Ask IT.</p></body></html>"),
            "the engine answered with an HTML page (status 200), not an event stream: 'Access denied Ask IT.'",
        ),
        (
            Fault(
                "body",
                200,
                content_type="application/json",
                body=json.dumps(
                    {
                        "id": "chatcmpl-1",
                        "object": "chat.completion",
                        "choices": [
                            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
                        ],
                    }
                ),
            ),  # fmt: skip
            'the engine answered with one whole JSON completion (status 200), not an event stream: it ignored "stream": '
            "true",
        ),
        (
            Fault("body", 200, content_type="application/json", body='{"error": {"message": "quota exceeded"}}'),
            "the engine answered with a JSON error (status 200), not an event stream: 'quota exceeded'",
        ),
        (
            Fault("body", 200, content_type="application/json", body='{"status": "ok"}'),
            'the engine answered with a JSON body (status 200), not an event stream: \'{"status": "ok"}\'',
        ),
        (
            Fault("body", 200, content_type="application/json", body=""),
            "the engine answered with an empty application/json body (status 200), not an event stream",
        ),
        (
            Fault("body", 200, content_type="text/plain", body="It works!\n" + "x" * 300),
            f"the engine answered with a text/plain body (status 200), not an event stream: 'It works! {'x' * 110}...'",
        ),
    ],
    ids=["login-page", "untitled-page", "whole-completion", "json-error", "json-other", "empty", "plain-long"],
)
def test_an_answer_that_is_not_an_event_stream_says_what_came_back(
    engine: FakeEngine, tmp_path: Path, run_cli: Any, fault: Fault, what: str
) -> None:
    engine.queue(fault)
    code, data, err = run_on(engine, run_cli, tmp_path)
    assert (code, data["status"], data["stop_reason"]) == (1, "failed", "error"), err
    assert data["error"] == f"engine {engine.url}: {what}; {NOT_AN_ENGINE}"
    assert len(engine.chat_requests()) == 1  # a wrong answer is not sent again


def test_a_page_labelled_as_an_event_stream_says_what_it_held(engine: FakeEngine, tmp_path: Path, run_cli: Any) -> None:
    engine.queue(Fault("body", 200, content_type="text/event-stream", body=LOGIN))
    code, data, _ = run_on(engine, run_cli, tmp_path)
    assert code == 1
    assert data["error"] == (
        f"engine {engine.url}: the event stream ended before the reply began; instead of events it held lines like "
        f"'<!DOCTYPE html>'; {NOT_AN_ENGINE}"
    )


def test_an_error_page_with_an_error_status_is_named_by_its_title(
    engine: FakeEngine, tmp_path: Path, run_cli: Any
) -> None:
    page = "<html><head><title>502 Bad Gateway</title></head><body><center>nginx</center>" + " " * 5000 + "</body>"
    engine.queue(*[Fault("body", 502, body=page, headers=RETRY_SOON)] * 4)
    code, data, _ = run_on(engine, run_cli, tmp_path)
    assert code == 1
    assert data["error"] == (
        f"engine {engine.url}: unavailable (502: an HTML page: '502 Bad Gateway') after 3 retries; wait until the "
        "engine is up, or lower --concurrency"
    )


# --- garbage inside the event stream ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("garbage", "what"),
    [
        ("data: <html><body>Sign in</body></html>\n\n", "an event that is not JSON: '<html><body>Sign in</body></html>'"),
        ("data: {'choices': []}\n\n", "an event that is not JSON: \"{'choices': []}\""),
        ("data: [1, 2]\n\n", "an event that is not a chat-completion chunk: '[1, 2]'"),
        ("data: 42\n\n", "an event that is not a chat-completion chunk: '42'"),
        ('data: {"id": "x", "object": "ping"}\n\n', "an event that is not a chat-completion chunk: '{\"id\": \"x\", \"object\": \"ping\"}'"),
        ('data: {"choices": "none"}\n\n', "an event that is not a chat-completion chunk: '{\"choices\": \"none\"}'"),
        ('data: {"choices": [{"delta": "hi"}]}\n\n', "an event that is not a chat-completion chunk: '{\"choices\": [{\"delta\": \"hi\"}]}'"),
        ('data: {"choices": [{"delta": {"content": 7}}]}\n\n', "an event that is not a chat-completion chunk: '{\"choices\": [{\"delta\": {\"content\": 7}}]}'"),
        (
            'data: {"choices": [{"delta": {"tool_calls": [{"index": "a", "function": {}}]}}]}\n\n',
            "an event that is not a chat-completion chunk: "
            "'{\"choices\": [{\"delta\": {\"tool_calls\": [{\"index\": \"a\", \"function\": {}}]}}]}'",
        ),
        ("data: caf\udce9\n\n", "a line that is not UTF-8 text: 'data: caf\ufffd'"),
    ],
    ids=["html", "python-dict", "list", "number", "other-object", "choices-text", "delta-text", "content-number",
         "call-index", "not-utf8"],
)  # fmt: skip
def test_garbage_in_the_event_stream_says_what_came_back(
    engine: FakeEngine, tmp_path: Path, run_cli: Any, garbage: str, what: str
) -> None:
    engine.queue(Fault("events", content="So far", body=garbage))
    code, data, err = run_on(engine, run_cli, tmp_path)
    assert (code, data["status"]) == (1, "failed"), err
    assert data["error"] == f"engine {engine.url}: the engine sent {what}, after 6 characters of the reply; {GARBLED}"


def test_a_line_without_end_is_bounded(engine: FakeEngine, tmp_path: Path, run_cli: Any) -> None:
    engine.queue(Fault("events", content="So far", body="data: " + "z" * (1 << 21)))
    code, data, _ = run_on(engine, run_cli, tmp_path)
    assert code == 1
    assert data["error"] == (
        f"engine {engine.url}: the engine sent a line of over 1 MiB: 'data: {'z' * 114}...', after 6 characters of "
        f"the reply; {GARBLED}"
    )


def test_lines_the_protocol_allows_are_skipped(engine: FakeEngine, tmp_path: Path, run_cli: Any) -> None:
    allowed = ": keep-alive\n\nevent: ping\n\nid: 7\nretry: 100\n\nevent: message\ndata: [DONE]\n\n"
    engine.queue(Fault("events", content="All files: a.py", body=allowed + "stray words\n\n"))
    code, data, err = run_on(engine, run_cli, tmp_path)
    assert (code, data["status"], data["output"]) == (0, "completed", "All files: a.py"), err


def test_lines_that_are_no_events_are_named_when_the_stream_breaks_off(
    engine: FakeEngine, tmp_path: Path, run_cli: Any
) -> None:
    engine.queue(Fault("body", 200, content_type="text/event-stream", body='data: {"choices": []}\n\nRate limit hit\n'))
    code, data, _ = run_on(engine, run_cli, tmp_path)
    assert code == 1
    assert data["error"] == (
        f"engine {engine.url}: the stream was cut mid-reply after 0 characters; instead of events it held lines like "
        f"'Rate limit hit'; {NOT_AN_ENGINE}"
    )


# --- the model listing at start-up -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "line"),
    [
        (
            Fault("body", 200, body=LOGIN),
            "the engine answered the model listing with an HTML page (status 200), not JSON: 'Sign in · Corp "
            f"Proxy'; {NOT_AN_ENGINE}",
        ),
        (
            Fault("body", 401, body="<title>Log in</title>"),
            "the API key was refused (401: an HTML page: 'Log in'); pass the engine's key with --api-key or "
            "$MLX_SUBAGENTS_API_KEY",
        ),
    ],
    ids=["login-page", "login-page-401"],
)
def test_a_login_page_for_the_model_listing_stops_the_command(
    tmp_path: Path, run_cli: Any, fault: Fault, line: str
) -> None:
    with FakeEngine(listing_fault=fault) as engine:
        code, data, err = run_on(engine, run_cli, tmp_path)
        assert (code, data) == (2, {})
        assert err == f"error: engine {engine.url}: {line}\n"
        assert engine.chat_requests() == []


@pytest.mark.parametrize(
    "fault",
    [
        Fault("body", 200, content_type="application/json", body="[1, 2]"),
        Fault("body", 200, content_type="application/json", body='{"data": "none"}'),
        Fault("body", 200, content_type="application/json", body="{not json"),
        Fault("status", 404, "no listing here"),
    ],
    ids=["list", "data-text", "broken", "404"],
)
def test_a_listing_that_is_odd_but_no_page_does_not_stop_the_start(fault: Fault) -> None:
    async def go(url: str) -> int:
        async with EngineHost(url, FAKE_MODEL) as host:
            return host.context_window

    with FakeEngine(listing_fault=fault) as engine:
        assert run(go(engine.url)) == DEFAULT_CONTEXT_WINDOW


# --- bounds: tokens ----------------------------------------------------------------------------------


def test_an_endless_stream_stops_at_max_tokens(engine: FakeEngine, tmp_path: Path, run_cli: Any) -> None:
    engine.queue(Fault("endless", content="word "))
    code, data, err = run_on(engine, run_cli, tmp_path, "--max-tokens", "50")
    assert (code, data["status"], data["stop_reason"]) == (1, "failed", "max_tokens"), err
    assert data["error"] == "reached the limit of 50 generated tokens"
    assert data["output"] == "word " * 49 + "word"
    assert data["usage"]["output_tokens"] == 50
    assert engine.chat_requests()[0].body["max_tokens"] == 50


def test_an_endless_stream_stops_at_the_per_reply_limit(engine: FakeEngine, tmp_path: Path, run_cli: Any) -> None:
    engine.queue(Fault("endless", content="a"))
    code, data, _ = run_on(engine, run_cli, tmp_path)
    assert (code, data["stop_reason"]) == (1, "max_tokens")
    assert data["error"] == (
        "the final answer was cut at the per-reply limit of 2048 tokens; the output holds the partial text"
    )
    assert (data["output"], data["usage"]["output_tokens"]) == ("a" * 2048, 2048)


def test_an_endless_stream_of_long_pieces_is_bounded_by_its_characters(
    engine: FakeEngine, tmp_path: Path, run_cli: Any
) -> None:
    engine.queue(Fault("endless", content="x" * 100))
    code, data, _ = run_on(engine, run_cli, tmp_path, "--max-tokens", "20")
    assert (code, data["stop_reason"], data["usage"]["output_tokens"]) == (1, "max_tokens", 20)
    assert data["output"] == "x" * 100 and len(data["output"]) <= 20 * 8  # a sixth piece would pass 160 characters


def test_an_engine_that_ignores_max_tokens_is_cut_on_the_python_api(engine: FakeEngine) -> None:
    engine.queue(Fault("endless", content="tok"), Reply("next"))
    seen: list[str] = []

    async def go() -> Any:
        async with EngineHost(engine.url, FAKE_MODEL) as host:
            session = host.session("s")
            cut = await session.generate(USER, GenerateArgs(max_tokens=12, on_event=texts(seen.append)))
            return cut, await session.generate(USER, GenerateArgs(max_tokens=12))

    cut, after = run(go())
    assert (cut.text, cut.finish_reason, cut.usage.generated_tokens) == ("tok" * 12, "length", 12)
    assert "".join(seen) == "tok" * 12
    assert after.text == "next"  # the connection is not left half-read


# --- bounds: time -------------------------------------------------------------------------------------


def test_the_default_bounds() -> None:
    host = EngineHost("http://127.0.0.1:9/v1", FAKE_MODEL)
    assert (host.start_timeout, host.reply_timeout, host.timeout) == (DEFAULT_START_TIMEOUT, DEFAULT_REPLY_TIMEOUT, 300)
    assert (DEFAULT_START_TIMEOUT, DEFAULT_REPLY_TIMEOUT) == (30, 1800)
    assert EngineHost("http://127.0.0.1:9/v1", FAKE_MODEL, start_timeout=5).start_timeout == 5
    assert EngineHost("http://127.0.0.1:9/v1", FAKE_MODEL, start_timeout=3600).start_timeout == DEFAULT_START_TIMEOUT


@pytest.mark.slow
def test_a_listing_that_never_answers_is_bounded_and_timeout_covers_it(tmp_path: Path, run_cli: Any) -> None:
    with FakeEngine(listing_fault=Fault("stall")) as engine:
        code, data, err = run_on(engine, run_cli, tmp_path, "--timeout", "1")
        assert (code, data) == (2, {})
        assert err == (
            f"error: engine {engine.url}: the model listing ({engine.url}/models) did not answer within 1 s; check "
            "that the engine is up and not stuck (its logs), then retry\n"
        )
        assert engine.chat_requests() == []


@pytest.mark.slow
def test_a_listing_that_never_answers_is_bounded_on_the_python_api() -> None:
    async def go(url: str) -> None:
        await EngineHost(url, FAKE_MODEL, start_timeout=0.5).start()

    with FakeEngine(listing_fault=Fault("stall")) as engine:
        with pytest.raises(EngineError) as info:
            run(go(engine.url))
        assert str(info.value) == (
            f"engine {engine.url}: the model listing ({engine.url}/models) did not answer within 0.5 s; check that the "
            "engine is up and not stuck (its logs), then retry"
        )


@pytest.mark.slow
@pytest.mark.parametrize("content", ["", "thinking..."], ids=["keep-alives", "text-then-stall"])
def test_a_reply_that_never_ends_is_bounded(engine: FakeEngine, content: str) -> None:
    if content:
        engine.queue(Fault("stall", content=content, seconds=5))  # it ends by itself after
    else:
        engine.queue(Fault("endless", seconds=0.05))  # keep-alive comments: bytes, but never a token

    async def go() -> None:
        async with EngineHost(engine.url, FAKE_MODEL, reply_timeout=1) as host:
            await host.session("s").generate(USER)

    with pytest.raises(EngineError) as info:
        run(go())
    assert str(info.value) == (
        f"engine {engine.url}: the reply did not end within 1 s (it had {len(content)} characters); the engine may "
        "be stuck (check its logs), then retry"
    )


@pytest.mark.slow
def test_an_endless_keep_alive_stream_ends_at_the_task_timeout(
    engine: FakeEngine, tmp_path: Path, run_cli: Any
) -> None:
    engine.queue(Fault("endless", seconds=0.05))
    code, data, _ = run_on(engine, run_cli, tmp_path, "--timeout", "1")
    assert (code, data["status"], data["stop_reason"]) == (1, "failed", "timeout")
    assert data["error"] == "stopped by the timeout of 1s"


# --- as a real process: it ends ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize(
    ("setup", "flags", "code", "expect"),
    [
        ("endless", ["--max-tokens", "40"], 1, "reached the limit of 40 generated tokens"),
        ("page", [], 1, "the engine answered with an HTML page (status 200), not an event stream"),
        ("garbage", [], 1, "the engine sent an event that is not JSON: 'not json'"),
        ("listing", ["--timeout", "2"], 2, "did not answer within 2 s"),
    ],
)
def test_the_process_ends_on_every_wrong_answer(
    tmp_path: Path, setup: str, flags: list[str], code: int, expect: str, preloaded_python: list[str]
) -> None:
    stall = Fault("stall") if setup == "listing" else None
    with FakeEngine(listing_fault=stall) as engine:
        engine.queue(
            {
                "endless": Fault("endless", content="word "),
                "page": Fault("body", 200, body=LOGIN),
                "garbage": Fault("events", content="x", body="data: not json\n\n"),
                "listing": Reply("never asked"),
            }[setup]
        )
        args = ["run", "scout", "x", "-C", str(tmp_path), "--engine", engine.url, "--model", FAKE_MODEL, *flags]
        process = spawn_cli(*args, "--json", python=preloaded_python)
        try:
            out, err = process.communicate(timeout=120)  # a bound, not a measure
        finally:
            process.kill()
        assert process.returncode == code, err
        line = err.strip() if code == 2 else json.loads(out)["error"]
        assert expect in line and "Traceback" not in err and len(line.splitlines()) == 1
        assert no_stream_left(engine)
