"""Long task: one agent that works for minutes, run through MCP as a task (issue 65), past the call budget.

A 2026-07-28 client (the official `mcp` SDK's `Client`, with the Tasks extension declared) starts
`subagent mcp --call-budget B` and calls `run_agents` as a task: the server answers with a task handle
at once, and the client polls `tasks/get` until the task ends, printing each change of its status
message (turn, tokens, last tool call) as it comes. The agent is a `worker` on a scripted model (the
model is not what is measured): each turn one real `bash` call, `sleep STEP` then a line with the
time, until `--duration` seconds of sleeps are spent; then its answer. While the task works, one
plain call (`agent_output` on the same task, `wait` 300 s) shows the call budget in force: it
answers after B seconds that the task has not finished. The task itself is bounded by nothing but the
agent's own limits.

It prints the handle's arrival, each status change, the budget probe's answer, then the elapsed time,
the final status and the call's whole result (the agent's answer, its status line); `--json` adds
one object as the last line. Exits 1 when the task did not complete or its result lacks a step.

Run (from the repository root; mostly sleeping):

    python benchmarks/long_task.py                              # 10 minutes: 10 steps of 60 s, budget 50 s
    python benchmarks/long_task.py --duration 3 --step 1 --call-budget 1 --json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
from mcp import Client
from mcp.client.extension import ClientExtension
from mcp.client.stdio import StdioServerParameters

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mlx_subagents.tools import mcp_tasks  # noqa: E402

QUIET_S = 30.0
PROBED = "worker#1"  # the id of the server's first task


class TasksDeclared(ClientExtension):
    """The Tasks extension declared on every request; a task answer is parsed as a handle and left to
    the caller (no automatic settling: this client polls it itself, to print what it sees)."""

    identifier = mcp_tasks.EXTENSION

    def claims(self) -> list[Any]:
        return [mcp_tasks.claim()]


def script(duration: float, step: float) -> dict[str, Any]:
    """The worker's scripted replies: `ceil(duration / step)` bash calls that sleep `step` s each, then the answer."""
    steps = max(1, math.ceil(duration / step))
    replies: list[Any] = []
    for k in range(1, steps + 1):
        command = f'sleep {step:g}; echo "step {k} of {steps} done at $(date -u +%H:%M:%S)"'
        replies.append({"tool_calls": [{"name": "bash", "arguments": {"command": command, "timeout": step + 60}}]})
    replies.append(f"Worked through all {steps} steps of {step:g} s.")
    return {"agents": {"worker": {"replies": replies}}}


async def poll(client: Client, task_id: str, started: float, say: Any) -> tuple[mcp_tasks.DetailedTask, int]:
    """`tasks/get` at the server's interval until the task ends; a status message is printed when its turn,
    tokens or last tool call change, and every `QUIET_S` seconds (its clock alone changes at every poll)."""
    last, printed, polls = None, 0.0, 0
    while True:
        task = await client.session.send_request(
            mcp_tasks.GetTask(params=mcp_tasks.TaskIdParams(taskId=task_id)), mcp_tasks.DetailedTask
        )
        polls += 1
        said = task.status_message or task.status
        news = re.sub(r", [\d.]+(?:s|min), ", ", ", said)
        if news != last or time.monotonic() - printed >= QUIET_S:
            say(f"{time.monotonic() - started:7.1f} s  {said}")
            last, printed = news, time.monotonic()
        if task.status in mcp_tasks.TERMINAL:
            return task, polls
        await anyio.sleep(mcp_tasks.poll_seconds(task.poll_interval_ms))


