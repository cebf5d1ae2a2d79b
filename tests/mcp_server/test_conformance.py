"""The official MCP conformance suite (`@modelcontextprotocol/conformance`) against `subagent serve` over HTTP."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.mcp_server.state import serve_paths

pytestmark = [pytest.mark.slow, pytest.mark.process]
SCENARIOS = ["server-initialize", "ping", "tools-list", "logging-set-level", "dns-rebinding-protection"]


def test_the_server_scenarios_pass_against_subagent_serve(
    serve_process: Any, conformance_suite: tuple[Path, Path], tmp_path: Path, write_script: Any
) -> None:
    node, cli = conformance_suite
    _, info = serve_process("--port", "0", "--model", write_script(["unused"]), "-C", str(tmp_path))
    url = f"{info.url}?token={serve_paths().token.read_text().strip()}"  # the suite sets no headers
    results = tmp_path / "results"
    failed = {}
    for scenario in SCENARIOS:
        # The CLI's shebang is `env node` (Debian's node 20 would run it): run it with node 22.
        cmd = [str(node), str(cli), "server", "--url", url, "--scenario", scenario, "-o", str(results)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            failed[scenario] = proc.stdout[-2000:] + proc.stderr[-2000:]
    assert failed == {}
    files = sorted(results.glob("*/checks.json"))  # one folder per scenario run
    checks = [c for path in files for c in json.loads(path.read_text())]
    assert len(files) == len(SCENARIOS)
    assert checks and {c["status"] for c in checks} == {"SUCCESS"}
    ids = {c["id"] for c in checks}
    assert {
        "ping",
        "tools-list",
        "logging-set-level",
        "localhost-host-rebinding-rejected",
        "localhost-host-valid-accepted",
    } <= ids
