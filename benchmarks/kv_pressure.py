"""KV pressure: N agent sessions growing their caches under a bounded KV pool.

N sessions (default 4) run at once on one host, each for T turns (default 8, like benchmarks/prefix_reuse.py) of agent-like
growth: every turn the model replies with a tool call (`grep` or `read`, forced through the real
inference path on the tiny model) and the conversation then gets a tool result of a few hundred
tokens (generated, numbered code lines; different per session and turn, deterministic). The
sessions share the built-in scout agent's system prompt and tool schemas (read, grep, find, ls,
bash), as sessions of one agent do.

The same workload runs under three KV budgets, side by side in one process run:

- unbounded (`kv_budget=0`): its measured peak KV bytes is the working set (the shared prefix held once);
- 50% and 25% of that working set (passed to the host as bytes), each at least what one session's
  whole conversation needs (`least_budget`: below it not even one conversation fits).

A bounded host must still give every session a window that holds its whole conversation: the
per-session window is the host's `tokens_that_fit(shape, budget // max_sessions)`, so for each budget the
script picks the largest `max_sessions` (at most N + 1: the children and their parent) whose
window holds the longest final prompt plus the reply's `max_tokens`, and reports it. Small
budgets end at `max_sessions=1`: the budget then holds one full conversation at a time, the
other sessions wait for admission or have their caches evicted.

Reported per budget: peak KV bytes (the pool's own high-water mark, and the highest total seen by
a poller reading `host.memory_stats()` every ~20 ms), the budget, evictions, spills, restores,
drops, re-prefilled tokens, admission waits, wall time relative to the unbounded run, the prefix
hit rate (cached / prompt tokens over turns 2..T of every session) and whether every generated
token id is identical to the unbounded run. Key `all_within_budget`: the peak stayed within the
budget in every bounded run. Targets: every run completes; no peak above its budget; zero
evictions when unbounded; prefix hit rate at least 90% when unbounded. Missing a target still
exits 0 (this is a measurement); errors exit nonzero.

Run (from the repository root):

    python benchmarks/kv_pressure.py                       # tiny random qwen3, a table
    python benchmarks/kv_pressure.py --arch qwen3_5        # hybrid model (snapshots, no trim)
    python benchmarks/kv_pressure.py --sessions 4 --turns 8 --result-lines 24
    python benchmarks/kv_pressure.py --json                # the last line is one JSON object
    python benchmarks/kv_pressure.py --model smollm2       # an imported model (`subagent models import`)
    python benchmarks/kv_pressure.py --plot kv.png         # KV bytes per session over time
    python benchmarks/kv_pressure.py --kv-bits 16,8,4      # each KV cache setting under one budget

`--kv-bits` runs the comparison of `kv_bits_pressure.py` instead (its own docstring says what it
measures): 8 sessions by default, a tiny model with 64-wide heads (so that its cache quantizes).

`--plot` needs matplotlib (`pip install matplotlib`, the optional `plot` extra). With `--model`
the replies are forced when the host parses the Hermes `<tool_call>` format (prompted mode, Qwen), otherwise the
model generates greedily (up to 64 tokens a turn) and the tool results follow regardless.

On Linux the `mlx[cpu]` wheel runs fp32 matmul through a slow reference BLAS; preloading
Debian's OpenBLAS makes fp32 prefill much faster:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/kv_pressure.py
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workload import (
    CallPlanner,
    PlannedCall,
    Report,
    can_force,
    make_parser,
    model_arch,
    run_report,
    scout_prompt,
    tool_message,
)

from mlx_subagents.errors import SubagentError
from mlx_subagents.host import GenerateArgs, MlxModelHost, Reply, parse_bytes
from mlx_subagents.host.kv.kv_pool import KV_STEP, KVShape, TurnSize, admission_bytes, tokens_that_fit
from mlx_subagents.host.protocol import DEFAULT_CONTEXT_WINDOW, Message, ToolSchema
from mlx_subagents.host.settings import check_kv_bits
from mlx_subagents.testing import LogitsProcessor, make_forced_processor
from mlx_subagents.tools import Workspace

BUDGET_FRACTIONS = (None, 0.5, 0.25)  # None: unbounded
TARGET_PREFIX_HIT_RATE = 0.90
FORCED_MAX_TOKENS = 64  # room for the longest forced tool call
FREE_MAX_TOKENS = 64
POLL_SECONDS = 0.02
TINY_CONTEXT_WINDOW = DEFAULT_CONTEXT_WINDOW  # trained for the host's default window: served whole
WORKSPACE = Workspace(Path(tempfile.gettempdir()) / "kv-pressure-project")

_FILES = (
    "src/config.py", "src/settings.py", "src/cli.py", "src/runner.py", "src/profiles.py", "src/env.py",
    "src/cache.py", "src/session.py", "tests/test_config.py", "tests/test_cache.py",
)  # fmt: skip
_TOPICS = ("configuration", "authentication", "caching", "retries", "logging", "the CLI", "plugins", "sessions")


# -- the workload --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """Every session's opening messages and planned calls; the same for every budget."""

    tools: list[ToolSchema]
    openings: list[list[Message]]
    calls: list[list[PlannedCall]]  # [session][turn]
    result_lines: int

    def scripts(self, i: int) -> list[str]:
        return [c.text for c in self.calls[i]]


