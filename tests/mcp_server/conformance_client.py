"""`subagent` as the client of an MCP conformance scenario: the program the suite runs (`conformance.py`).

Run as `python conformance_client.py URL` with `MCP_CONFORMANCE_SCENARIO` set: in a fresh home it
defines the suite's mock server as the HTTP server `conf` (the home's `mcp.json`), an agent whose tools
are `mcp__conf__*`, and a scripted model that calls the scenario's tool; then it runs `subagent` as a
person would, and exits with its exit code: `subagent run` for most scenarios; for the elicitation
one, `subagent chat` on a pseudo-terminal, where the person presses Enter at each field of the
server's form (keeping its defaults) and sends it; for the OAuth ones, `subagent mcp-servers login
conf` first, this script standing in for the browser (it opens the address login prints, and the
mock authorization server sends it back to login's loopback address at once), then `subagent run`
(a chat instead, for the scope step-up, where the person opens the address the chat shows), or the
sign-in alone where it meets every check (`AUTH_WITH_A_RUN`). A scenario that does not apply
(`NOT_APPLICABLE`) is refused at once, saying why. The sign-in and the run are `subagent`'s own
`main` in this process (a chat is a process of its own, on its terminal): the tests run this driver in
a fork of a process that has imported them already (`PRELOAD`, tests/preloaded.py).

`DRIVER_MODE` changes that for the tests: `login-only` (the sign-in, no run), `no-login` and `refused`
(a run with no tokens, or with a token the server refuses; it says why on stderr, and the driver exits 3).
With `DRIVER_BATCH` set to a folder (the suite ran a batch: all its scenarios at once), the driver
takes one of `AT_ONCE` slots there before it starts `subagent` (a lock file; the others wait, idle), so
that two cores are not shared by dozens of runs whose connections time out, and writes its exit code
there, in `SCENARIO.code` (its `/` as `__`), which a batch of the suite does not keep.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
AGENT = "---\nname: conf-user\ndescription: calls the conformance server\ntools: mcp__conf__*\n---\nUse the tools.\n"
# The tools each scenario's mock server offers to call, and their arguments (the auth scenarios' is
# `test-tool`; a scenario that gives its calls in its context, `toolCalls`, is not listed).
TOOLS_FOR: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "tools_call": [("add_numbers", {"a": 5, "b": 3})],
    "sse-retry": [("test_reconnection", {})],
    "elicitation-sep1034-client-defaults": [("test_client_elicitation_defaults", {})],
    # 2026-07-28: input-required results retried (the elicitation declined: nobody answers in a run), a
    # call between them, a result without its type; the routing headers; a tool kept beside bad ones.
    "sep-2322-client-request-state": [
        ("test_mrtr_echo_state", {}), ("test_mrtr_unrelated", {}), ("test_mrtr_no_state", {}),
        ("test_mrtr_no_result_type", {}),
    ],
    "http-standard-headers": [("test_headers", {}), ("my-hyphenated-tool", {})],
    "http-invalid-tool-headers": [("valid_tool", {"region": "us-west1"})],
}  # fmt: skip
# The scenarios that check the connection alone: the run lists the tools and answers.
CONNECTION_ONLY = {"initialize", "request-metadata", "json-schema-ref-no-deref"}
# The OAuth scenarios whose sign-in is followed by a run that calls the tool with the saved tokens (the
# others' checks are all met by the sign-in itself, which is `subagent` too, and a run costs more).
AUTH_WITH_A_RUN = {
    "auth/metadata-default",
    "auth/token-endpoint-auth-post",
    "auth/pre-registration",
    "auth/scope-step-up",
}
# What a run and a sign-in import, for a preloaded process the driver may be forked from
# (tests/preloaded.py): about 2 s of CPU a scenario otherwise.
PRELOAD = [
    "mlx_subagents.cli", "mlx_subagents.runs.runner", "mlx_subagents.runs.execution", "mlx_subagents.runs.prepare",
    "mlx_subagents.host.scripted", "mlx_subagents.tools.mcp", "mlx_subagents.tools.mcp_auth",
    "mlx_subagents.tools.mcp_tasks", "mcp.client.streamable_http", "anyio._backends._asyncio", "httpcore2", "h11",
    "truststore",
]  # fmt: skip
# How many scenarios of a batch run `subagent` at once.
AT_ONCE = 6
# The scenarios that do not apply, and why: the driver says so and exits 1 at once (the suite fails them).
NOT_APPLICABLE = {
    "auth/basic-cimd": "a client ID metadata document needs the client's metadata at a public HTTPS address",
    "auth/client-credentials-jwt": "client credentials are machine-to-machine; subagent signs a person in",
    "auth/client-credentials-basic": "client credentials are machine-to-machine; subagent signs a person in",
    "auth/enterprise-managed-authorization": "cross-app access needs an enterprise identity provider's token",
    "auth/wif-jwt-bearer": "workload identity federation is machine-to-machine; subagent signs a person in",
    "auth/dpop": "the MCP SDK's OAuth client has no DPoP (sender-constrained tokens)",
    "auth/dpop-nonce": "the MCP SDK's OAuth client has no DPoP (sender-constrained tokens)",
    "json-schema-2020-12-preservation": "it needs a model that copies a tool's schema into another call verbatim",
    "sep-2640-client-no-prefetch": "skills over MCP (an extension) are not read from servers",
    "sep-2640-client-verify-digest": "skills over MCP (an extension) are not read from servers",
    "sep-2640-client-verify-size": "skills over MCP (an extension) are not read from servers",
    "sep-2640-client-verify-frontmatter": "skills over MCP (an extension) are not read from servers",
}


def replies(scenario: str) -> list[Any]:
    """The scripted model's replies: call the scenario's tools one by one, then answer."""
    if scenario in CONNECTION_ONLY:
        return ["connected"]
    context = json.loads(os.environ.get("MCP_CONFORMANCE_CONTEXT") or "{}")
    given = [(c["name"], c.get("arguments") or {}) for c in context.get("toolCalls", [])]
    calls = given or TOOLS_FOR.get(scenario, [("test-tool", {})])
    return [{"tool_calls": [{"name": f"mcp__conf__{name}", "arguments": args}]} for name, args in calls] + ["done"]


def set_up(folder: Path, url: str, scenario: str) -> tuple[dict[str, str], Path, str]:
    """A home with the server and the agent, a workspace, a script: `(env, workspace, model)`."""
    home, workspace = folder / "home", folder / "workspace"
    (home / "agents").mkdir(parents=True)
    workspace.mkdir()
    # Patient time-outs: the suite starts every scenario of a batch at once, and on two cores a run's
    # own start (its imports) may take longer than the default 30 s for the server's start and tool list.
    server = {"type": "http", "url": url, "startup_timeout": 300, "timeout": 300}
    (home / "mcp.json").write_text(json.dumps({"mcpServers": {"conf": server}}))
    (home / "agents" / "conf-user.md").write_text(AGENT)
    script = folder / "script.json"
    script.write_text(json.dumps({"replies": replies(scenario)}))
    env = {**os.environ, "MLX_SUBAGENTS_HOME": str(home), "HOME": str(folder), "PYTHONPATH": str(REPO)}
    return env, workspace, f"scripted:{script}"


def chat_with_defaults(env: dict[str, str], workspace: Path, model: str) -> int:
    """`subagent chat` on a pseudo-terminal: one message, Enter at every field of the form, Enter to send."""
    sys.path.insert(0, str(REPO))
    from tests.helpers import Terminal

    os.environ.update(env)  # the terminal's child takes this environment
    term = Terminal(["chat", "--agent", "conf-user", "-m", model, "-C", str(workspace)])
    try:
        term.expect("/exit leaves\n> ", 30)
        term.send("use the server\n")
        term.expect("Enter keeps the value in brackets", 30)
        while "send this to conf?" not in term.expect(": ", 30):
            term.send("\n")  # a field: keep its default
        term.send("\n")  # send the form
        term.expect("done\n> ", 30)
        term.send("/exit\n")
        return term.wait(30)
    finally:
        term.close()


def chat_signing_in_again(env: dict[str, str], workspace: Path, model: str) -> int:
    """`subagent chat` on a pseudo-terminal, where the call asks for more access (a scope step-up): the
    person opens the address the chat shows (this script, as the browser), then says it is done."""
    sys.path.insert(0, str(REPO))
    from tests.helpers import Terminal

    os.environ.update(env)
    term = Terminal(["chat", "--agent", "conf-user", "-m", model, "-C", str(workspace)])
    try:
        term.expect("/exit leaves\n> ", 30)
        term.send("use the server\n")
        shown = term.expect("done there? ", 30)
        address = shown.split("open this address: ", 1)[1].split("\n", 1)[0].strip()
        with urllib.request.urlopen(address, timeout=30) as page:
            page.read()
        term.send("\n")
        term.expect("done\n> ", 30)
        term.send("/exit\n")
        return term.wait(30)
    finally:
        term.close()


def sign_in(env: dict[str, str], workspace: Path) -> int:
    """`subagent mcp-servers login conf` in this process, with this script as the browser: open each
    address it prints to stderr (a server that moves asks for a second sign-in), which goes on to ours."""
    context = json.loads(os.environ.get("MCP_CONFORMANCE_CONTEXT") or "{}")
    registered = ["--client-id", context["client_id"]] if context.get("client_id") else []
    secret = {"MCP_CLIENT_SECRET": context.get("client_secret") or ""}
    ours = os.dup(2)
    said, into = os.pipe()
    failed: list[BaseException] = []

    def browse() -> None:
        with open(said, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                os.write(ours, line.encode())
                if line.startswith("http") and not failed:
                    try:
                        with urllib.request.urlopen(line.strip(), timeout=30) as page:  # to login's callback
                            page.read()
                    except OSError as exc:
                        failed.append(exc)

    browser = threading.Thread(target=browse)
    browser.start()
    sys.stderr.flush()
    os.dup2(into, 2)
    os.close(into)
    try:
        return in_process({**env, **secret}, "mcp-servers", "login", "conf", "-C", str(workspace), *registered)
    finally:
        sys.stderr.flush()
        os.dup2(ours, 2)  # the pipe's last writer closed: the browser reads to its end
        browser.join()
        os.close(ours)
        os.environ.pop("MCP_CLIENT_SECRET")
        if failed:
            raise failed[0]


def run_saying_the_sign_in(env: dict[str, str], workspace: Path, model: str, refused: bool) -> int:
    """`subagent run` without a sign-in (or, `refused`, with a token the server refuses and no refresh
    token), then exit 3 so that the suite shows what it said."""
    if refused:
        if (code := sign_in(env, workspace)) != 0:
            return code
        [saved] = (Path(env["MLX_SUBAGENTS_HOME"]) / "mcp-auth").glob("conf-*.json")
        data = json.loads(saved.read_text())
        data["tokens"] = {"access_token": "revoked", "token_type": "Bearer"}
        saved.write_text(json.dumps(data))
    in_process(env, "run", "conf-user", "use the server", "--model", model, "--cwd", str(workspace))
    return 3


def main(url: str, scenario: str) -> int:
    if scenario in NOT_APPLICABLE:
        sys.stderr.write(f"{scenario} does not apply to subagent: {NOT_APPLICABLE[scenario]}\n")
        return 1
    if batch := os.environ.get("DRIVER_BATCH"):
        take_a_slot(Path(batch))
    with tempfile.TemporaryDirectory(prefix="conformance-client-") as tmp:
        env, workspace, model = set_up(Path(tmp), url, scenario)
        if (mode := os.environ.get("DRIVER_MODE")) in ("no-login", "refused"):
            return run_saying_the_sign_in(env, workspace, model, refused=mode == "refused")
        if scenario.startswith("elicitation-"):
            return chat_with_defaults(env, workspace, model)
        login_only = mode == "login-only" or scenario not in AUTH_WITH_A_RUN
        if scenario.startswith("auth/") and ((code := sign_in(env, workspace)) != 0 or login_only):
            return code
        if scenario == "auth/scope-step-up":
            return chat_signing_in_again(env, workspace, model)
        return in_process(env, "run", "conf-user", "use the server", "--model", model, "--cwd", str(workspace))


def in_process(env: dict[str, str], *args: str) -> int:
    """`subagent ARGS` in this process, its stdin empty: one Python start fewer than a child's."""
    os.environ.update(env)
    sys.path.insert(0, str(REPO))
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    from mlx_subagents import cli

    sys.argv = ["subagent", *args]
    try:
        cli.main()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return 0


def take_a_slot(batch: Path) -> None:
    """Wait for one of the batch's `AT_ONCE` slots, held until this process exits (its lock's file
    descriptor is not inherited by `subagent`'s own children)."""
    while True:
        for slot in range(AT_ONCE):
            fd = os.open(batch / f"slot-{slot}.lock", os.O_CREAT | os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                os.close(fd)
        time.sleep(0.2)


def exit_with(scenario: str, code: int) -> None:
    """Exit with `code`, written first to `$DRIVER_BATCH/SCENARIO.code` in a batch."""
    if batch := os.environ.get("DRIVER_BATCH"):
        (Path(batch) / f"{scenario.replace('/', '__')}.code").write_text(str(code))
    sys.exit(code)


if __name__ == "__main__":
    scenario = os.environ.get("MCP_CONFORMANCE_SCENARIO", "initialize")
    exit_with(scenario, main(sys.argv[-1], scenario))
