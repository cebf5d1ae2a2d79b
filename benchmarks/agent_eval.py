"""Agent quality on a real codebase: scout questions and worker bug fixes on a pinned package.

The harness fetches the pinned source distribution (more-itertools 10.5.0 by default; pip, once,
checked by sha256, cached in `~/.cache/mlx-subagents/eval` or `$MLX_SUBAGENTS_EVAL_CACHE`), gives
every task a fresh copy, runs the tasks through `Runner` in series and then `--concurrency` at a
time, and scores them: a scout is right when its `Findings:` name the expected file and lines, a
worker when the package's own test passes in its copy and no other file changed.

    python benchmarks/agent_eval.py --model mlx-community/Qwen3-4B-Instruct-2507-4bit --out eval-run
    python benchmarks/agent_eval.py --check-tasks            # prove every task on the pinned source
    python benchmarks/agent_eval.py --write-replies DIR right && \\
        python benchmarks/agent_eval.py --model scripted:DIR  # the harness proven without a model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from eval.replies import write_replies
from eval.scoring import Verdict, score_scout, score_worker
from eval.source import default_cache, fetch_source, fresh_copy
from eval.tasks import DEFAULT_TASKS, EvalTask, ScoutTask, TaskFile, apply_bug, check_tasks, load_task_file, select
from workload import make_parser, open_model

from mlx_subagents.agents.discovery import AgentCatalog, discover_agents
from mlx_subagents.agents.spec import parse_agent_file
from mlx_subagents.errors import RequestError, SubagentError
from mlx_subagents.events import Event
from mlx_subagents.host.scripted import SCRIPTED_PREFIX
from mlx_subagents.results import RunResult
from mlx_subagents.runs.options import RunOptions
from mlx_subagents.runs.runner import Runner
from mlx_subagents.runs.tasks import ModelRef, TaskSpec

DEFAULT_TIMEOUT = 600.0
DEFAULT_CONCURRENCY = 4
TINY_CONTEXT_WINDOW = 8192


@dataclass(frozen=True)
class Row:
    """One task's outcome in one mode."""

    id: str
    kind: str
    ok: bool
    why: str
    stop_reason: str
    turns: int
    tool_calls: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    compactions: int
    seconds: float
    transcript: str | None
    tests_passed: int | None = None


@dataclass
class Setup:
    """What every task of the run shares."""

    tasks: TaskFile
    source: Path
    out: Path
    options: RunOptions
    models: dict[str, str]
    agents: list[Path] = field(default_factory=list)
    max_turns: int | None = None
    timeout: float = DEFAULT_TIMEOUT

    def catalog(self, tree: Path) -> AgentCatalog:
        """The built-in agents, with each `--agent` file in place of the agent of its name."""
        catalog = discover_agents(tree, scope=self.options.scope)
        for path in self.agents:
            spec = parse_agent_file(path, "user")
            catalog.agents[spec.name] = spec
        return catalog


# -- running --------------------------------------------------------------------------------------


async def run_task(task: EvalTask, setup: Setup, owner: Runner, mode: str, gate: asyncio.Semaphore) -> Row:
    """Run one task in a fresh copy and score it; any failure of the task is a wrong answer, not a crash."""
    async with gate:
        tree = fresh_copy(setup.source, setup.out / mode / task.id)
        if not isinstance(task, ScoutTask):
            apply_bug(tree, task.bug)
        calls: Counter[str] = Counter()

        def count(event: Event) -> None:
            if event.kind == "tool_call":
                calls[event.label] += 1

        # Every copy gets its own workspace; all of them share the owner's loaded model (so concurrent
        # tasks batch together).
        runner = Runner(
            cwd=tree,
            options=setup.options,
            catalog=setup.catalog(tree),
            on_event=count,
            home=setup.out / "transcripts" / mode,
            hosts=owner.preparer.hosts,
        )
        spec = TaskSpec(
            agent=task.agent,
            task=task.prompt(),
            label=task.id,
            model=setup.models[task.id],
            max_turns=setup.max_turns,
            timeout=setup.timeout,
        )
        start = time.perf_counter()
        try:
            result = await runner.run(spec)
        except Exception as exc:  # an error inside one task is that task's wrong answer
            result = RunResult(agent=task.agent, task=spec.task, status="failed", error=str(exc), stop_reason="error")
        seconds = time.perf_counter() - start
        tests_passed = None
        if not result.ok:
            verdict = Verdict(False, f"stopped: {result.stop_reason}" + (f" ({result.error})" if result.error else ""))
        elif isinstance(task, ScoutTask):
            verdict = score_scout(result.output, task.expect)
        else:
            verdict, test_run = await asyncio.to_thread(score_worker, task, tree, setup.source)
            tests_passed = test_run.passed
        if isinstance(task, ScoutTask):
            shutil.rmtree(tree)  # nothing to look at; workers' copies stay for their diffs
        usage = result.usage
        return Row(
            task.id,
            task.kind,
            verdict.ok,
            verdict.why,
            result.stop_reason,
            usage.turns,
            calls[task.id],
            usage.input_tokens,
            usage.cached_tokens,
            usage.output_tokens,
            usage.compactions,
            round(seconds, 2),
            result.transcript,
            tests_passed,
        )