def build_workload(sessions: int, turns: int, lines: int) -> Workload:
    system, tools = scout_prompt(WORKSPACE)
    openings = [
        [
            system,
            {
                "role": "user",
                "content": f"Task {i}: where is {_TOPICS[i % len(_TOPICS)]} handled in this "
                "project, and which files and functions take part? Cite line ranges.",
            },
        ]
        for i in range(sessions)
    ]
    planner = CallPlanner(_FILES, "src", lines)
    calls = [planner.plan_session(i, turns) for i in range(sessions)]
    return Workload(tools, openings, calls, lines)


class ScriptedReplies:
    """Processor factory: session `s<i>` says its planned calls in order (once bound to a tokenizer)."""

    def __init__(self, workload: Workload, allow: bool) -> None:
        self._workload = workload
        self._allow = allow
        self._tokenizer: Any = None
        self._next: dict[str, int] = {}

    def bind(self, host: MlxModelHost) -> bool:
        ok = self._allow and can_force(host)
        self._tokenizer = host.tokenizer if ok else None
        return ok

    def __call__(self, session: str, prompt_ids: list[int]) -> list[LogitsProcessor]:
        if self._tokenizer is None:
            return []
        i = int(session[1:])
        turn = self._next.get(session, 0)
        self._next[session] = turn + 1
        scripts = self._workload.scripts(i)
        return [make_forced_processor(self._tokenizer, scripts[turn])] if turn < len(scripts) else []


# -- one run under one budget --------------------------------------------------------------------


@dataclass
class BudgetRun:
    label: str
    budget: int | None
    max_sessions: int
    window: int
    seconds: float
    replies: list[list[Reply]]  # [session][turn]
    errors: list[str]
    stats: Any
    samples: list[tuple[float, int, dict[str, int]]] = field(default_factory=list)  # (t, total, by session)
    forced: bool = False
    kv_shape: tuple[int, int] = (0, 0)
    trimmable: bool = True
    kv_bits: int = 16  # what the host ran at
    shapes: dict[int, Any] = field(default_factory=dict)  # every --kv-bits setting's KVShape (or why not)
    resident: list[int] = field(default_factory=list)  # sessions resident at each poll

    @property
    def completed(self) -> bool:
        return not self.errors

    @property
    def peak_sampled(self) -> int:
        return max((total for _, total, _ in self.samples), default=0)


async def conversation(host: MlxModelHost, workload: Workload, i: int, max_tokens: int) -> list[Reply]:
    session = host.session(f"s{i}", agent="scout")
    messages = list(workload.openings[i])
    out = []
    for call in workload.calls[i]:
        reply = await session.generate(messages, GenerateArgs(max_tokens=max_tokens), tools=workload.tools)
        out.append(reply)
        messages += [reply.to_message(), tool_message(reply, call.name, call.result)]
    return out


async def poll(
    host: MlxModelHost, start: float, samples: list[tuple[float, int, dict[str, int]]], resident: list[int]
) -> None:
    while True:
        stats = await host.memory_stats()
        samples.append((time.perf_counter() - start, stats.kv_bytes_total, dict(stats.kv_bytes_by_session)))
        resident.append(stats.sessions_resident)
        await asyncio.sleep(POLL_SECONDS)


