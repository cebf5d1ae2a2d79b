"""Choosing an engine: `engine:`/`engine_model:` in agent files, `--engine` on the command line,
and what a user sees (messages, exit codes, transcripts) when the engine fails."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.agents.discovery import user_agents_dir
from mlx_subagents.agents.spec import parse_agent_file
from mlx_subagents.errors import AgentFileError
from mlx_subagents.runs.transcripts import read_transcript
from mlx_subagents.testing.fake_engine import FAKE_MODEL, FakeEngine, Fault, Reply

ENGINE = "http://gpu-box:8000/v1"


def agent_file(tmp_path: Path, extra: str, name: str = "big") -> Path:
    path = tmp_path / f"{name}.md"
    path.write_text(f"---\nname: {name}\ndescription: Runs on the engine.\ntools: read, ls\n{extra}---\n\nYou help.\n")
    return path


def test_an_agent_names_its_engine_and_the_engines_model(tmp_path: Path) -> None:
    spec = parse_agent_file(agent_file(tmp_path, f"engine: {ENGINE}\nengine_model: openai/gpt-oss-20b\n"), "user")
    assert (spec.engine, spec.engine_model, spec.model) == (ENGINE, "openai/gpt-oss-20b", None)
    assert spec.warnings == ()


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        (f"engine: {ENGINE}\n", "fields 'engine' and 'engine_model' must both be given, as text"),
        ("engine_model: qwen3\n", "fields 'engine' and 'engine_model' must both be given, as text"),
        ("engine: gpu-box:8000\nengine_model: qwen3\n", "field 'engine': 'gpu-box:8000' is not an http(s) URL"),
        ("engine: [a]\nengine_model: qwen3\n", "fields 'engine' and 'engine_model' must both be given, as text"),
    ],
)
def test_a_bad_engine_field_is_one_line(tmp_path: Path, extra: str, problem: str) -> None:
    path = agent_file(tmp_path, extra)
    with pytest.raises(AgentFileError) as info:
        parse_agent_file(path, "user")
    fix = "write engine: http://gpu-box:8000/v1 and engine_model: <the engine's model id>"
    assert str(info.value) == f"{path}: {problem}; {fix}"


def test_a_bare_remote_model_name_is_still_refused(tmp_path: Path) -> None:
    path = agent_file(tmp_path, "model: openai/gpt-4o\n")
    with pytest.raises(AgentFileError, match="is a remote 'openai' model; only local MLX models run here"):
        parse_agent_file(path, "user")


# --- the command line on the fake engine --------------------------------------------------------


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    with FakeEngine() as fake:
        yield fake


def on_engine(engine: FakeEngine, *args: str) -> list[str]:
    return [*args, "--engine", engine.url, "--model", FAKE_MODEL, "--json"]


def test_run_on_an_engine_runs_the_tools_here(engine: FakeEngine, tmp_path: Path, run_cli: Any) -> None:
    engine.queue(
        Reply(tool_calls=({"name": "write", "arguments": {"path": "hello.txt", "content": "hi\n"}},)),
        Reply("Wrote hello.txt.", prompt_tokens=500, cached_tokens=450),
    )
    code, out, err = run_cli(*on_engine(engine, "run", "worker", "say hi in hello.txt", "-C", str(tmp_path)))
    assert code == 0, err
    data = json.loads(out)
    assert (data["status"], data["output"], data["model"]) == ("completed", "Wrote hello.txt.", FAKE_MODEL)
    assert data["usage"]["cached_tokens"] == 450 and data["usage"]["turns"] == 2
    assert (tmp_path / "hello.txt").read_text() == "hi\n"
    tools = [t["function"]["name"] for t in engine.chat_requests()[0].body["tools"]]
    assert tools == ["read", "grep", "find", "ls", "bash", "edit", "write", "task_output", "task_cancel"]


def test_thinking_off_asks_the_engines_template_for_no_thinking(
    engine: FakeEngine, tmp_path: Path, run_cli: Any
) -> None:
    engine.queue(Reply("thought"), Reply("quick"), Reply("budgeted"))
    for thinking in ((), ("--thinking", "off"), ("--thinking", "512")):
        code, _, err = run_cli(*on_engine(engine, "run", "scout", "x", "-C", str(tmp_path)), *thinking)
        assert code == 0, err
    bodies = [r.body for r in engine.chat_requests()]
    assert [body.get("chat_template_kwargs") for body in bodies] == [None, {"enable_thinking": False}, None]


@pytest.mark.slow
def test_an_engine_that_is_not_running_stops_the_command(tmp_path: Path, run_cli: Any) -> None:
    with socket.socket() as s:  # bound, never listening: refused, and no other process can take the port
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
        code, out, err = run_cli("run", "scout", "x", "--engine", url, "--model", "m", "-C", str(tmp_path))
    assert (code, out) == (2, "")
    assert err == f"error: engine {url}: connection refused; start the engine, or check the host and port in --engine\n"


def test_the_api_key_flag_and_a_refused_key(tmp_path: Path, run_cli: Any) -> None:
    with FakeEngine(api_key="team-key") as engine:
        code, _, err = run_cli(*on_engine(engine, "run", "scout", "x", "-C", str(tmp_path)), "--api-key", "bad")
        assert code == 2 and err.startswith(f"error: engine {engine.url}: the API key was refused (401")
        engine.queue(Reply("fine"))
        code, out, err = run_cli(*on_engine(engine, "run", "scout", "x", "-C", str(tmp_path)), "--api-key", "team-key")
        assert code == 0 and json.loads(out)["output"] == "fine"


def test_a_fault_mid_task_fails_that_task_and_its_transcript_keeps_everything(
    engine: FakeEngine, tmp_path: Path, run_cli: Any
) -> None:
    (tmp_path / "a.py").write_text("print('a')\n")
    engine.queue(Reply(tool_calls=({"name": "read", "arguments": {"path": "a.py"}},)), Fault("cut", content="So far"))
    code, out, err = run_cli(*on_engine(engine, "run", "scout", "read a.py", "-C", str(tmp_path)))
    data = json.loads(out)
    assert code == 1 and data["status"] == "failed"
    assert data["error"] == (
        f"engine {engine.url}: the stream was cut mid-reply after 6 characters; the engine may have crashed or "
        "restarted (check its logs), then retry"
    )
    messages = read_transcript(Path(data["transcript"])).messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert "print('a')" in messages[-1]["content"]


def test_siblings_finish_when_one_task_exhausts_its_retries(engine: FakeEngine, tmp_path: Path, run_cli: Any) -> None:
    engine.queue(*[Fault("status", 503, "overloaded", headers=(("retry-after-ms", "10"),))] * 10, when="task A")
    engine.queue(Reply("B done"), when="task B")
    args = ["parallel", "-t", "scout", "task A", "-t", "scout", "task B", "-C", str(tmp_path)]
    code, out, err = run_cli(*on_engine(engine, *args))
    data = json.loads(out)
    assert code == 1
    assert [(r["status"], r["output"]) for r in data["results"]] == [("failed", ""), ("completed", "B done")]
    assert data["results"][0]["error"] == (
        f"engine {engine.url}: unavailable (503: overloaded) after 3 retries; wait until the engine is up, or lower "
        "--concurrency"
    )
    assert sum("task A" in json.dumps(r.body) for r in engine.chat_requests()) == 4  # 1 + 3 retries, no more


def test_an_unknown_model_lists_the_engines_models(engine: FakeEngine, tmp_path: Path, run_cli: Any) -> None:
    code, out, _ = run_cli(
        "run", "scout", "x", "--engine", engine.url, "--model", "gpt-5", "-C", str(tmp_path), "--json"
    )
    assert code == 1
    assert json.loads(out)["error"] == (
        f"engine {engine.url}: model 'gpt-5' not found; it serves fake-model; pass one with --model"
    )


def test_engine_needs_a_model(engine: FakeEngine, tmp_path: Path, run_cli: Any) -> None:
    code, out, err = run_cli("run", "scout", "x", "--engine", engine.url, "-C", str(tmp_path))
    assert (code, out) == (2, "")
    assert err == "error: --engine needs --model, the engine's model id (or engine_model: in the agent file)\n"
    assert engine.chat_requests() == []


def test_an_agent_file_sends_its_agent_to_its_engine_and_model_overrides_it(
    engine: FakeEngine, tmp_path: Path, run_cli: Any, write_script: Any
) -> None:
    agents = user_agents_dir()  # the user's own agent: a project's engine: is not honoured (tests/runs/test_consent)
    agents.mkdir(parents=True, exist_ok=True)
    agent_file(agents, f"engine: {engine.url}\nengine_model: {FAKE_MODEL}\n")
    engine.queue(Reply("from the engine"))
    code, out, err = run_cli("run", "big", "x", "-C", str(tmp_path), "--yes", "--json")
    assert code == 0, err
    assert json.loads(out)["output"] == "from the engine" and len(engine.chat_requests()) == 1
    code, out, err = run_cli("run", "big", "x", "-C", str(tmp_path), "--yes", "--json", "-m", write_script(["local"]))
    assert code == 0 and json.loads(out)["output"] == "local" and len(engine.chat_requests()) == 1


def test_more_than_four_at_once_only_on_an_engine(engine: FakeEngine, tmp_path: Path, run_cli: Any) -> None:
    tasks = [arg for i in range(6) for arg in ("-t", "scout", f"task {i}")]
    for i in range(6):
        engine.queue(Reply(f"done {i}", together=6), when=f"task {i}")
    code, out, err = run_cli(*on_engine(engine, "parallel", *tasks, "-C", str(tmp_path), "--concurrency", "6"))
    assert code == 0, err
    assert [r["output"] for r in json.loads(out)["results"]] == [f"done {i}" for i in range(6)]
    assert engine.peak_in_flight == 6
    code, _, err = run_cli("parallel", *tasks, "-C", str(tmp_path), "--concurrency", "6", "-m", "scripted:x.json")
    assert code == 2 and "concurrency must be from 1 to 4 (up to 8 with --engine), got 6" in err


def test_resume_goes_back_to_the_engine_with_the_whole_conversation(
    engine: FakeEngine, tmp_path: Path, run_cli: Any
) -> None:
    engine.queue(Reply("auth is in src/auth.py"), Reply("and tested in tests/test_auth.py"))
    code, out, err = run_cli(*on_engine(engine, "run", "scout", "where is auth?", "-C", str(tmp_path)))
    assert code == 0, err
    code, out, err = run_cli(*on_engine(engine, "resume", "last", "and its tests?"))
    assert code == 0, err
    assert json.loads(out)["output"] == "and tested in tests/test_auth.py"
    first, second = (r.body["messages"] for r in engine.chat_requests())
    assert second[: len(first)] == first
    assert second[len(first) :] == [
        {"role": "assistant", "content": "auth is in src/auth.py"},
        {"role": "user", "content": "and its tests?"},
    ]


def test_a_sub_agent_runs_on_its_parents_engine(engine: FakeEngine, tmp_path: Path, run_cli: Any) -> None:
    agents = user_agents_dir()
    agents.mkdir(parents=True)
    text = (
        f"---\nname: lead\ndescription: Delegates.\ntools: subagent\nengine: {engine.url}\nengine_model: {FAKE_MODEL}\n"
    )
    (agents / "lead.md").write_text(f"{text}---\n\nYou delegate.\n")
    engine.queue(Reply("x is in a.py"), when="Task: where is x")
    delegation = {"name": "subagent", "arguments": {"agent": "scout", "task": "where is x"}}
    engine.queue(Reply(tool_calls=(delegation,)), Reply("The scout says: a.py"))
    code, out, err = run_cli("run", "lead", "find x", "-C", str(tmp_path), "--json")
    assert code == 0, err
    assert json.loads(out)["output"] == "The scout says: a.py"
    systems = [r.body["messages"][0]["content"] for r in engine.chat_requests()]
    assert [s.startswith("You delegate.") for s in systems] == [True, False, True]  # lead, its scout, lead
