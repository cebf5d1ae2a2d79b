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
        "--no-http", "--model", write_script({"agents": {"scout": {"replies": [call("bash", command=SLOW)]}}}), own=True
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


def test_the_paths_a_command_was_given_mean_the_same_on_the_server(
    serve_process: Any, tmp_path: Path, tiny_qwen3_path: Path, run_cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`subagent serve` works in its own folder: a command attached to it makes every path it was given
    absolute before it sends the job (`-C`/`--cwd`, `--model ./folder`, `scripted:FILE`, `$MLX_SUBAGENTS_MODEL`,
    a tasks file's models, `--schema`), in every command and the chat, and a workflow's model path is the workflow file's, as its schema is.
    The README's own demo failed attached ("cannot read the scripted model file")."""
    from mlx_subagents.serve.state import serve_paths

    def replay(path: Path, answer: str) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"agents": {"scout": {"replies": [answer]}}}))
        return path

    here = tmp_path / "here"
    (here / "ws").mkdir(parents=True)
    replay(here / "replay.json", '{"where": "here"}')
    replay(here / "other.json", "from the tasks file")
    replay(here / "ws" / ".mlx-subagents" / "workflows" / "replay.json", "beside the workflow")
    (here / "ws" / ".mlx-subagents" / "workflows" / "map.toml").write_text(
        '[[steps]]\nid = "find"\nagent = "scout"\nprompt = "Find: {input}"\nmodel = "scripted:replay.json"\n'
    )
    (here / "tasks.yaml").write_text("- {agent: scout, task: one, model: 'scripted:other.json'}\n")
    (here / "answer.json").write_text('{"type": "object", "required": ["where"]}')
    (here / "tiny").symlink_to(tiny_qwen3_path)
    serve_process("--no-http", "--model", str(replay(tmp_path / "server.json", "the server's model")))
    monkeypatch.chdir(here)  # the server's folder is the test's: none of these names a file there

    def answers(*args: str, code: int = 0) -> list[tuple[str, str]]:
        exited, out, err = run_cli(*args, "--json", "-q")
        assert exited == code, err
        data = json.loads(out)
        return [(r["output"], r["model"]) for r in data.get("results", [data])]

    replayed = f"scripted:{here / 'replay.json'}"
    assert answers("run", "scout", "x", "-C", "ws", "--model", "scripted:replay.json") == [
        ('{"where": "here"}', replayed)
    ]
    assert answers("run", "scout", "x", "--cwd", "ws", "-m", "scripted:./replay.json", "--schema", "answer.json") == [
        ('{"where": "here"}', replayed)
    ]
    assert answers(
        "chain", "-s", "scout", "x", "-C", "ws", "-m", "scripted:replay.json", "--schema", "answer.json"
    ) == [('{"where": "here"}', replayed)]
    chat = run_cli("chat", "--agent", "scout", "--once", "x", "-C", "ws", "-m", "scripted:replay.json")
    assert chat[:2] == (0, '{"where": "here"}\n'), chat[2]
    assert answers("parallel", "-f", "tasks.yaml", "-C", "ws") == [
        ("from the tasks file", f"scripted:{here / 'other.json'}")
    ]
    flow = here / "ws" / ".mlx-subagents" / "workflows" / "replay.json"
    assert answers("workflow", "map", "-C", "ws") == [("beside the workflow", f"scripted:{flow}")]
    monkeypatch.setenv("MLX_SUBAGENTS_MODEL", "scripted:replay.json")
    assert answers("run", "scout", "x", "-C", "ws") == [('{"where": "here"}', replayed)]
    monkeypatch.delenv("MLX_SUBAGENTS_MODEL")
    [(_, model)] = answers("run", "scout", "x", "-C", "ws", "--model", "./tiny", "--max-tokens", "1", code=1)
    assert model == str(here / "tiny")  # the folder here, loaded there (a random model: stopped at 1 token)
    missing = run_cli("run", "scout", "x", "-C", "ws", "--model", "./missing")
    assert missing[0] == 2 and f"model folder {here / 'missing'} does not exist" in missing[2]
    attached = [c.split(" (pid")[0] for c in served_clients(serve_paths().log.read_text())]
    assert (
        attached
        == ["subagent run"] * 2
        + ["subagent chain", "chat", "subagent parallel", "subagent workflow"]
        + ["subagent run"] * 3
    )


def test_a_relayed_mcp_reads_its_model_and_workspace_where_it_was_started(
    serve_process: Any, tmp_path: Path, write_script: Any
) -> None:
    """docs/mcp.md's `subagent mcp --model scripted:replay.yaml`, with a server running: refused there
    (the server read the file in its own folder), it runs from the folder `subagent mcp` was started in."""
    from mlx_subagents.serve.client import make_hello, quick
    from tests.mcp_server.test_mcp_server import connect, run

    _, info = serve_process("--no-http", "--model", write_script({"agents": {"scout": {"replies": ["server"]}}}))
    (tmp_path / "ws").mkdir()
    (tmp_path / "replay.yaml").write_text("agents:\n  scout:\n    replies: [relayed]\n")
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with connect("--model", "scripted:replay.yaml", "--cwd", "ws", cwd=tmp_path) as client:
            seen["result"] = await client.call_tool("run_agents", {"agent": "scout", "task": "look"})
            seen["status"] = quick(info, make_hello("status"))["status"]

    run(main)
    assert seen["result"].structured_content["tasks"][0]["answer"] == "relayed"
    [client] = seen["status"]["clients"]
    assert (client["kind"], client["workspace"]) == ("relay", str(tmp_path / "ws"))