async def run(duration: float, step: float, budget: str, folder: Path, say: Any) -> dict[str, Any]:
    """Starts the server, runs the task to its end, and returns what was seen."""
    home, workspace = folder / "home", folder / "workspace"
    workspace.mkdir(parents=True)
    model = folder / "script.json"
    model.write_text(json.dumps(script(duration, step)))
    argv = ["-m", "mlx_subagents.cli", "mcp", "--standalone", "--cwd", str(workspace)]
    argv += ["--model", f"scripted:{model}", "--call-budget", budget]
    env = {**os.environ, "MLX_SUBAGENTS_HOME": str(home), "PYTHONPATH": str(REPO)}
    params = StdioServerParameters(command=sys.executable, args=argv, env=env)
    seen: dict[str, Any] = {}
    async with Client(params, extensions=[TasksDeclared()]) as client:
        say(f"protocol {client.protocol_version}; extensions {sorted(client.server_capabilities.extensions or {})}")
        started = time.monotonic()
        arguments = {"tasks": [{"agent": "worker", "task": f"Work for {duration:g} s."}]}
        handle = await client.session.call_tool("run_agents", arguments, allow_claimed=True)
        seen["handle_s"] = time.monotonic() - started
        if not isinstance(handle, mcp_tasks.TaskHandle):
            raise SystemExit(f"run_agents answered without a task: {handle}")
        say(f"{seen['handle_s']:7.1f} s  task handle {handle.task_id[:8]}... ({handle.status})")

        async def probe() -> None:
            answered = await client.call_tool("agent_output", {"id": PROBED, "wait": 300})
            seen["probe_s"] = time.monotonic() - started
            seen["probe"] = "".join(b.text for b in answered.content if isinstance(b, types.TextContent))
            say(f"{seen['probe_s']:7.1f} s  a plain call (agent_output, wait 300) answered: {seen['probe']}")

        async with anyio.create_task_group() as group:
            group.start_soon(probe)
            task, seen["polls"] = await poll(client, handle.task_id, started, say)
        seen["elapsed_s"] = time.monotonic() - started
        seen["status"] = task.status
        result = types.CallToolResult.model_validate(task.result or {}, by_name=False)
        seen["result"] = "".join(b.text for b in result.content if isinstance(b, types.TextContent))
        seen["is_error"] = result.is_error
    records = "".join(path.read_text() for path in (home / "runs").rglob("*.jsonl"))
    seen["steps_done"] = len(set(re.findall(r"step \d+ of \d+ done at \d\d:\d\d:\d\d", records)))
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds the agent sleeps in bash, in all")
    parser.add_argument("--step", type=float, default=60.0, help="seconds of each bash call")
    parser.add_argument("--call-budget", default="50", help="the server's call budget (seconds)")
    parser.add_argument("--json", action="store_true", help="one JSON object as the last line")
    args = parser.parse_args(argv)
    steps = max(1, math.ceil(args.duration / args.step))
    print(f"an agent for {steps} x {args.step:g} s of bash, as an MCP task, call budget {args.call_budget} s")
    with tempfile.TemporaryDirectory(prefix="long-task-") as tmp:
        seen = anyio.run(run, args.duration, args.step, args.call_budget, Path(tmp), lambda s: print(s, flush=True))
    print(f"elapsed {seen['elapsed_s']:.1f} s over {seen['polls']} polls; status {seen['status']}")
    print("result:\n" + seen["result"])
    print(f"bash steps done, in the saved run: {seen['steps_done']} of {steps}")
    whole = seen["status"] == "completed" and not seen["is_error"] and seen["steps_done"] == steps
    report = {
        "duration_s": args.duration,
        "step_s": args.step,
        "call_budget_s": float(args.call_budget),
        "handle_s": round(seen["handle_s"], 2),
        "budget_probe_s": round(seen.get("probe_s", -1), 2),
        "budget_probe": seen.get("probe", ""),
        "elapsed_s": round(seen["elapsed_s"], 2),
        "polls": seen["polls"],
        "status": seen["status"],
        "steps": steps,
        "steps_done": seen["steps_done"],
        "completed": whole,
        "answer": seen["result"].split("\n\n", 1)[0],
    }
    if args.json:
        print(json.dumps(report))
    return 0 if whole else 1


if __name__ == "__main__":
    sys.exit(main())
