"""`subagent` as the client of an MCP conformance scenario: the program the suite runs (`conformance.py`).

Run as `python conformance_client.py URL` with `MCP_CONFORMANCE_SCENARIO` set: in a fresh home it
defines the suite's mock server as the HTTP server `conf` (the home's `mcp.json`), an agent whose tools
are `mcp__conf__*`, and a scripted model that calls the scenario's tool; then it runs `subagent` as a
person would, and exits with its exit code: `subagent run` for most scenarios; for the elicitation
one, `subagent chat` on a pseudo-terminal, where the person presses Enter at each field of the
server's form (keeping its defaults) and sends it; for the OAuth ones, `subagent mcp-servers login
conf` first, this script standing in for the browser (it opens the address login prints, and the
mock authorization server sends it back to login's loopback address at once), then `subagent run`
(a chat instead, for the scope step-up, where the person opens the address the chat shows).

`DRIVER_MODE` changes that for the tests: `login-only` (the sign-in, no run), `no-login` and `refused`
(a run with no tokens, or with a token the server refuses; its stderr is passed on, and it exits 3).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
AGENT = "---\nname: conf-user\ndescription: calls the conformance server\ntools: mcp__conf__*\n---\nUse the tools.\n"
# The tool each scenario's mock server offers, and its arguments (the auth scenarios' is `test-tool`).
TOOL_FOR = {
    "tools_call": ("add_numbers", {"a": 5, "b": 3}),
    "sse-retry": ("test_reconnection", {}),
    "elicitation-sep1034-client-defaults": ("test_client_elicitation_defaults", {}),
}


def replies(scenario: str) -> list[Any]:
    """The scripted model's replies: call the scenario's tool once, then answer."""
    if scenario == "initialize":
        return ["connected"]
    name, arguments = TOOL_FOR.get(scenario, ("test-tool", {}))
    return [{"tool_calls": [{"name": f"mcp__conf__{name}", "arguments": arguments}]}, "done"]


def set_up(folder: Path, url: str, scenario: str) -> tuple[dict[str, str], Path, str]:
    """A home with the server and the agent, a workspace, a script: `(env, workspace, model)`."""
    home, workspace = folder / "home", folder / "workspace"
    (home / "agents").mkdir(parents=True)
    workspace.mkdir()
    (home / "mcp.json").write_text(json.dumps({"mcpServers": {"conf": {"type": "http", "url": url}}}))
    (home / "agents" / "conf-user.md").write_text(AGENT)
    script = folder / "script.json"
    script.write_text(json.dumps({"replies": replies(scenario)}))
    env = {**os.environ, "MLX_SUBAGENTS_HOME": str(home), "HOME": str(folder), "PYTHONPATH": str(REPO)}
    return env, workspace, f"scripted:{script}"


def subagent(*args: str) -> list[str]:
    return [sys.executable, "-m", "mlx_subagents.cli", *args]


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
    """`subagent mcp-servers login conf`, with this script as the browser: open the address it prints."""
    context = json.loads(os.environ.get("MCP_CONFORMANCE_CONTEXT") or "{}")
    registered = ["--client-id", context["client_id"]] if context.get("client_id") else []
    env = {**env, "MCP_CLIENT_SECRET": context.get("client_secret") or ""}
    cmd = subagent("mcp-servers", "login", "conf", "-C", str(workspace), *registered)
    login = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert login.stderr is not None
    said = []
    for line in login.stderr:
        said.append(line)
        if line.startswith("http"):
            with urllib.request.urlopen(line.strip(), timeout=30) as page:  # redirected to login's callback
                page.read()
            break
    said.append(login.stderr.read())
    code = login.wait(60)
    sys.stderr.write("".join(said))
    return code


def run_saying_the_sign_in(env: dict[str, str], workspace: Path, model: str, refused: bool) -> int:
    """`subagent run` without a sign-in (or, `refused`, with a token the server refuses and no refresh
    token): its stderr goes to ours, and it exits 3 so that the suite shows it."""
    if refused:
        if (code := sign_in(env, workspace)) != 0:
            return code
        [saved] = (Path(env["MLX_SUBAGENTS_HOME"]) / "mcp-auth").glob("conf-*.json")
        data = json.loads(saved.read_text())
        data["tokens"] = {"access_token": "revoked", "token_type": "Bearer"}
        saved.write_text(json.dumps(data))
    cmd = subagent("run", "conf-user", "use the server", "--model", model, "--cwd", str(workspace))
    proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    sys.stderr.write(proc.stderr)
    return 3


def main(url: str, scenario: str) -> int:
    with tempfile.TemporaryDirectory(prefix="conformance-client-") as tmp:
        env, workspace, model = set_up(Path(tmp), url, scenario)
        if (mode := os.environ.get("DRIVER_MODE")) in ("no-login", "refused"):
            return run_saying_the_sign_in(env, workspace, model, refused=mode == "refused")
        if scenario.startswith("elicitation-"):
            return chat_with_defaults(env, workspace, model)
        if scenario.startswith("auth/") and ((code := sign_in(env, workspace)) != 0 or mode == "login-only"):
            return code
        if scenario == "auth/scope-step-up":
            return chat_signing_in_again(env, workspace, model)
        cmd = subagent("run", "conf-user", "use the server", "--model", model, "--cwd", str(workspace))
        return subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[-1], os.environ.get("MCP_CONFORMANCE_SCENARIO", "initialize")))