async def run_budget(
    model: Path,
    workload: Workload,
    label: str,
    budget: int | None,
    max_sessions: int,
    force: bool,
    share_prefix: bool,
    **host_options: Any,
) -> BudgetRun:
    """The workload on one host under `budget` (None: unbounded); `host_options` go to the host too."""
    forcing = ScriptedReplies(workload, force)
    async with MlxModelHost(
        str(model),
        kv_budget=budget if budget is not None else 0,
        max_sessions=max_sessions,
        processor_factory=forcing,
        share_prefix=share_prefix,
        prefix_cache=0,  # each budget starts cold: no disk tier between the runs compared
        **host_options,
    ) as host:
        forced = forcing.bind(host)
        max_tokens = FORCED_MAX_TOKENS if forced else FREE_MAX_TOKENS
        samples: list[tuple[float, int, dict[str, int]]] = []
        resident: list[int] = []
        start = time.perf_counter()
        poller = asyncio.create_task(poll(host, start, samples, resident))
        results = await asyncio.gather(
            *(conversation(host, workload, i, max_tokens) for i in range(len(workload.openings))),
            return_exceptions=True,
        )
        seconds = time.perf_counter() - start
        poller.cancel()
        try:
            await poller
        except asyncio.CancelledError:
            pass
        stats = await host.memory_stats()
        samples.append((time.perf_counter() - start, stats.kv_bytes_total, dict(stats.kv_bytes_by_session)))
        replies = [r if isinstance(r, list) else [] for r in results]
        errors = [f"s{i}: {type(r).__name__}: {r}" for i, r in enumerate(results) if isinstance(r, BaseException)]
        return BudgetRun(
            label,
            host.kv_budget,
            max_sessions,
            host.context_window,
            seconds,
            replies,
            errors,
            stats,
            samples,
            forced,
            (host.kv_shape.fixed, host.kv_shape.per_token),
            host.kv_trimmable,
            host.kv_bits,
            await host.kv_shapes(),
            [*resident, stats.sessions_resident],
        )


def needed_tokens(unbounded: BudgetRun) -> int:
    """The longest conversation of the run and its reply: what every session's window must hold."""
    max_tokens = FORCED_MAX_TOKENS if unbounded.forced else FREE_MAX_TOKENS
    return max(g[-1].usage.prompt_tokens for g in unbounded.replies) + max_tokens


