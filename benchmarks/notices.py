"""Notices: what a parent agent pays to learn its background children's results, three ways side by side.

A parent that starts children with `"background": true` carries on and learns of their ends from
notices, taken at its next turn boundary (`TaskBoard.watch`, `Inbox`). This script runs the same parent
three ways in one process run, on the scripted host (the model is not what is measured: its turns and
their prompts are): the built-in orchestrator starts three background scouts that end one at a time
(`--gap` seconds apart), answers while they work, then answers on what they found.

    one notice      the default (`"notify": "all"`): one notice when the call's last task has ended,
                    holding every answer, capped as a foreground call's results are
    each            `"notify": "each"`: a notice per task as it ends, holding its answer
    each, read      a notice per end, each answer then read with `task_output`: the shape of the flow
                    before issue 66, when a notice held only the answer's first line (here the notice
                    holds the answer too, so this row's tokens are a floor on that flow's turns, not its
                    token count)

It reports per flow the parent's turns, its prompt tokens over all turns (the scripted host's
estimate, `host/engine/estimate.py`: the same for every flow), the notices it received and the wall
time, and the ratios of each flow to one notice. Target: one notice takes the parent 3 turns (the
call, its answer while they run, its answer on their notice), whatever the number of children.
Missing it still exits 0 (a measurement); a flow that does not complete exits nonzero.

Run (from the repository root):

    python benchmarks/notices.py                 # a table
    python benchmarks/notices.py --json          # the last line is one JSON object
    python benchmarks/notices.py --scouts 5 --gap 0.3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlx_subagents.events import Event
from mlx_subagents.home import HOME_ENV
from mlx_subagents.host.scripted import Script, ScriptedHost
from mlx_subagents.runs.options import RunOptions
from mlx_subagents.runs.runner import Runner
from mlx_subagents.runs.tasks import TaskSpec

DEFAULT_SCOUTS = 3
DEFAULT_GAP_S = 0.6
TARGET_TURNS = 3
FLOWS = ("one notice", "each", "each, read")
PARENT = "orchestrator"


def call(name: str, **arguments: Any) -> dict[str, Any]:
    """A scripted reply that makes one tool call."""
    return {"tool_calls": [{"name": name, "arguments": arguments}]}


def findings(n: int) -> str:
    """A scout's answer: a first line, then what it found (about 120 tokens)."""
    lines = [f"- part{n}/module_{i}.py: handles step {i} of part {n}; entry point run_{i}()" for i in range(1, 8)]
    return "Findings:\n" + "\n".join(lines) + f"\nPart {n} is self-contained."


def parent_replies(flow: str, n_scouts: int) -> list[Any]:
    """The orchestrator's replies in `flow`: the call, an answer while the scouts work, then per notice
    what that flow does with it, the last answer on everything."""
    tasks = [{"agent": "scout", "task": f"map part {n}"} for n in range(1, n_scouts + 1)]
    start = call("subagent", tasks=tasks, background=True, **({"notify": "each"} if flow != "one notice" else {}))
    done = f"Parts 1 to {n_scouts} are mapped."
    if flow == "one notice":
        return [start, "The scouts are looking.", done]
    replies: list[Any] = [start, "The scouts are looking."]
    for n in range(1, n_scouts + 1):
        if flow == "each, read":
            replies.append(call("task_output", id=f"scout#{n}"))
        replies.append(done if n == n_scouts else f"Part {n} is mapped; waiting for the others.")
    return replies


def make_script(flow: str, n_scouts: int, gap: float) -> Script:
    """The parent's replies, and each scout's answer, the n-th ending `gap` seconds after the one before."""
    sessions = {
        f"{PARENT} > scout#{n}": {"replies": [{"content": findings(n), "delay": round(gap * n, 3)}]}
        for n in range(1, n_scouts + 1)
    }
    return Script.model_validate(
        {"agents": {PARENT: {"replies": parent_replies(flow, n_scouts)}}, "sessions": sessions}
    )


async def run_flow(cwd: Path, flow: str, n_scouts: int, gap: float) -> dict[str, Any]:
    """The parent's task in `flow`, to its end: its turns, prompt tokens, notices and wall time."""
    host = ScriptedHost(make_script(flow, n_scouts, gap))
    events: list[Event] = []
    options = RunOptions(model=host.model_id)
    runner = Runner(cwd, options, on_event=events.append, save_transcripts=False, hosts={host.model_id: host})
    async with runner:
        start = time.perf_counter()
        result = await runner.run(TaskSpec(PARENT, f"map parts 1 to {n_scouts} with scouts in the background"))
        elapsed = time.perf_counter() - start
    if result.status != "completed":
        raise SystemExit(f"{flow}: the parent did not complete: {result.status} {result.error or ''}")
    notices = [e for e in events if e.kind == "task_notice" and e.label == PARENT]
    return {
        "flow": flow,
        "turns": result.usage.turns,
        "input_tokens": result.usage.input_tokens,
        "notices": len(notices),
        "seconds": round(elapsed, 3),
    }


def measure(n_scouts: int, gap: float) -> dict[str, Any]:
    """Every flow in one run, in a temporary workspace and state folder."""
    home = os.environ.get(HOME_ENV)
    with tempfile.TemporaryDirectory(prefix="bench-notices-") as tmp:
        os.environ[HOME_ENV] = str(Path(tmp, "home"))
        cwd = Path(tmp, "work")
        cwd.mkdir()
        try:
            flows = [asyncio.run(run_flow(cwd, flow, n_scouts, gap)) for flow in FLOWS]
        finally:  # called in a test's process too: its state folder stays its own
            if home is None:
                os.environ.pop(HOME_ENV, None)
            else:
                os.environ[HOME_ENV] = home
    one = flows[0]
    ratios = {
        row["flow"]: {
            "turns": round(row["turns"] / one["turns"], 2),
            "input_tokens": round(row["input_tokens"] / one["input_tokens"], 2),
        }
        for row in flows[1:]
    }
    return {
        "scouts": n_scouts,
        "gap_s": gap,
        "flows": flows,
        "ratios_to_one_notice": ratios,
        "target_turns": TARGET_TURNS,
        "met": one["turns"] == TARGET_TURNS and one["notices"] == 1,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scouts", type=int, default=DEFAULT_SCOUTS, choices=range(1, 9), metavar="1-8")
    parser.add_argument("--gap", type=float, default=DEFAULT_GAP_S, help="Seconds between two scouts' ends.")
    parser.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = measure(args.scouts, args.gap)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"A parent and {report['scouts']} background scouts ending {args.gap:g} s apart (scripted host)")
    print(f"  {'flow':<12} {'turns':>5} {'prompt tokens':>13} {'notices':>7} {'seconds':>7}")
    for row in report["flows"]:
        print(
            f"  {row['flow']:<12} {row['turns']:>5} {row['input_tokens']:>13,} {row['notices']:>7} {row['seconds']:>7.2f}"
        )
    for flow, ratio in report["ratios_to_one_notice"].items():
        print(f"  {flow} / one notice: turns {ratio['turns']}x, prompt tokens {ratio['input_tokens']}x")
    verdict = "met" if report["met"] else "missed"
    print(f"  target: one notice in {TARGET_TURNS} parent turns: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
