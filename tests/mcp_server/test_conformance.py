"""The official MCP conformance suite (`conformance.py`, its newest version) against this project, both
ways and at both revisions, 2025-11-25 and 2026-07-28 (issues 39, 45, 65): one run of the suite per
revision and role, each scenario's checks read back and reported by name.

As a server: `subagent serve` over streamable HTTP, and the Tasks extension on `tasks_server.py`. As a
client: `subagent` itself, driven by `conformance_client.py`, which the suite runs with its mock
server's URL."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.serve.state import serve_paths
from tests.helpers import REPO, wait_listening
from tests.mcp_server.conformance import Outcome, Suite, conformance_suite
from tests.mcp_server.conformance_client import NOT_APPLICABLE, PRELOAD
from tests.preloaded import preloaded

pytestmark = [pytest.mark.slow, pytest.mark.process]

DRIVER = Path(__file__).with_name("conformance_client.py")


@pytest.fixture(scope="module")
def suite() -> Suite:
    return conformance_suite()


@pytest.fixture(scope="module")
def driver(suite: Suite) -> Iterator[list[str]]:
    """The command the suite runs for a client scenario: `subagent`, set up and driven by the driver,
    each scenario in a fork of one process that imported what `subagent` needs (about 2 s of CPU each)."""
    with preloaded(PRELOAD, env={**os.environ, "PYTHONPATH": str(REPO)}) as python:
        yield [*python, str(DRIVER)]


# As a server, at each revision, what the revision requires (`--requirements`) in one run of the suite.
# What applies to `subagent serve`, by revision; at 2026-07-28 the checks that need what only the
# suite's reference server has fail: a diagnostic tool (`test_missing_capability`), prompts and
# resources to cache.
SERVER_SCENARIOS = {
    "2025-11-25": [
        "server-initialize", "server-session-lifecycle", "ping", "logging-set-level", "tools-list",
        "server-sse-multiple-streams", "dns-rebinding-protection",
    ],
    "2026-07-28": ["server-stateless", "tools-list", "caching", "server-sse-multiple-streams", "dns-rebinding-protection"],
}  # fmt: skip
NOT_APPLICABLE_2026 = {
    "sep-2575-server-rejects-undeclared-capability",
    "sep-2575-missing-capability-http-400",
    "sep-2549-prompts-list-caching-hints",
    "sep-2549-resources-list-caching-hints",
    "sep-2549-resources-templates-list-caching-hints",
}
# Why the others do not apply to `subagent serve`, by the start of their names (docs/mcp.md lists them).
NOT_SERVED = {
    ("tools-call-", "prompts-", "resources-", "completion-", "elicitation-", "json-schema-2020-12",
     "input-required-result-", "sep-2164-", "server-sse-polling"):
        "it calls the reference server's own tools, prompts or resources (its checks pass only there)",
    ("tasks-",): "the Tasks extension's, run against tasks_server.py (below)",
    ("http-header-validation", "http-custom-header-server-validation"):
        "the suite drops the URL's query, so its requests never carry the token (401)",
}  # fmt: skip


def why_not_served(scenario: str) -> str | None:
    return next((why for starts, why in NOT_SERVED.items() if scenario.startswith(starts)), None)


def test_subagent_serve_passes_the_server_scenarios_of_both_revisions(
    suite: Suite, serve_process: Any, tmp_path: Path, write_script: Any
) -> None:
    """One `subagent serve` for both revisions (each HTTP session, or each 2026 request, is served by
    `AgentsServer`'s handlers, what `subagent mcp` serves on stdio), behind its token and Host guard."""
    _, info = serve_process("--port", "0", "--model", write_script(["unused"]), "-C", str(tmp_path))
    url = f"{info.url}?token={serve_paths().token.read_text().strip()}"  # the suite sets no headers
    # One revision after the other: a check of `server-stateless` waits 500 ms for an answer.
    runs = {revision: suite.server_batch(url, revision) for revision in SERVER_SCENARIOS}
    for revision, outcomes in runs.items():
        applies = [o for name, o in outcomes.items() if name in SERVER_SCENARIOS[revision]]
        assert [o.scenario for o in applies] == sorted(SERVER_SCENARIOS[revision]), revision
        assert [name for name in outcomes if name not in SERVER_SCENARIOS[revision] and not why_not_served(name)] == []
        allowed = NOT_APPLICABLE_2026 if revision == "2026-07-28" else set()
        bad = [o.report() for o in applies if set(o.failed) - allowed or o.warnings or not o.passed]
        assert bad == [], "\n\n".join(bad)
    assert {
        check for o in runs["2026-07-28"].values() if o.scenario in SERVER_SCENARIOS["2026-07-28"] for check in o.failed
    } == NOT_APPLICABLE_2026
    passed = {check for outcomes in runs.values() for o in outcomes.values() for check in o.passed}
    assert {
        "ping",
        "logging-set-level",
        "server-session-terminated-returns-404",
        "localhost-host-rebinding-rejected",
        "localhost-host-valid-accepted",
        "sep-2575-http-server-method-not-found-404-initialize",
        "tools-list-deterministic-order",
        "sep-2549-tools-list-caching-hints",
    } <= passed


def test_the_tasks_extension_passes_the_suites_tasks_scenarios(suite: Suite) -> None:
    """`call_tasks.py` (the Tasks extension written here) on the SDK's lowlevel server, with the tools the
    scenarios call (tests/mcp_server/tasks_server.py); `run_agents` answers through the same `CallTasks`.
    The Tasks scenarios are the extension's, run (not scored) with what 2026-07-28 requires."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "mcp_server" / "tasks_server.py"), "http", str(port)]
    )
    try:
        wait_listening(server, port, "the tasks server")
        outcomes = suite.server_batch(f"http://127.0.0.1:{port}/mcp", "2026-07-28")
    finally:
        server.kill()
        server.wait()
    tasks = [o for name, o in outcomes.items() if name.startswith("tasks-")]
    assert [o.scenario for o in tasks] == sorted(TASKS_SCENARIOS)
    bad = [o.report() for o in tasks if not o.ok]
    assert bad == [], "\n\n".join(bad)
    assert sum(len(o.passed) for o in tasks) == 44  # tasks-status-notifications checks nothing yet


TASKS_SCENARIOS = [
    "tasks-lifecycle",
    "tasks-capability-negotiation",
    "tasks-wire-fields",
    "tasks-request-state-removal",
    "tasks-mrtr-input",
    "tasks-request-headers",
    "tasks-dispatch-and-envelope",
    "tasks-status-notifications",
    "tasks-required-task-error",
    "tasks-mrtr-composition",
]


# As a client, at each revision, what it requires (`--requirements`) in one run of the suite, all at
# once: `subagent run` calls the mock server's tools; an elicitation answered in `subagent chat` with
# the form's defaults; the OAuth ones signed in by `subagent mcp-servers login` (the driver plays the
# browser), some followed by a run with the saved tokens, the scope step-up signing in again from a
# chat; at 2026-07-28 also the per-request `_meta` and version header, input-required results retried
# with their state, the routing and custom headers, a tool with a bad header annotation dropped and the
# others kept, no `$ref` fetched over the network, the issuer checks of RFC 9207 and 8414, the offline
# access scope, a resource the server does not own, an authorization server that moves (signed in
# again, registered anew). The extensions' scenarios run too and are refused by the driver, saying why
# (its `NOT_APPLICABLE`; docs/mcp.md lists them).
SHARED_AUTH = [
    "auth/metadata-default", "auth/metadata-var1", "auth/metadata-var2", "auth/metadata-var3",
    "auth/scope-from-www-authenticate", "auth/scope-from-scopes-supported", "auth/scope-omitted-when-undefined",
    "auth/scope-step-up", "auth/scope-retry-limit", "auth/token-endpoint-auth-basic",
    "auth/token-endpoint-auth-post", "auth/token-endpoint-auth-none", "auth/pre-registration",
]  # fmt: skip
CLIENT_SCENARIOS = {
    "2025-11-25": ["initialize", "tools_call", "elicitation-sep1034-client-defaults", "sse-retry", *SHARED_AUTH],
    "2026-07-28": [
        "tools_call", "request-metadata", *SHARED_AUTH, "auth/resource-mismatch", "auth/offline-access-scope",
        "auth/offline-access-not-supported", "auth/authorization-server-migration", "auth/iss-supported",
        "auth/iss-not-advertised", "auth/iss-supported-missing", "auth/iss-wrong-issuer", "auth/iss-unexpected",
        "auth/iss-normalized", "auth/metadata-issuer-mismatch", "sep-2322-client-request-state",
        "http-standard-headers", "http-custom-headers", "http-invalid-tool-headers", "json-schema-ref-no-deref",
    ],
    # The oldest revision's (2025-03-26) OAuth fallbacks: no metadata, the endpoints at the server's root.
    "backcompat@2025-03-26": ["auth/2025-03-26-oauth-endpoint-fallback", "auth/2025-03-26-oauth-metadata-backcompat"],
}  # fmt: skip
# The scenarios where the client is right to end in an error (the suite's `allowClientError`): it must
# refuse the server's answer, or stop asking.
CLIENT_MAY_FAIL = {
    "auth/scope-retry-limit", "auth/resource-mismatch", "auth/iss-supported-missing", "auth/iss-wrong-issuer",
    "auth/iss-unexpected", "auth/iss-normalized", "auth/metadata-issuer-mismatch", "http-invalid-tool-headers",
}  # fmt: skip


def client_batch(suite: Suite, driver: list[str], selection: str, folder: Path) -> dict[str, Outcome]:
    """The suite's batch against the driver (a few scenarios at a time: the driver's `AT_ONCE`), each
    outcome with the driver's exit code (-1: none, it was stopped), which a batch does not keep."""
    folder.mkdir()
    outcomes = suite.batch(driver, selection, env={"PYTHONPATH": str(REPO), "DRIVER_BATCH": str(folder)})
    exits = {path.stem.replace("__", "/"): int(path.read_text()) for path in folder.glob("*.code")}
    return {name: replace(o, code=exits.get(name, -1)) for name, o in outcomes.items()}


