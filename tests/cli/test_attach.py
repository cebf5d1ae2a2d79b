"""The CLI's commands attached to a running `subagent serve`: the same output, exit codes, signals and consent."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.runs.published import read_snapshots
from mlx_subagents.runs.transcripts import list_runs
from tests.helpers import SLOW, Terminal, all_dead, call, spawn_cli, wait_for_pids, write_agent

pytestmark = [pytest.mark.slow, pytest.mark.process]
# What differs between two runs of the same task: when and where it was saved, how long it took.
VARYING = {"run_id", "transcript", "duration_s"}
RUN_ID = re.compile(r"\d{8}-\d{6}-\d{3}-[0-9a-f]{4}")


def same(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k not in VARYING}


def served_clients(log: str) -> list[str]:
    return [line.split("connected: ")[1] for line in log.splitlines() if " connected: " in line]


def test_attached_commands_print_and_exit_as_in_their_own_process(
    serve_process: Any, tmp_path: Path, write_script: Any, run_cli: Any
) -> None:
    from mlx_subagents.serve.state import serve_paths

    (tmp_path / "app.py").write_text("print('hi')\n")
    model = write_script(
        {
            "agents": {
                "scout": {"replies": [call("ls", path="."), "app.py is the only file"]},
                "reviewer": {"replies": []},
            }
        }
    )
    serve_process("--no-http", "--model", model)
    where = ["-C", str(tmp_path), "--model", model]
    flows = tmp_path / ".mlx-subagents" / "workflows"
    flows.mkdir(parents=True)
    (flows / "map.toml").write_text('[[steps]]\nid = "find"\nagent = "scout"\nprompt = "Find: {input}"\n')
    for args in (
        ["run", "scout", "map it", "--json"],
        ["parallel", "-t", "scout", "a", "-t", "reviewer", "b", "--json", "-q"],
        ["chain", "-s", "scout", "find it", "-s", "scout", "check: {previous}", "--json", "-q"],
        ["workflow", "map", "--input", "the parser", "--json", "-q"],
    ):
        attached, standalone = run_cli(*args, *where), run_cli(*args, *where, "--standalone")
        assert attached[0] == standalone[0] and RUN_ID.sub("RUN", attached[2]) == RUN_ID.sub("RUN", standalone[2])
        a, s = json.loads(attached[1]), json.loads(standalone[1])
        a_results, s_results = a.pop("results", [a]), s.pop("results", [s])
        assert [same(r) for r in a_results] == [same(r) for r in s_results] and same(a) == same(s)
        assert all(Path(r["transcript"]).is_file() for r in a_results)  # saved in the same state folder
    code, out, _ = run_cli("resume", "last", "and the tests?", "--json", "--model", model)  # in its run's folder
    resumed = json.loads(out)
    assert code == 0 and (resumed["label"], resumed["output"]) == ("find", "app.py is the only file")
    assert run_cli("parallel", "-t", "scout", "a", "-t", "reviewer", "b", *where)[0] == 1  # the reviewer has no reply
    unknown = run_cli("run", "nobody", "x", *where)
    assert unknown == (
        2,
        "",
        "error: unknown agent 'nobody'; available: orchestrator, planner, reviewer, scout, worker\n",
    )
    noted = run_cli("run", "scout", "map it", *where, "--kv-budget", "1GB")
    assert noted[0] == 0 and noted[2].startswith("--kv-budget: running in this process (the server's hosts keep")
    attached = [c.split(" (pid")[0] for c in served_clients(serve_paths().log.read_text())]
    assert attached == [f"subagent {c}" for c in ("run", "parallel", "chain", "workflow", "resume", "parallel", "run")]


def test_a_signal_to_an_attached_command_cancels_its_task_on_the_server(
    serve_process: Any, tmp_path: Path, write_script: Any
) -> None:
    serve_process(
        "--no-http", "--model", write_script({"agents": {"scout": {"replies": [call("bash", command=SLOW)]}}})
    )
    signals = ((signal.SIGINT, 130, "aborted by the user (Ctrl-C)"), (signal.SIGTERM, 143, "stopped by SIGTERM"))
    for signum, code, reason in signals:
        for name in ("bash.pid", "sleep.pid"):
            (tmp_path / name).unlink(missing_ok=True)
        process = spawn_cli("run", "scout", "wait", "-C", str(tmp_path))
        pids = wait_for_pids(tmp_path, time.monotonic() + 60)
        # The attached command publishes its task for `subagent watch` (the server's runner does not).
        snapshots = [(s.command, s.cwd, [(t.label, t.agent) for t in s.tasks]) for s in read_snapshots()]
        assert snapshots == [(f"run scout wait -C {tmp_path}", str(tmp_path), [("scout", "scout")])]
        process.send_signal(signum)
        out, err = process.communicate(timeout=60)
        assert process.returncode == code and out == ""
        assert f"error: {reason}" in err and "aborted: scout" in err
        assert all_dead(pids), "the task's bash outlived the cancel"
        [record] = list_runs(1)
        assert (record.status, record.tasks[0].status) == ("interrupted", "aborted")


def test_kill_9_of_the_server_during_an_attached_run_leaves_no_command_running(
    serve_process: Any, tmp_path: Path, write_script: Any
) -> None:
    """The server runs the task's bash: SIGKILL to the server (no handler runs) still kills it (the tether)."""
    server, _ = serve_process(
        "--no-http", "--model", write_script({"agents": {"scout": {"replies": [call("bash", command=SLOW)]}}})
    )
    process = spawn_cli("run", "scout", "wait", "-C", str(tmp_path))
    try:
        pids = wait_for_pids(tmp_path, time.monotonic() + 60)
        server.kill()
        server.wait(timeout=30)
        assert all_dead(pids, within=5), "the task's bash outlived the server that ran it"
    finally:
        process.kill()
        process.communicate(timeout=30)


