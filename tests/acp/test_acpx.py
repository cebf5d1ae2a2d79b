"""`subagent acp` driven by a client nobody here wrote: acpx, the headless ACP client from npm (built on
the official TypeScript SDK, `@agentclientprotocol/sdk`), run with node 22 from npm. It is installed
once into the test cache; without npm or the registry the tests skip, except under `CI=true`, where
they fail."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO
from tests.mcp_server.conformance import npm_packages

pytestmark = [pytest.mark.slow, pytest.mark.process]

ACPX = {"acpx": "0.19.1"}


def acpx(cwd: Path, model: str, *args: str, code: int = 0) -> list[dict[str, Any]]:
    """`acpx --agent "subagent acp --model MODEL" --cwd CWD --format json ARGS`: the JSON-RPC messages it
    printed, both ways; it exits with `code` (acpx's 5: a permission was denied)."""
    root = npm_packages(f"acpx-{ACPX['acpx']}", ACPX, "acpx", "the acpx client")
    agent = shlex.join([sys.executable, "-m", "mlx_subagents.cli", "acp", "--model", model])
    node, cli = root / "node_modules" / ".bin" / "node", root / "node_modules" / "acpx" / "dist" / "cli.js"
    command = [str(node), str(cli), "--agent", agent, "--cwd", str(cwd), "--format", "json", "--ttl", "0", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=cwd)
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def updates(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m["params"]["update"] for m in messages if m.get("method") == "session/update"]


def test_acpx_runs_a_prompt_reading_through_its_own_files(tmp_path: Path, write_script: Any) -> None:
    (tmp_path / "a.txt").write_text("hello from the disk\n")
    script = {"agents": {"orchestrator": {"replies": [
        {"reasoning": "read it", "tool_calls": [{"name": "read", "arguments": {"path": "a.txt"}}]},
        "a.txt says hello",
    ]}}}  # fmt: skip
    messages = acpx(tmp_path, write_script(script), "--approve-all", "exec", "what does a.txt say?")
    init = next(m for m in messages if m.get("id") == 0 and "result" in m)
    assert init["result"]["agentInfo"]["name"] == "mlx-subagents"
    kinds = [u["sessionUpdate"] for u in updates(messages) if u["sessionUpdate"] != "usage_update"]
    assert kinds == [
        "session_info_update",
        "agent_thought_chunk",
        "tool_call",
        "tool_call_update",
        "agent_message_chunk",
    ]
    assert any(m.get("method") == "fs/read_text_file" for m in messages)  # acpx offered its files: they were used
    answer = next(m for m in messages if "result" in m and "stopReason" in (m["result"] or {}))
    assert answer["result"]["stopReason"] == "end_turn"


def test_acpx_denying_a_write_leaves_the_file_and_allowing_it_writes(tmp_path: Path, write_script: Any) -> None:
    (tmp_path / "a.txt").write_text("old\n")
    script = {"agents": {"worker": {"replies": [
        {"tool_calls": [{"name": "write", "arguments": {"path": "a.txt", "content": "new\n"}}]}, "done",
    ]}}}  # fmt: skip
    model = write_script(script)
    denied = acpx(tmp_path, model, "--deny-all", "exec", "--config-option", "agent=worker", "rewrite a.txt", code=5)
    assert (tmp_path / "a.txt").read_text() == "old\n"
    asked = [m for m in denied if m.get("method") == "session/request_permission"]
    assert len(asked) == 1 and asked[0]["params"]["toolCall"]["content"][0]["type"] == "diff"
    ends = [u for u in updates(denied) if u["sessionUpdate"] == "tool_call_update" and u.get("status")]
    assert ends[-1]["status"] == "failed"

    acpx(tmp_path, model, "--approve-all", "exec", "--config-option", "agent=worker", "rewrite a.txt")
    assert (tmp_path / "a.txt").read_text() == "new\n"  # written by acpx, through fs/write_text_file