async def run_modes(tasks: list[EvalTask], setup: Setup, concurrency: int) -> dict[str, dict[str, Any]]:
    """Every task in series, then `concurrency` at a time, on the same loaded model."""
    modes = {"series": 1} | ({f"parallel-{concurrency}": concurrency} if concurrency > 1 else {})
    report: dict[str, dict[str, Any]] = {}
    async with Runner(cwd=setup.source, options=setup.options, save_transcripts=False) as owner:
        for model in sorted(set(setup.models.values())):
            await owner.preparer.host_for(ModelRef(model))  # load before the clock starts
        for mode, n in modes.items():
            gate = asyncio.Semaphore(n)
            start = time.perf_counter()
            rows = await asyncio.gather(*(run_task(t, setup, owner, mode, gate) for t in tasks))
            report[mode] = totals(rows, time.perf_counter() - start, n)
    return report


def totals(rows: list[Row], wall: float, concurrency: int) -> dict[str, Any]:
    """A mode's figures: scout accuracy, worker success, tokens, rates, and every row."""
    scouts = [r for r in rows if r.kind == "scout"]
    workers = [r for r in rows if r.kind == "worker"]
    prompt = sum(r.prompt_tokens for r in rows)
    generated = sum(r.generated_tokens for r in rows)
    cached = sum(r.cached_tokens for r in rows)
    return {
        "concurrency": concurrency,
        "right": sum(r.ok for r in rows),
        "total": len(rows),
        "accuracy": _ratio(sum(r.ok for r in scouts), len(scouts)),
        "scouts_right": sum(r.ok for r in scouts),
        "scouts": len(scouts),
        "worker_success": _ratio(sum(r.ok for r in workers), len(workers)),
        "workers_passed": sum(r.ok for r in workers),
        "workers": len(workers),
        "wall_s": round(wall, 2),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "generated_tokens": generated,
        "tok_per_s": round(generated / wall, 2) if wall else 0.0,
        "prefix_hit_rate": _ratio(cached, prompt),
        "tasks": [asdict(r) for r in rows],
    }


def _ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


# -- reporting --------------------------------------------------------------------------------------

COLUMNS = ("task", "kind", "ok", "turns", "calls", "prompt", "cached", "gen", "compact", "secs", "why")


def table_lines(mode: str, figures: dict[str, Any], *, markdown: bool = False) -> list[str]:
    """One mode's per-task table and its totals line, as text or markdown."""
    rows = [
        (
            r["id"], r["kind"], "right" if r["ok"] else "WRONG", r["turns"], r["tool_calls"], r["prompt_tokens"],
            r["cached_tokens"], r["generated_tokens"], r["compactions"], f"{r['seconds']:.1f}", r["why"],
        )
        for r in figures["tasks"]
    ]  # fmt: skip
    summary = (
        f"{mode}: scouts {figures['scouts_right']}/{figures['scouts']} right (accuracy {_pct(figures['accuracy'])}), "
        f"workers {figures['workers_passed']}/{figures['workers']} (success {_pct(figures['worker_success'])}), "
        f"wall {figures['wall_s']:.1f} s, {figures['tok_per_s']:.1f} generated tok/s, "
        f"prefix hit rate {_pct(figures['prefix_hit_rate'])}"
    )
    if markdown:
        head = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        return [f"### {mode}", "", *head, *("| " + " | ".join(map(str, r)) + " |" for r in rows), "", summary, ""]
    widths = [max(len(str(x)) for x in col) for col in zip(COLUMNS[:-1], *(r[:-1] for r in rows))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    return [f"== {mode}", fmt.format(*COLUMNS), *(fmt.format(*map(str, r)) for r in rows), summary, ""]


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def write_report(report: dict[str, Any], out: Path) -> Path:
    """`report.md` and `report.json` in the run folder (transcripts are under `transcripts/`)."""
    lines = [
        f"# Agent eval: {report['model']} on {report['package']}",
        "",
        f"{report['started']}; agents: {', '.join(report['agents'])}; tasks: {report['tasks_file']}",
        "",
    ]
    for mode, figures in report["modes"].items():
        lines += table_lines(mode, figures, markdown=True)
    if report.get("speedup"):
        lines.append(f"Series vs parallel wall time: {report['speedup']:.2f}x")
    (out / "report.json").write_text(json.dumps(report, indent=2))
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# -- the command ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser(__doc__ or "")
    parser.add_argument("--tasks", type=Path, default=DEFAULT_TASKS, help="the task file (default: eval/tasks.yaml)")
    parser.add_argument("--out", type=Path, help="run folder for the report, transcripts and worker copies")
    parser.add_argument("--cache", type=Path, help="where the sdist is kept (default: $MLX_SUBAGENTS_EVAL_CACHE)")
    parser.add_argument("--agent", type=Path, action="append", default=[], help="an agent file replacing its built-in")
    parser.add_argument("--limit", type=int, help="only the first N tasks")
    parser.add_argument("--only", action="append", help="only this task id (repeatable)")
    parser.add_argument("--max-turns", type=int, help="turns per task (default: the agent's own)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per task")
    parser.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="tasks at once after the series")
    parser.add_argument("--check-tasks", action="store_true", help="verify every task on the pinned source, run none")
    parser.add_argument(
        "--write-replies",
        nargs=2,
        metavar=("DIR", "KIND"),
        help="write scripted replies (KIND right or wrong), run none",
    )
    return parser.parse_args(argv)


