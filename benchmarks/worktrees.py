"""Isolated writers: four workers each in a git worktree of its own, against four that take turns.

Writers in one workspace take turns (one writer lease per workspace), which is safe and slow; with
`isolation: worktree` each works in its own worktree, on its own branch, and they run at once. This
script measures both, side by side in one process run, on the scripted host (no model): each worker
runs one `bash` command that edits a file and sleeps `--seconds` (default 2) standing for its work,
then answers. Both modes use the same temporary git repository and the real runner, tools, bash
processes and git worktrees; the isolated mode's time includes making, committing and (for this
workload) keeping four worktrees.

It reports each mode's wall time (`time.perf_counter` around `Runner.parallel`) and the ratio
shared / isolated. Target: four isolated workers at least 2.5x faster than four taking turns (`speedup
>= 2.5` at the default 2 s; 4x is the ceiling, less the worktrees made one after another before
the workers start). Missing the target still exits 0 (this is a measurement); errors exit
nonzero.

Run (from the repository root):

    python benchmarks/worktrees.py                 # a table
    python benchmarks/worktrees.py --json          # the last line is one JSON object
    python benchmarks/worktrees.py --seconds 0.5 --workers 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlx_subagents.home import HOME_ENV
from mlx_subagents.runs.options import RunOptions
from mlx_subagents.runs.runner import Runner
from mlx_subagents.runs.tasks import TaskSpec
from mlx_subagents.runs.worktrees import list_worktrees, remove_worktree

DEFAULT_SECONDS = 2.0
DEFAULT_WORKERS = 4
TARGET_SPEEDUP = 2.5


def make_repo(folder: Path) -> Path:
    """A git repository with one commit and the file every worker edits."""
    folder.mkdir()
    (folder / "shared.txt").write_text("original\n")
    for args in (("init", "-q", "-b", "main"), ("add", "-A")):
        subprocess.run(["git", "-C", str(folder), *args], check=True)
    who = ["-c", "user.name=bench", "-c", "user.email=bench@example.invalid"]
    subprocess.run(["git", "-C", str(folder), *who, "commit", "-q", "-m", "first"], check=True)
    return folder


def write_script(path: Path, n_workers: int, seconds: float) -> str:
    """A scripted model: each worker's one bash call (an edit, then a sleep standing for its work)."""
    command = f"echo $PWD >> shared.txt; sleep {seconds}"
    bash = {"tool_calls": [{"name": "bash", "arguments": {"command": command}}]}
    path.write_text(json.dumps({"agents": {"worker": {"replies": [bash, "done"] * n_workers}}}))
    return f"scripted:{path}"


async def timed(repo: Path, model: str, n_workers: int, isolation: str) -> float:
    """The wall time of `n_workers` workers run in parallel with `isolation`; every one must complete."""
    tasks = [TaskSpec("worker", "edit shared.txt", label=f"w{i}") for i in range(1, n_workers + 1)]
    options = RunOptions(model=model, isolation=isolation)
    async with Runner(cwd=repo, options=options, save_transcripts=False) as runner:
        start = time.perf_counter()
        outcome = await runner.parallel(tasks, concurrency=n_workers)
        elapsed = time.perf_counter() - start
    failed = [f"{r.label}: {r.status} {r.error or ''}" for r in outcome.results if r.status != "completed"]
    if failed:
        raise SystemExit(f"{isolation}: not every worker completed: {'; '.join(failed)}")
    return elapsed


def measure(n_workers: int, seconds: float) -> dict[str, Any]:
    """Both modes in one run, in a temporary repository and state folder."""
    with tempfile.TemporaryDirectory(prefix="bench-worktrees-") as tmp:
        os.environ[HOME_ENV] = str(Path(tmp, "home"))  # worktrees kept here, removed with it
        repo = make_repo(Path(tmp, "repo"))
        shared_model = write_script(Path(tmp, "shared.json"), n_workers, seconds)
        isolated_model = write_script(Path(tmp, "isolated.json"), n_workers, seconds)
        shared = asyncio.run(timed(repo, shared_model, n_workers, "none"))
        isolated = asyncio.run(timed(repo, isolated_model, n_workers, "worktree"))
        kept = list_worktrees()
        for worktree in kept:
            remove_worktree(worktree)
    return {
        "workers": n_workers,
        "seconds_per_worker": seconds,
        "shared_s": round(shared, 3),
        "isolated_s": round(isolated, 3),
        "speedup": round(shared / isolated, 2),
        "isolated_per_ideal": round(isolated / seconds, 2),
        "shared_per_ideal": round(shared / (seconds * n_workers), 2),
        "branches_kept": len(kept),
        "target_speedup": TARGET_SPEEDUP,
        "met": shared / isolated >= TARGET_SPEEDUP,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS, choices=range(1, 5), metavar="1-4")
    parser.add_argument("--seconds", type=float, default=DEFAULT_SECONDS, help="Each worker's sleep (its work).")
    parser.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = measure(args.workers, args.seconds)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{report['workers']} workers, each a {args.seconds:g} s command in one repository")
    print(f"  taking turns (one workspace)   {report['shared_s']:7.2f} s   ({report['shared_per_ideal']}x the sum)")
    print(f"  isolated (own worktrees)       {report['isolated_s']:7.2f} s   ({report['isolated_per_ideal']}x one)")
    verdict = "met" if report["met"] else "missed"
    print(
        f"  speedup {report['speedup']}x (target {TARGET_SPEEDUP}x: {verdict}); {report['branches_kept']} branches kept"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