def least_budget(shape: KVShape, trimmable: bool, needed_tokens: int) -> int:
    """The smallest budget whose one session's window holds `needed_tokens` (whole KV steps): below it not
    even one conversation fits. A fraction of a working set whose prefix is held once for every session
    can fall below it: each budget is at least this."""
    window = -(-needed_tokens // KV_STEP) * KV_STEP
    return admission_bytes(shape, [TurnSize(window, window)], batched=False, trimmable=trimmable)


def pick_max_sessions(budget: int, shape: KVShape, trimmable: bool, needed_tokens: int, most: int) -> int:
    """The most sessions (<= `most`) whose per-session window still holds `needed_tokens`; at least 1."""
    for m in range(most, 0, -1):
        if tokens_that_fit(shape, budget // m, trimmable) >= needed_tokens:
            return m
    return 1


async def run_all(model: Path, workload: Workload, force: bool, share_prefix: bool) -> list[BudgetRun]:
    n = len(workload.openings)
    default_sessions = n + 1  # the children and their parent
    unbounded = await run_budget(model, workload, "unbounded", None, default_sessions, force, share_prefix)
    if not unbounded.completed:
        raise SubagentError("the unbounded run failed: " + "; ".join(unbounded.errors))
    working_set = unbounded.stats.pool["peak_bytes"]
    shape = KVShape(*unbounded.kv_shape)
    needed = needed_tokens(unbounded)
    runs = [unbounded]
    least = least_budget(shape, unbounded.trimmable, needed)
    for fraction in BUDGET_FRACTIONS[1:]:
        assert fraction is not None
        budget = max(int(working_set * fraction), least)
        m = pick_max_sessions(budget, shape, unbounded.trimmable, needed, default_sessions)
        try:
            runs.append(await run_budget(model, workload, f"{fraction:.0%}", budget, m, force, share_prefix))
        except SubagentError as exc:  # the host refused the budget (window too small): report it
            runs.append(BudgetRun(f"{fraction:.0%}", budget, m, 0, 0.0, [], [str(exc)], None))
    return runs


# -- reporting -----------------------------------------------------------------------------------


POOL_COUNTERS = ("evictions", "spills", "restores", "drops", "reprefilled_tokens", "admission_waits")


def pool_counters(pool: dict[str, Any]) -> dict[str, int]:
    """What the KV pool did under its budget (a run's pool stats; 0 for a counter it never kept)."""
    return {name: pool.get(name, 0) for name in POOL_COUNTERS}


def held_reuse(replies: list[Reply]) -> tuple[int, int]:
    """(cached, held) over turns 2..T: how much of what the session held after a turn the next one reused."""
    cached = sum(g.usage.cached_tokens for g in replies[1:])
    held = sum(p.usage.prompt_tokens + p.usage.generated_tokens for p in replies[:-1])
    return cached, held


def summarize(
    runs: list[BudgetRun], *, arch: str, model: str, workload: Workload, share_prefix: bool = True
) -> dict[str, Any]:
    base = runs[0]
    base_ids = [[g.token_ids for g in gens] for gens in base.replies]
    fixed, per_token = base.kv_shape
    rows = []
    for run in runs:
        pool = run.stats.pool if run.stats is not None else {}
        later = [g for gens in run.replies for g in gens[1:]]
        prompt = sum(g.usage.prompt_tokens for g in later)
        cached = sum(g.usage.cached_tokens for g in later)
        peak = int(pool.get("peak_bytes", 0))
        reuse = [held_reuse(gens) for gens in run.replies]
        held = sum(h for _, h in reuse)
        rows.append(
            {
                "label": run.label,
                "budget_bytes": run.budget,
                "max_sessions": run.max_sessions,
                "window_tokens": run.window,
                "completed": run.completed,
                "errors": run.errors,
                "peak_kv_bytes": peak,
                "peak_sampled_kv_bytes": run.peak_sampled,
                "within_budget": run.budget is None or peak <= run.budget,
                **pool_counters(pool),
                "seconds": round(run.seconds, 4),
                "wall_vs_unbounded": round(run.seconds / base.seconds, 3) if base.seconds and run.completed else None,
                "prompt_tokens_turn2_on": prompt,
                "cached_tokens_turn2_on": cached,
                "prefix_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
                "held_reuse_rate": round(sum(c for c, _ in reuse) / held, 4) if held else 0.0,
                "prefilled_tokens": sum(g.usage.prefilled_tokens for gens in run.replies for g in gens),
                "identical_outputs": run.completed
                and [[g.token_ids for g in gens] for gens in run.replies] == base_ids,
            }
        )
    unbounded, bounded = rows[0], rows[1:]
    all_within = all(r["within_budget"] for r in bounded)
    targets = {
        "every_run_completes": all(r["completed"] for r in rows),
        "peak_within_budget": all_within,
        "zero_evictions_unbounded": unbounded["evictions"] == 0,
        "prefix_hit_rate_unbounded": unbounded["prefix_hit_rate"] >= TARGET_PREFIX_HIT_RATE,
    }
    final_prompts = [gens[-1].usage.prompt_tokens for gens in base.replies]
    return {
        "benchmark": "kv_pressure",
        "arch": arch,
        "model": model,
        "forced": base.forced,
        "share_prefix": share_prefix,
        "result_lines": workload.result_lines,
        "sessions": len(workload.openings),
        "turns": len(workload.calls[0]),
        "kv_fixed_bytes": fixed,
        "kv_per_token_bytes": per_token,
        "working_set_bytes": unbounded["peak_kv_bytes"],
        "least_budget_bytes": least_budget(KVShape(fixed, per_token), base.trimmable, needed_tokens(base)),
        "final_prompt_tokens": final_prompts,
        "identical_outputs": all(r["identical_outputs"] for r in rows),
        "all_within_budget": all_within,
        "budgets": rows,
        "target_prefix_hit_rate": TARGET_PREFIX_HIT_RATE,
        "targets": targets,
        "targets_met": all(targets.values()),
    }


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def print_table(report: dict[str, Any]) -> None:
    print(
        f"kv pressure: {report['model']} ({report['arch']}), {report['sessions']} sessions x {report['turns']} turns, "
        f"replies {'forced' if report['forced'] else 'free (greedy)'}, tool results of {report['result_lines']} lines, "
        f"shared prefix {'on' if report['share_prefix'] else 'off'}"
    )
    print(
        f"KV: {report['kv_per_token_bytes']} B/token + {report['kv_fixed_bytes']} B fixed; final prompts "
        f"{report['final_prompt_tokens']} tokens; working set (unbounded peak) {mib(report['working_set_bytes'])} MiB"
    )
    print()
    header = (
        f"{'budget':<9} {'MiB':>6} {'peak MiB':>8} {'sess':>4} {'window':>6} {'evict':>5} {'spill':>5} "
        f"{'restore':>7} {'drop':>4} {'reprefill':>9} {'waits':>5} {'wall':>6} {'hit rate':>8} {'reuse':>6} "
        f"{'same':>4} {'ok':>3}"
    )
    print(header)
    print("-" * len(header))
    for r in report["budgets"]:
        wall = "-" if r["wall_vs_unbounded"] is None else f"{r['wall_vs_unbounded']:.2f}x"
        print(
            f"{r['label']:<9} {mib(r['budget_bytes']):>6} {mib(r['peak_kv_bytes']):>8} {r['max_sessions']:>4} "
            f"{r['window_tokens']:>6} {r['evictions']:>5} {r['spills']:>5} {r['restores']:>7} {r['drops']:>4} "
            f"{r['reprefilled_tokens']:>9} {r['admission_waits']:>5} {wall:>6} {r['prefix_hit_rate']:>8.1%} "
            f"{r['held_reuse_rate']:>6.1%} "
            f"{'yes' if r['identical_outputs'] else 'NO':>4} {'yes' if r['completed'] else 'NO':>3}"
        )
    for r in report["budgets"]:
        for error in r["errors"]:
            print(f"  {r['label']}: {error}")
    bounded = [
        r for r in report["budgets"] if r["budget_bytes"] is not None and r["max_sessions"] < report["sessions"] + 1
    ]
    for r in bounded:
        print(
            f"  {r['label']}: max_sessions={r['max_sessions']} so that the per-session window ({r['window_tokens']} "
            f"tokens) still holds the longest conversation ({max(report['final_prompt_tokens'])} + reply)"
        )
    print()
    t = report["targets"]
    print(f"{'PASS' if t['every_run_completes'] else 'FAIL'}: every run completes")
    print(
        f"{'PASS' if t['peak_within_budget'] else 'FAIL'}: peak KV bytes never above the budget "
        f"(all_within_budget {report['all_within_budget']})"
    )
    print(f"{'PASS' if t['zero_evictions_unbounded'] else 'FAIL'}: zero evictions when unbounded")
    hit = report["budgets"][0]["prefix_hit_rate"]
    print(
        f"{'PASS' if t['prefix_hit_rate_unbounded'] else 'FAIL'}: prefix hit rate when unbounded {hit:.1%} "
        f"(target >= {report['target_prefix_hit_rate']:.0%})"
    )
    print(f"identical outputs in every run: {report['identical_outputs']}")
    print(
        "(hit rate: cached / prompt tokens over turns 2..T, bounded by the new tool result in every turn; "
        "reuse: cached / tokens the session held after its previous turn)"
    )


def plot(runs: list[BudgetRun], path: Path) -> None:
    """One panel per budget: each session's KV bytes over time, the resident total and the budget.

    Per session it draws `memory_stats().kv_bytes_by_session`: the host measures a session's cache
    when its turn ends and counts 0 once it is evicted. The resident total
    (`kv_bytes_total`) also holds the caches of turns in flight and the shared prefixes.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SubagentError("--plot needs matplotlib: pip install matplotlib") from None
    drawn = [r for r in runs if r.samples]
    fig, axes = plt.subplots(len(drawn), 1, figsize=(9, 3.2 * len(drawn)), squeeze=False)
    for ax, run in zip(axes[:, 0], drawn):
        times = [t for t, _, _ in run.samples]
        names = sorted({n for _, _, by in run.samples for n in by}, key=lambda n: (len(n), n))
        for n in names:
            ax.step(times, [by.get(n, 0) / 2**20 for _, _, by in run.samples], where="post", lw=1.0, label=n)
        ax.step(
            times,
            [total / 2**20 for _, total, _ in run.samples],
            where="post",
            color="black",
            lw=1.4,
            label="resident total",
        )
        if run.budget is not None:
            ax.axhline(run.budget / 2**20, color="red", ls="--", lw=1.2, label="budget")
        ax.set_title(f"{run.label}: budget {mib(run.budget)} MiB, max_sessions {run.max_sessions}")
        ax.set_xlabel("seconds")
        ax.set_ylabel("KV MiB")
        ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- entry point ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = make_parser(__doc__)
    parser.add_argument("--sessions", type=int, help="concurrent sessions (default 4; 8 with --kv-bits)")
    parser.add_argument("--turns", type=int, default=8, help="tool-call turns per session (default 8)")
    parser.add_argument(
        "--result-lines",
        type=int,
        default=10,
        help="lines per tool result (default 10: 200-300 tokens on the tiny tokenizer)",
    )
    parser.add_argument(
        "--no-share-prefix",
        action="store_true",
        help="hosts without the shared system-prompt prefix (share_prefix=False)",
    )
    parser.add_argument("--free", action="store_true", help="never force replies; generate greedily")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="draw KV bytes per session over time")
    bits = parser.add_argument_group("--kv-bits comparison (see kv_bits_pressure.py)")
    bits.add_argument("--kv-bits", type=kv_bits_list, metavar="16,8,4", help="compare these settings, 16 first")
    bits.add_argument(
        "--budget-fraction",
        type=float,
        default=0.4,
        help="the one budget: this share of the unbounded 16-bit working set (default 0.4)",
    )
    bits.add_argument("--kv-budget", type=budget_bytes, help="the one budget, in bytes (e.g. 64MiB), instead")
    bits.add_argument("--evict", choices=("drop", "spill"), default="drop", help="what eviction does (default drop)")
    bits.add_argument("--decode-tokens", type=int, default=256, help="tokens per session in the decode part")
    bits.add_argument("--decode-repeats", type=int, default=3, help="decode rounds, settings in turn (median)")
    args = parser.parse_args(argv)
    if args.sessions is None:  # more sessions than a 16-bit budget holds, so that the settings differ
        args.sessions = 4 if args.kv_bits is None else 8
    if args.sessions < 1 or args.turns < 1 or args.result_lines < 1:
        parser.error("--sessions, --turns and --result-lines must be at least 1")
    if args.plot is not None:  # fail before the run, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install matplotlib")
    return args


def budget_bytes(text: str) -> int | None:
    try:
        return parse_bytes(text)
    except SubagentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def kv_bits_list(text: str) -> list[int]:
    """`16,8,4`: settings there are, 16 first (the reference the others are compared with)."""
    try:
        settings = [check_kv_bits(int(part)) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give settings among 16, 8 and 4, e.g. 16,8,4") from None
    if settings[0] != 16 or len(set(settings)) != len(settings):
        raise argparse.ArgumentTypeError(f"{text!r}: start with 16 (the reference) and name each setting once")
    return settings


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workload = build_workload(args.sessions, args.turns, args.result_lines)
    share_prefix = not args.no_share_prefix
    if args.kv_bits is not None:
        return compare_kv_bits(args, workload)

    def measure(model: Path, label: str) -> Report:
        runs = asyncio.run(run_all(model, workload, force=not args.free, share_prefix=share_prefix))
        if args.plot is not None:
            plot(runs, args.plot)
            print(f"plot: {args.plot}")
        return summarize(runs, arch=model_arch(model), model=label, workload=workload, share_prefix=share_prefix)

    return run_report(args, measure, print_table, context_window=TINY_CONTEXT_WINDOW)


def compare_kv_bits(args: argparse.Namespace, workload: Workload) -> int:
    """`--kv-bits`: each setting under one budget, then decoding; see `kv_bits_pressure.py`."""
    import kv_bits_pressure as bench

    def measure(model: Path, label: str) -> Report:
        options = {
            "fraction": args.budget_fraction,
            "force": not args.free,
            "drop": args.evict == "drop",
            "decode_tokens": args.decode_tokens,
            "decode_repeats": args.decode_repeats,
        }
        free, runs, decodes = asyncio.run(bench.measure(model, workload, args.kv_bits, args.kv_budget, options))
        report = bench.summarize(
            free,
            runs,
            decodes,
            args.kv_bits,
            arch=model_arch(model),
            model=label,
            workload=workload,
            drop=options["drop"],
            decode_tokens=args.decode_tokens,
        )
        if args.plot is not None:
            bench.plot(report, args.plot)
            print(f"plot: {args.plot}")
        return report

    return run_report(args, measure, bench.print_table, context_window=TINY_CONTEXT_WINDOW, head_dim=64)


if __name__ == "__main__":
    sys.exit(main())
