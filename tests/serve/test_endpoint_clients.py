"""Clients nobody here wrote, set up as docs/endpoints.md says, against `subagent serve` on the tiny model.

`llm` (PyPI, in the test extra) with the server as an OpenAI-compatible model in its
`extra-openai-models.yaml`, and Claude Code (npm `@anthropic-ai/claude-code`, installed once into the
test cache; skipped without npm, except under `CI=true`) with `ANTHROPIC_BASE_URL`. Each calls a tool
the model asked for, sends its result back, continues the conversation, and counts the prompt the
session's KV cache held. Forced scripts make the random model say each reply through the real path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.serve.state import serve_paths
from mlx_subagents.testing import tool_call_text
from tests.mcp_server.conformance import npm_packages

pytestmark = [pytest.mark.slow, pytest.mark.process]

CLAUDE_CODE = {"@anthropic-ai/claude-code": "2.1.328"}


def run(command: list[str], env: dict[str, str], cwd: Path) -> str:
    """The command's stdout; a failure shows what it printed."""
    proc = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{command[:2]} exited {proc.returncode}: {proc.stdout[-2000:]} {proc.stderr[-2000:]}"
    return proc.stdout


def test_llm_streams_calls_a_tool_and_continues_on_the_served_model(
    serve_process: Any, tmp_path: Path, tiny_qwen3_path: Path
) -> None:
    scripts = {"conversation#1": [tool_call_text("llm_version", {}), "It is the llm you run.", "Still here."]}
    _, info = serve_process(tiny=(tiny_qwen3_path, tmp_path, scripts), http=True)
    home = tmp_path / "llm"
    home.mkdir()
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: subagents\n  model_name: {tiny_qwen3_path}\n  api_base: {info.url.removesuffix('/mcp')}/v1\n"
        "  api_key_name: subagents\n  supports_tools: true\n"
    )
    (home / "keys.json").write_text(json.dumps({"subagents": serve_paths().token.read_text().strip()}))  # llm keys set
    env = {**os.environ, "LLM_USER_PATH": str(home)}
    command = [str(Path(sys.executable).parent / "llm")]

    # It streams; the model calls llm's own tool, llm runs it and sends its result back.
    assert run([*command, "-m", "subagents", "-T", "llm_version", "which llm is this?"], env, tmp_path) == (
        "It is the llm you run.\n"
    )
    assert run([*command, "-c", "-T", "llm_version", "still there?"], env, tmp_path) == "Still here.\n"
    logged = json.loads(run([*command, "logs", "--json", "-n", "3"], env, tmp_path))
    assert [(r["prompt"], r["response"]) for r in logged] == [
        ("which llm is this?", ""),
        ("", "It is the llm you run."),
        ("still there?", "Still here."),
    ]
    assert logged[1]["tool_results"][0]["output"] == version("llm")
    # Each request after the first went on in the same session: its cache held the whole turn before.
    usages = [r["response_json"]["usage"] for r in logged]
    for before, after in zip(usages, usages[1:]):
        assert after["prompt_tokens_details"]["cached_tokens"] == before["prompt_tokens"] + before["completion_tokens"]


def test_claude_code_reads_a_file_the_served_model_asked_for_and_continues(
    serve_process: Any, tmp_path: Path, tiny_qwen3_path: Path
) -> None:
    root = npm_packages("claude-code-" + CLAUDE_CODE["@anthropic-ai/claude-code"], CLAUDE_CODE, "claude", "Claude Code")
    workspace = tmp_path / "project"
    workspace.mkdir()
    notes = workspace / "notes.txt"
    notes.write_text("the meeting moved to Tuesday\n")
    scripts = {
        "conversation#1": [tool_call_text("Read", {"file_path": str(notes)}), "It moved to Tuesday.", "Nothing else."]
    }
    _, info = serve_process(tiny=(tiny_qwen3_path, tmp_path, scripts), http=True)
    model = str(tiny_qwen3_path)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path / "home"),
        "ANTHROPIC_BASE_URL": info.url.removesuffix("/mcp"),
        "ANTHROPIC_AUTH_TOKEN": serve_paths().token.read_text().strip(),
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    claude = [str(root / "node_modules" / ".bin" / "claude"), "--system-prompt", "You are terse.", "--tools", "Read"]

    lines = run([*claude, "-p", "when is the meeting?", "--output-format", "stream-json", "--verbose"], env, workspace)
    events = [json.loads(line) for line in lines.splitlines()]
    said = [(e["type"], part) for e in events if e["type"] in ("assistant", "user") for part in e["message"]["content"]]
    assert [(kind, part["type"]) for kind, part in said] == [
        ("assistant", "tool_use"),
        ("user", "tool_result"),
        ("assistant", "text"),
    ]
    assert (said[0][1]["name"], said[0][1]["input"]) == ("Read", {"file_path": str(notes)})
    assert "the meeting moved to Tuesday" in said[1][1]["content"]
    result = events[-1]
    assert (result["subtype"], result["result"]) == ("success", "It moved to Tuesday.")
    assert result["usage"]["cache_read_input_tokens"] > 0  # the second request went on from the first

    again = json.loads(run([*claude, "-p", "anything else?", "--continue", "--output-format", "json"], env, workspace))
    assert again["result"] == "Nothing else."
    usage = again["usage"]
    # The whole conversation before was held: only the new question is prefilled.
    assert usage["cache_read_input_tokens"] > 10 * usage["input_tokens"]