def failures(outcomes: dict[str, Outcome], applies: list[str]) -> list[str]:
    """The reports of the scenarios that apply and did not pass as one run of each would (every check
    met, no warning, the client exited 0 unless it may fail), and of any that ran and neither applies
    nor is refused by the driver."""
    bad = [f"{name}: neither applies nor is refused" for name in outcomes if name not in applies + [*NOT_APPLICABLE]]
    for name in applies:
        o = outcomes.get(name) or Outcome(name, -1, [], "the suite did not run it")
        # A reconnection later than the server's retry but not "very late" is a warning, in the suite's
        # words "acceptable but may indicate network delays": a loaded machine's process does that.
        warned = [w for w in o.warnings if not (name == "sse-retry" and w == "client-sse-retry-timing")]
        exited = o.code == 0 or (o.code > 0 and name in CLIENT_MAY_FAIL)
        if o.failed or warned or not o.passed or not exited:
            bad.append(o.report())
    return bad


@pytest.mark.parametrize("revision", ["2025-11-25", "2026-07-28"])
def test_subagent_passes_the_suites_client_scenarios(
    suite: Suite, driver: list[str], revision: str, tmp_path: Path
) -> None:
    selections = [revision, *(["backcompat@2025-03-26"] if revision == "2025-11-25" else [])]
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = pool.map(lambda s: (s, client_batch(suite, driver, s, tmp_path / s.replace("@", "-"))), selections)
        bad = [report for selection, outcomes in runs for report in failures(outcomes, CLIENT_SCENARIOS[selection])]
    assert bad == [], "\n\n".join(bad)


def test_a_run_says_in_one_line_that_a_server_needs_a_sign_in(suite: Suite, driver: list[str]) -> None:
    """Without a sign-in, or with a token the server refuses and nothing to refresh it with."""
    lines = {
        "no-login": "warning: MCP server 'conf' needs a sign-in: run `subagent mcp-servers login conf`",
        "refused": "warning: MCP server 'conf' refused its token (it expired and could not be refreshed, or was "
        "revoked): run `subagent mcp-servers login conf`",
    }

    def run(mode: str) -> Outcome:
        return suite.client(driver, "auth/metadata-default", env={"PYTHONPATH": str(REPO), "DRIVER_MODE": mode})

    with ThreadPoolExecutor(max_workers=2) as pool:
        for line, outcome in zip(lines.values(), pool.map(run, lines)):
            said = outcome.output[outcome.output.index("Stderr:") :].splitlines()
            assert f"{line}; its tools are not offered" in said, outcome.report()
            assert not any("Traceback" in s for s in said)