def test_consent_is_asked_at_the_clients_terminal_and_never_widens(
    serve_process: Any, tmp_path: Path, write_script: Any, run_cli: Any
) -> None:
    write_agent(tmp_path, "helper", "read, ls")
    serve_process("--no-http", "--model", write_script({"agents": {"helper": {"replies": ["helped"]}}}))
    assert run_cli("run", "helper", "x", "-C", str(tmp_path), "--yes")[:2] == (0, "helped\n")
    refused = run_cli("run", "helper", "x", "-C", str(tmp_path))  # another client: the first one's --yes is its own
    path = tmp_path / ".mlx-subagents" / "agents" / "helper.md"
    assert refused == (
        2,
        "",
        f"error: agent 'helper' comes from the project file {path}; its bash runs sandboxed in this workspace. "
        "Re-run with --yes-agents (or --yes) to allow it.\n",
    )
    term = Terminal(["run", "helper", "x", "-C", str(tmp_path)])
    try:
        term.expect(
            f"agent 'helper' comes from the project file {path}; its bash runs sandboxed in this workspace. Allow it? "
            "[y/N]: "
        )
        term.send("y\n")
        term.expect("helped")
        assert term.wait(60) == 0
    finally:
        term.close()


def test_an_attached_chat_answers_and_reports_as_a_local_one(
    serve_process: Any, tmp_path: Path, write_script: Any, run_cli: Any
) -> None:
    model = write_script(
        {
            "agents": {
                "orchestrator": {
                    "replies": [call("subagent", agent="scout", task="look"), "the scout says: found", "bye"]
                },
                "scout": {"replies": ["found"]},
            }
        }
    )
    serve_process("--no-http", "--model", model)
    where = ["-C", str(tmp_path), "--model", model]
    attached = run_cli("chat", "--once", "help me", *where)
    standalone = run_cli("chat", "--once", "help me", *where, "--standalone")
    assert attached[:2] == standalone[:2] == (0, "the scout says: found\n")
    assert attached[2].split("saved as run")[0] == standalone[2].split("saved as run")[0]
    term = Terminal(["chat", *where])
    try:
        term.expect("/exit leaves\n> ")
        term.send("help me\n")
        term.expect("the scout says: found")
        term.send("/usage\n")
        assert "sub-agents: 1 started, 1 turns" in term.expect("saved as run ")
        term.send("/tasks\n")
        term.expect("no background sub-agents yet")
        term.send("/exit\n")
        assert term.wait(60) == 0
    finally:
        term.close()