@contextmanager
def task_models(args: argparse.Namespace, tasks: list[EvalTask]) -> Iterator[tuple[dict[str, str], str]]:
    """({task id: model id}, label): `scripted:DIR` gives each task `DIR/<id>.yaml`; any other
    `--model` (or the tiny random model) serves every task."""
    if args.model and args.model.startswith(SCRIPTED_PREFIX):
        folder = Path(args.model[len(SCRIPTED_PREFIX) :])
        if not folder.is_dir():
            yield {t.id: args.model for t in tasks}, args.model
            return
        missing = [t.id for t in tasks if not (folder / f"{t.id}.yaml").is_file()]
        if missing:
            raise RequestError(f"{folder}: no scripted replies for {', '.join(missing)}; add <task id>.yaml for each")
        yield {t.id: f"{SCRIPTED_PREFIX}{folder / f'{t.id}.yaml'}" for t in tasks}, args.model
        return
    with open_model(args, context_window=TINY_CONTEXT_WINDOW) as (path, label):
        yield {t.id: str(path) for t in tasks}, label


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Run the selected tasks in both modes and return the whole report (also written to `--out`)."""
    task_file = load_task_file(args.tasks)
    tasks = select(task_file.tasks, args.only, args.limit)
    for path in args.agent:
        parse_agent_file(path, "user")  # a bad agent file is one error line before anything runs
    source = fetch_source(task_file.package, args.cache)
    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    out = (args.out or default_cache() / "runs" / started.replace(":", "")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with task_models(args, tasks) as (models, label):
        setup = Setup(
            task_file, source, out, RunOptions(scope="project", assume_yes=True), models, args.agent,
            args.max_turns, args.timeout,
        )  # fmt: skip
        modes = asyncio.run(run_modes(tasks, setup, args.concurrency))
    walls = [m["wall_s"] for m in modes.values()]
    report = {
        "model": label,
        "package": task_file.package.pin,
        "tasks_file": str(args.tasks),
        "agents": [str(a) for a in args.agent] or ["built-in"],
        "started": started,
        "out": str(out),
        "speedup": round(walls[0] / walls[-1], 2) if len(walls) > 1 and walls[-1] else None,
        "modes": modes,
    }
    report["report"] = str(write_report(report, out))
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.write_replies:
            folder, kind = args.write_replies
            if kind not in ("right", "wrong"):
                raise RequestError(f"--write-replies: KIND must be right or wrong, got {kind!r}")
            print(write_replies(load_task_file(args.tasks).tasks, Path(folder), kind))
            return 0
        if args.check_tasks:
            return check_command(args)
        report = evaluate(args)
    except SubagentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for mode, figures in report["modes"].items():
        print("\n".join(table_lines(mode, figures)))
    if report["speedup"]:
        print(f"series vs parallel wall time: {report['speedup']:.2f}x")
    print(f"report: {report['report']}")
    if args.json:
        print(json.dumps(report))
    return 0


def check_command(args: argparse.Namespace) -> int:
    """`--check-tasks`: one line per task, exit 1 when any task does not hold on the pinned source."""
    task_file = load_task_file(args.tasks)
    tasks = select(task_file.tasks, args.only, args.limit)
    problems = check_tasks(tasks, fetch_source(task_file.package, args.cache))
    for task_id, problem in problems.items():
        print(f"{task_id}: {problem or 'ok'}")
    bad = sum(p is not None for p in problems.values())
    print(f"{len(problems) - bad}/{len(problems)} tasks hold on {task_file.package.pin}")
    if args.json:
        print(json.dumps({"package": task_file.package.pin, "problems": problems}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
