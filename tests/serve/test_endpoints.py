"""The OpenAI- and Anthropic-compatible endpoints of `subagent serve`, through the official SDKs.

A real server process on the tiny model (forced scripts drive the real inference path, its KV reuse
and its call parser) answers the `openai` and `anthropic` SDKs: whole and streamed answers, tool calls
and their results, a JSON-schema answer held by the grammar, later turns whose prompt the session's
cache held (counted), stop sequences, a client that goes away, and `--status`. A scripted server
answers every bad request with its API's error.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import anthropic
import jsonschema
import openai
import pytest

from mlx_subagents.serve.client import make_hello, quick
from mlx_subagents.serve.state import serve_paths
from mlx_subagents.testing import tool_call_text
from tests.helpers import spawn_cli

pytestmark = [pytest.mark.slow, pytest.mark.process]

SYSTEM = "You answer questions about the weather. " * 20
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}


def clients(info: Any) -> tuple[openai.OpenAI, anthropic.Anthropic, str]:
    """The two SDKs' clients set up as docs/endpoints.md says, and the server's base URL."""
    base = info.url.removesuffix("/mcp")
    token = serve_paths().token.read_text().strip()
    return openai.OpenAI(base_url=f"{base}/v1", api_key=token), anthropic.Anthropic(base_url=base, api_key=token), base


def status(info: Any) -> dict[str, Any]:
    return quick(info, make_hello("status"))["status"]


def test_the_sdks_talk_to_the_served_model_and_later_turns_reuse_its_cache(
    serve_process: Any, tmp_path: Path, tiny_qwen3_path: Path, preloaded_python: list[str]
) -> None:
    # The conversations are numbered in the order they start, whichever API: the OpenAI one first, then the
    # JSON-schema and tool_choice requests (their own), then the Anthropic one.
    scripts = {
        "conversation#1": [
            "It is 4.",
            tool_call_text("get_weather", {"city": "Paris"}),
            "Sunny in Paris. STOP and more",
        ],
        "conversation#4": ["Let me look.\n" + tool_call_text("get_weather", {"city": "Oslo"}), "Snow in Oslo."],
    }
    _, info = serve_process(tiny=(tiny_qwen3_path, tmp_path, scripts), http=True)
    oa, an, _ = clients(info)
    model = str(tiny_qwen3_path)
    assert [m.id for m in oa.models.list()] == [model]

    # OpenAI: a whole answer, then a streamed tool call, then its result: each turn goes on in the session.
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2 + 2?"}]
    first = oa.chat.completions.create(model=model, messages=messages, tools=[WEATHER])
    assert (first.choices[0].message.content, first.choices[0].finish_reason) == ("It is 4.", "stop")
    assert first.usage is not None and first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Paris?"}]
    chunks = list(
        oa.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER], stream=True, stream_options={"include_usage": True}
        )
    )
    [call] = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "tool_calls"
    second = chunks[-1].usage
    assert second is not None and not chunks[-1].choices
    # The first turn's prompt and reply were held: only the new user message (and the tools) is prefilled.
    assert second.prompt_tokens_details.cached_tokens > 0.5 * second.prompt_tokens
    assistant = {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude={"index"})]}
    messages += [assistant, {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    third = oa.chat.completions.create(model=model, messages=messages, tools=[WEATHER], stop=["STOP"])
    assert (third.choices[0].message.content, third.choices[0].finish_reason) == ("Sunny in Paris.", "stop")
    held = second.prompt_tokens + second.completion_tokens  # the whole second turn, reply and end included
    assert third.usage is not None and third.usage.prompt_tokens_details.cached_tokens == held
    # The same request again (a client's "regenerate"): it extends no conversation, goes on in the one it has
    # every message in common with, and prefills only the prompt's last token.
    again = oa.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=1)
    assert again.usage is not None and again.usage.prompt_tokens == third.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == third.usage.prompt_tokens - 1

    # A JSON-schema answer: no script, the random model is held to the schema by the grammar.
    answer = oa.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "the forecast as JSON"}],
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA}},
    )
    jsonschema.validate(json.loads(answer.choices[0].message.content or ""), SCHEMA)
    # A named tool_choice: the random model's reply is held to a call of that tool.
    forced = oa.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "and tomorrow?"}],
        max_tokens=40,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    )
    [call] = forced.choices[0].message.tool_calls or []
    assert (forced.choices[0].finish_reason, call.function.name) == ("tool_calls", "get_weather")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    # Anthropic: a streamed text and tool_use, then its result. The system prompt and tools are those of the
    # OpenAI conversation: a prefix the host holds already, whichever API asked.
    function = WEATHER["function"]
    tools = [{"name": function["name"], "description": function["description"], "input_schema": function["parameters"]}]
    turns: list[Any] = [{"role": "user", "content": "Oslo?"}]
    with an.messages.stream(model=model, max_tokens=64, system=SYSTEM, messages=turns, tools=tools) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [(b.type, getattr(b, "text", None) or getattr(b, "input", None)) for b in streamed.content] == [
        ("text", "Let me look."),
        ("tool_use", {"city": "Oslo"}),
    ]
    assert streamed.stop_reason == "tool_use" and streamed.usage.cache_read_input_tokens > 0
    turns += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in streamed.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": streamed.content[1].id, "content": "snow"}],
        },
    ]
    done = an.messages.create(model=model, max_tokens=64, system=SYSTEM, messages=turns, tools=tools)
    assert (done.content[0].text, done.stop_reason) == ("Snow in Oslo.", "end_turn")
    usage = streamed.usage
    assert (
        done.usage.cache_read_input_tokens == usage.input_tokens + usage.cache_read_input_tokens + usage.output_tokens
    )
    assert an.messages.count_tokens(model=model, system=SYSTEM, messages=turns, tools=tools).input_tokens == (
        done.usage.input_tokens + done.usage.cache_read_input_tokens
    )

    # Anthropic's structured output (`output_config.format`) is held to its schema as OpenAI's JSON-schema answer
    # is: the same conversation, decoded greedily, is the same answer.
    structured = an.messages.create(
        model=model,
        messages=[{"role": "user", "content": "the forecast as JSON"}],
        max_tokens=40,
        output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
    )
    assert [(b.type, getattr(b, "text", None)) for b in structured.content] == [
        ("text", answer.choices[0].message.content)
    ]

    now = status(info)
    assert sorted((c["kind"], c["name"], c["running"]) for c in now["clients"]) == [
        ("anthropic", f"Anthropic/Python {anthropic.__version__}", 0),
        ("openai", f"OpenAI/Python {openai.__version__}", 0),
    ]
    sessions = {s["session"]: s for s in now["sessions"]}
    openai_turns, anthropic_turns = sessions["conversation#1"], sessions["conversation#4"]
    assert (openai_turns["turns"], openai_turns["cached_tokens"]) == (4, third.usage.prompt_tokens - 1)
    assert (anthropic_turns["status"], anthropic_turns["turns"], anthropic_turns["api"]) == ("idle", 2, "anthropic")
    shown = spawn_cli("serve", "--status", python=preloaded_python).communicate(timeout=60)[0]
    assert (
        f"session c1 conversation#1 ({model}) idle" in shown
        and f"4 turns, last prompt {third.usage.prompt_tokens:,}" in shown
    )

    # A schema the grammar cannot hold within a request's limits (the lexer gives up on this pattern: a mask step
    # took 1.6 s at llguidance's defaults) is refused before its turn, in one line naming its field.
    hostile = {"type": "object", "properties": {"v": {"type": "string", "pattern": "^a{1000000}$"}}, "required": ["v"]}
    gave_up = "(lexer error: too many expressions constructed); send a simpler schema (smaller counted repetitions in "
    gave_up += "patterns, fewer alternatives or values, less nesting)"
    with pytest.raises(openai.BadRequestError) as refused:
        oa.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "the forecast as JSON"}],
            response_format={"type": "json_schema", "json_schema": {"name": "forecast", "schema": hostile}},
        )
    where = "response_format.json_schema.schema"
    assert refused.value.body == {
        "message": f"{where}: the answer cannot be held to this schema by the grammar {gave_up}",
        "type": "invalid_request_error",
        "param": where,
        "code": None,
    }
    with pytest.raises(anthropic.BadRequestError) as rejected:
        an.messages.create(
            model=model, max_tokens=8, messages=turns[:1], tools=[*tools, {"name": "f", "input_schema": hostile}]
        )
    assert rejected.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": f"tools[1].input_schema: calls to 'f' cannot be held to its parameters by the grammar {gave_up}",
        },
    }


def test_a_client_that_goes_away_frees_its_turn_at_once(
    serve_process: Any, tmp_path: Path, tiny_qwen3_path: Path
) -> None:
    _, info = serve_process(tiny=(tiny_qwen3_path, tmp_path, {}), http=True)
    token = serve_paths().token.read_text().strip()
    where = urlparse(info.url)
    for stream in (False, True):
        body = {"model": str(tiny_qwen3_path), "messages": [{"role": "user", "content": "go on"}], "max_tokens": 3000}
        connection = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        connection.request("POST", "/v1/chat/completions", json.dumps(body | {"stream": stream}), headers)
        deadline = time.monotonic() + 60
        # It decodes (a count, not a sleep: a loaded machine's prefill may take longer than any fixed time).
        while not any(s["status"] == "running" and s["generated_tokens"] > 0 for s in status(info)["sessions"]):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        connection.close()
        sessions = status(info)["sessions"]
        while any(s["status"] == "running" for s in sessions):
            assert time.monotonic() < deadline, "the turn ran on after its client went away"
            time.sleep(0.05)
            sessions = status(info)["sessions"]
        # It stopped where its client left, far from its 3,000 tokens.
        assert all(0 < s["generated_tokens"] < 3000 for s in sessions)
    assert [c["running"] for c in status(info)["clients"]] == [0]


def test_every_bad_request_gets_one_error_in_its_apis_shape(
    serve_process: Any, tmp_path: Path, write_script: Any
) -> None:
    model = write_script({"replies": ["fine"], "context_window": 400})
    _, info = serve_process("--port", "0", "--model", model, "-C", str(tmp_path))
    oa, an, base = clients(info)
    port = urlparse(base).port
    token = serve_paths().token.read_text().strip()

    def post(path: str, body: Any, headers: dict[str, str] | None = None, method: str = "POST") -> tuple[int, Any]:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        payload = body if isinstance(body, (str, bytes)) else json.dumps(body)
        auth = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        connection.request(method, path, payload, {**auth, **(headers or {})})
        response = connection.getresponse()
        data = json.loads(response.read())
        connection.close()
        return response.status, data

    def openai_error(message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
        return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}

    user = [{"role": "user", "content": "hi"}]
    assert post("/v1/chat/completions", "{ not json") == (
        400,
        openai_error("the request body is not valid JSON (Expecting property name enclosed in double quotes: line 1 "
                     "column 3 (char 2)); send one JSON object"),
    )  # fmt: skip
    assert post("/v1/chat/completions", {"model": model}) == (
        400,
        openai_error("messages: Field required; see the Chat Completions reference", "messages"),
    )
    assert post("/v1/chat/completions", {"model": model, "messages": user, "stop": 5}) == (
        400,
        openai_error(
            "stop: 5 is none of the accepted forms (str, list[str]); see the Chat Completions reference", "stop"
        ),
    )
    assert post("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": ["hi"]}]}) == (
        400,
        openai_error("messages[0].content: ['hi'] is none of the accepted forms (str, list[dict[str,any]]); see the "
                     "Chat Completions reference", "messages[0].content"),
    )  # fmt: skip
    assert post("/v1/chat/completions", {"model": "gpt-9", "messages": user}) == (
        404,
        openai_error(
            f"model 'gpt-9' is not served here (GET /v1/models lists them: {model}); name one of them",
            "model",
            "model_not_found",
        ),
    )
    status, error = post(
        "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x " * 900}]}
    )
    assert (status, error["error"]["code"], error["error"]["param"]) == (400, "context_length_exceeded", "messages")
    assert "does not fit the context window of 400 tokens" in error["error"]["message"]
    # Anthropic's own words for it begin the line, by which Claude Code knows it (not an unknown API error).
    long = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "x " * 900}]}
    status, error = post("/v1/messages", long)
    assert (status, error["error"]["type"]) == (400, "invalid_request_error")
    assert error["error"]["message"].startswith("prompt is too long: scripted model: prompt of ~")
    bad_tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}},
    }
    status, error = post("/v1/chat/completions", {"model": model, "messages": user, "tools": [bad_tool]})
    assert (status, error["error"]["param"]) == (400, "tools[0].function")
    assert error["error"]["message"].startswith("tools[0].function: the parameters: not a valid JSON schema: ")
    forced = {"type": "function", "function": {"name": "g"}}
    status, error = post(
        "/v1/chat/completions", {"model": model, "messages": user, "tools": [WEATHER], "tool_choice": forced}
    )
    assert (status, error["error"]["message"]) == (
        400,
        "tool_choice names 'g', which is not one of the tools (get_weather)",
    )
    # Two tools of one name: which one a call means is unknowable (both APIs refuse it).
    status, error = post("/v1/chat/completions", {"model": model, "messages": user, "tools": [WEATHER, WEATHER]})
    assert (status, error["error"]["message"]) == (
        400,
        "tools[1].function.name: 'get_weather' is the name of tools[0] too; give each tool a name of its own",
    )
    # Every stop sequence is looked for after each token the reply streams, on the loop that answers all clients.
    status, error = post(
        "/v1/chat/completions", {"model": model, "messages": user, "stop": [str(i) for i in range(17)]}
    )
    assert (status, error["error"]) == (
        400,
        openai_error("stop: 17 stop sequences; send at most 16", "stop")["error"],
    )
    status, error = post(
        "/v1/messages", {"model": model, "max_tokens": 8, "messages": user, "stop_sequences": ["x" * 1025]}
    )
    assert (status, error["error"]["message"]) == (
        400,
        "stop_sequences[0]: a stop sequence of 1,025 characters; send at most 1,024",
    )
    status, error = post(
        "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    )
    assert (status, error["error"]["message"]) == (
        400,
        "messages[0].content[0]: image_url parts are not read by this server; send text",
    )

    lone = json.dumps({"model": model, "messages": [{"role": "user", "content": "\ud800 hi"}]})  # "\\ud800"
    assert post("/v1/chat/completions", lone) == (
        400,
        openai_error("the request body has an unpaired surrogate ('\\ud800') in a string; send text as UTF-8 or "
                     "each surrogate with its pair"),
    )  # fmt: skip
    pair = json.dumps({"model": model, "messages": [{"role": "user", "content": "\U0001f600"}]})  # "\\ud83d\\ude00"
    assert post("/v1/messages/count_tokens", pair)[0] == 200

    # The SDKs raise their own errors with these messages.
    with pytest.raises(openai.NotFoundError, match="model 'gpt-9' is not served here"):
        oa.chat.completions.create(model="gpt-9", messages=user)
    with pytest.raises(openai.BadRequestError, match="400 - frequency_penalty: not applied by this server; send 0 or"):
        oa.chat.completions.create(model=model, messages=user, frequency_penalty=0.5)
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[1\]: the conversation ends with an assistant"):
        an.messages.create(model=model, max_tokens=8, messages=[*user, {"role": "assistant", "content": "Sure,"}])
    # One model by its name (a path: its slashes come escaped), in each API's shape.
    assert (oa.models.retrieve(model).id, an.models.retrieve(model).id) == (model, model)
    with pytest.raises(openai.NotFoundError, match="model 'gpt-9' is not served here"):
        oa.models.retrieve("gpt-9")
    with pytest.raises(anthropic.NotFoundError, match="model 'claude-9' is not served here"):
        an.models.retrieve("claude-9")
    with pytest.raises(anthropic.BadRequestError, match="max_tokens: Field required"):
        an.post("/v1/messages", body={"model": model, "messages": user}, cast_to=object)
    with pytest.raises(anthropic.AuthenticationError, match="unauthorized: wrong token"):
        anthropic.Anthropic(base_url=base, api_key="wrong").messages.create(model=model, max_tokens=8, messages=user)
    assert an.messages.create(model=model, max_tokens=8, messages=user).content[0].text == "fine"  # x-api-key

    nested: Any = {"type": "text", "text": 5}
    for _ in range(3):
        nested = {"type": "tool_result", "tool_use_id": "c", "content": [nested]}
    status, error = post(
        "/v1/messages", {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": [nested]}]}
    )
    assert (status, error["error"]["message"]) == (
        400,
        "messages[0].content: [{'type': 'tool_result', 'tool_use_id': 'c', 'content': [... is none of the accepted "
        "forms (str, list[Block]); see the Messages API reference",
    )  # each form once, however deep the blocks nest (a form a level: 3,500 characters at 300 levels)
    tool = {"name": "f", "input_schema": {"type": "object"}}
    status, error = post("/v1/messages", {"model": model, "max_tokens": 8, "messages": user, "tools": [tool, tool]})
    assert (status, error["error"]["message"]) == (
        400,
        "tools[1].name: 'f' is the name of tools[0] too; give each tool a name of its own",
    )

    anthropic_image = {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}
    assert post("/v1/messages", {"model": model, "max_tokens": 8, "messages": [anthropic_image]}) == (
        400,
        {"type": "error", "error": {"type": "invalid_request_error",
                                    "message": "messages[0].content[0]: image blocks are not read by this server; send text and tool_result"}},
    )  # fmt: skip
    assert post("/v1/messages", user, {"Authorization": ""}) == (
        401,
        {"type": "error", "error": {"type": "authentication_error", "message": "unauthorized: no bearer token; send "
                                    f"'Authorization: Bearer TOKEN' with the token in {serve_paths().token}"}},
    )  # fmt: skip
    status, error = post("/v1/chat/completions", user, {"Origin": "http://evil.example"})
    assert (status, error["error"]["type"]) == (403, "permission_error")
    assert error["error"]["message"].startswith(
        "forbidden: the Origin header 'http://evil.example' is not this server's"
    )
    # A body over the limit is refused before it is read when its Content-Length says so (none of it sent here),
    # and as it streams in when chunked (refused at 32 MiB of a 64 MiB body, not held whole). The refused body
    # is never read, so the connection closes after the answer: kept alive, the client's next request on it was
    # read as the 33 MiB it still owed, and never answered.
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = f"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n"
        sock.sendall(f"{head}Content-Length: {33 * 2**20}\r\n\r\n".encode())
        refused = http.client.HTTPResponse(sock)
        refused.begin()
        assert (refused.status, refused.getheader("connection"), json.loads(refused.read())["error"]) == (
            413,
            "close",
            {"type": "request_too_large", "message": "the request body is over 32 MiB; send a shorter conversation"},
        )
        models = f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n\r\n"
        try:
            sock.sendall(models.encode())
            after = sock.recv(65536)
        except ConnectionError:  # the server's end is closed: a reset, or a broken pipe
            after = b""
        assert after == b""  # closed: no answer to the second request, which was not read as a body either
    # A client that sends the whole 33 MiB all the same reads the 413, not a reset: the close lingers while it sends.
    status, error = post("/v1/chat/completions", b" " * (33 * 2**20))
    assert (status, error["error"]["code"]) == (413, None)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        )
        sock.sendall(head.encode())
        mib = 0
        while not select.select([sock], [], [], 0)[0] and mib < 64:
            sock.sendall(b"100000\r\n" + b" " * 2**20 + b"\r\n")
            mib += 1
        chunked = http.client.HTTPResponse(sock)
        chunked.begin()
        assert (chunked.status, json.loads(chunked.read())["error"]["code"]) == (413, None)
    assert 32 <= mib < 48, f"{mib} MiB were sent before the answer"
    assert post("/v1/chat/completions", "", method="GET") == (
        405,
        openai_error("GET /v1/chat/completions is not served; use POST"),
    )
    status, error = post("/v1/embeddings", {})
    assert status == 404 and error["error"]["message"].startswith("not found: POST /v1/embeddings; this server serves")
    # A path's line breaks (percent-encoded) neither break an error's one line nor forge a line in the log, with
    # the token or without it (any local process can send one).
    status, error = post("/v1/x%0d%0a2026-01-01%2000:00:00,000%20INFO%20forged", {})
    assert status == 404 and error["error"]["message"].startswith(
        "not found: POST /v1/x 2026-01-01 00:00:00,000 INFO forged;"
    )
    status, _ = post("/v1/y%0aINFO%20forged", {}, {"Authorization": ""})
    assert status == 401
    assert [
        line for line in serve_paths().log.read_text().splitlines() if "forged" in line and "HTTP POST" not in line
    ] == []
