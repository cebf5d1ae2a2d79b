"""A command attached to `subagent serve` loads what it needs to talk to the server and print: nothing of
what runs agents (the model, the hosts, the runner, the tools, the agent files), whose memory every
client would pay again (docs/serve.md#the-commands-attach)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.process]

# `subagent ARGS` in this process; at its exit, the modules it loaded go to $MODULES_FILE.
PROBE = """
import atexit, json, os, runpy, sys
atexit.register(lambda: open(os.environ["MODULES_FILE"], "w").write(json.dumps(sorted(sys.modules))))
runpy.run_module("mlx_subagents.cli", run_name="__main__")
"""
# What runs agents, and the libraries only it uses.
HEAVY = (
    "mlx",
    "mlx_lm",
    "numpy",
    "llguidance",
    "yaml",
    "psutil",
    "jsonschema",
    "mcp",
    "openai",
    "huggingface_hub",
    "wcmatch",
    "mlx_subagents.host",
    "mlx_subagents.tools",
    "mlx_subagents.models",
    "mlx_subagents.testing",
    "mlx_subagents.agents.discovery",
    "mlx_subagents.agents.spec",
    "mlx_subagents.agents.session",
    "mlx_subagents.runs.runner",
)


def loaded_by(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """`subagent ARGS` as a process of its own: what it printed, and the modules it had loaded."""
    modules = tmp_path / "modules.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", "MODULES_FILE": str(modules)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True
    )
    return done, json.loads(modules.read_text())


def heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == h or m.startswith(f"{h}.") for h in HEAVY)]


def test_an_attached_command_loads_nothing_that_runs_agents(
    serve_process: Any, tmp_path: Path, write_script: Any
) -> None:
    from mlx_subagents.serve.state import serve_paths

    model = write_script({"agents": {"scout": {"replies": ["app.py is the only file"]}}})
    serve_process("--no-http", "--model", model)
    flows = tmp_path / ".mlx-subagents" / "workflows"
    flows.mkdir(parents=True)
    (flows / "map.toml").write_text('[[steps]]\nid = "find"\nagent = "scout"\nprompt = "Find: {input}"\n')
    where = ["-C", str(tmp_path), "--model", model]
    for args in (
        ["run", "scout", "map it", "--json", *where],
        ["workflow", "map", "--input", "the parser", "--json", "-q", *where],
        ["resume", "last", "and the tests?", "--json", "--model", model],  # in its run's folder
    ):
        done, modules = loaded_by(tmp_path, *args)
        answer = json.loads(done.stdout)
        assert (done.returncode, answer.get("results", [answer])[0]["output"]) == (0, "app.py is the only file")
        assert heavy(modules) == []
    log = serve_paths().log.read_text().splitlines()
    connected = [line.split("connected: ")[1].split(" (pid")[0] for line in log if " connected: " in line]
    assert connected == ["subagent run", "subagent workflow", "subagent resume"]  # each ran on the server


def test_the_help_loads_nothing_that_runs_agents(tmp_path: Path) -> None:
    done, modules = loaded_by(tmp_path, "run", "--help")
    assert done.returncode == 0 and "Run one agent on a task in a workspace." in done.stdout
    assert heavy(modules) == []
