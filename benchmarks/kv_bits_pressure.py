"""`kv_pressure.py --kv-bits 16,8,4`: the same KV-pressure workload at each KV cache setting, side by side.

Two parts per setting, all in one process run:

- **Pressure.** The workload of `kv_pressure.py` (N sessions of the scout agent, T forced tool-call turns,
  tool results of a few hundred tokens; the forced replies make every setting's conversation the same
  tokens) under one KV budget: by default `--budget-fraction` of what the 16-bit run holds with no
  budget at all (every setting holds a shared prefix once), and at least what one 16-bit session's
  whole conversation needs. Reported: the sessions resident at once (their caches in memory, idle or in a turn),
  evictions, spills, restores, drops, re-prefilled tokens (the tokens a dropped cache held, prefilled
  again), admission waits, KV bytes per token, wall time. With
  `--evict drop` (the default here) an evicted cache is dropped and its session re-prefills, the cost the
  budget's pressure puts on a pool without a disk tier; `--evict spill` keeps the host's own rule
  (spill to disk when the cache holds 256 tokens or more, so little is re-prefilled). Sessions
  resident are polled every ~20 ms: their mean over the run (the target's measure), the most at once,
  and how many are left resident at the end, when every conversation is at its longest.
- **Decode.** On a host with no budget: one session, then four at once, each generating up to
  `--decode-tokens` (256) tokens greedily from a short prompt (free replies, the model's own tokens):
  decode tokens/s at 1 and 4 sessions (by the wall clock, and by this process's CPU time, which a
  shared machine's other work moves less; the median of `--decode-repeats` rounds, the settings in
  turn), and per session the share of tokens identical to the 16-bit run's over the first 256
  (greedy agreement). Then the forced agreement: four sessions at once are fed the 16-bit run's
  tokens (teacher forcing) and at each one the setting's own greedy choice is recorded, so one
  flipped near-tie counts as one token, where the free reply follows it to its end; at 16 bits it
  is 1.0 (the method's own check).

Targets at 8 bits against 16: at least 1.8x the sessions resident, at most half the re-prefilled
tokens, decode at 4 sessions at least 0.9x; greedy agreement at least 0.95 (on a real model: the tiny
random model's replies are noise, so its agreement is reported as measured). Missing a target still
exits 0 (a measurement); errors exit 2.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kv_pressure import BudgetRun, Workload, least_budget, pick_max_sessions, pool_counters, run_budget

from mlx_subagents.errors import SubagentError
from mlx_subagents.host import GenerateArgs, MlxModelHost
from mlx_subagents.host.kv.kv_pool import DEFAULT_DROP_BELOW_TOKENS, KVShape
from mlx_subagents.testing import LogitsProcessor, make_forced_processor

DEFAULT_BUDGET_FRACTION = 0.4
TARGET_SESSIONS_RATIO = 1.8
TARGET_REPREFILL_RATIO = 0.5
TARGET_DECODE_RATIO = 0.9
TARGET_AGREEMENT = 0.95
AGREEMENT_TOKENS = 256
DECODE_SESSIONS = (1, 4)
DECODE_PROMPTS = (
    "Explain in detail how a hash map works, with its costs, its collisions and how it grows.",
    "Describe step by step how to review a pull request that changes a database schema.",
    "Write a long, careful explanation of how HTTP caching headers interact.",
    "Explain how a garbage collector finds the objects a program no longer uses, in detail.",
)


@dataclass
class DecodeRun:
    """One setting's decode part: tokens/s at 1 and 4 sessions, by the wall clock and by this process's
    CPU time (less moved by a shared machine's other work), each round's; every session's tokens."""

    tps: dict[int, list[float]] = field(default_factory=dict)
    cpu_tps: dict[int, list[float]] = field(default_factory=dict)
    tokens: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)  # the first round's ids per session
    forced: list[float] = field(default_factory=list)  # per session of four: the forced agreement (`Teacher`)

    @staticmethod
    def median(rounds: dict[int, list[float]], n: int) -> float:
        return statistics.median(rounds[n]) if rounds.get(n) else 0.0


async def pressure(
    model: Path, workload: Workload, bits: int, budget: int | None, max_sessions: int, force: bool, drop: bool
) -> BudgetRun:
    """The workload at one setting under one budget (None: unbounded); `drop`: evicted caches re-prefill."""
    return await run_budget(
        model,
        workload,
        f"{bits}-bit",
        budget,
        max_sessions,
        force,
        True,
        kv_bits=bits,
        drop_below_tokens=2**62 if drop else DEFAULT_DROP_BELOW_TOKENS,
    )


async def each_prompt(sessions: list[Any], args: GenerateArgs) -> list[Any]:
    """Session `i` answers `DECODE_PROMPTS[i]`, all at once: the decode part's replies."""
    return await asyncio.gather(
        *(s.generate([{"role": "user", "content": DECODE_PROMPTS[i]}], args) for i, s in enumerate(sessions))
    )


async def decode(model: Path, bits: int, n_tokens: int, into: DecodeRun) -> None:
    """Free greedy replies on a host with no budget: one session, then four at once (one round)."""
    async with MlxModelHost(str(model), kv_bits=bits, kv_budget=0, prefix_cache=0) as host:
        args = GenerateArgs(max_tokens=n_tokens, temperature=0.0)
        await host.session("warm-up").generate([{"role": "user", "content": "hi"}], GenerateArgs(max_tokens=4))
        for n in DECODE_SESSIONS:
            sessions = [host.session(f"d{n}-{i}") for i in range(n)]
            cpu = time.process_time()
            replies = await each_prompt(sessions, args)
            # Every session decodes from its first token to its last: the window from the last first
            # token to the last end holds every session decoding at once.
            first = max(r.usage.prompt_seconds for r in replies)
            end = max(r.usage.prompt_seconds + r.usage.generation_seconds for r in replies)
            generated = sum(r.usage.generated_tokens for r in replies)
            into.tps.setdefault(n, []).append(generated / (end - first) if end > first else 0.0)
            into.cpu_tps.setdefault(n, []).append(generated / (time.process_time() - cpu))  # prompts of ~30 tokens
            into.tokens.setdefault(n, [r.token_ids for r in replies])


class Teacher:
    """Processor factory for the forced agreement: session `f<i>` is made to say the reference's
    tokens `references[i]` (teacher forcing), and its own greedy choice before each forced token is
    recorded. So every step sees the 16-bit run's history: a choice that differs counts once, where
    the free reply would follow it for the rest of its tokens."""

    def __init__(self, references: list[tuple[int, ...]]) -> None:
        self._references = references
        self._tokenizer: Any = None  # the host's, once it is loaded (`bind`)
        self.choices: dict[int, list[Any]] = {}

    def bind(self, host: MlxModelHost) -> None:
        self._tokenizer = host.tokenizer

    def __call__(self, session: str, prompt_ids: list[int]) -> list[LogitsProcessor]:
        if not session.startswith("f"):
            return []
        i = int(session[1:])
        chosen = self.choices.setdefault(i, [])
        limit = len(self._references[i])

        def record(tokens: Any, logits: Any) -> Any:
            import mlx.core as mx

            if len(chosen) < limit:
                choice = mx.argmax(logits, axis=-1)
                mx.async_eval(choice)  # computed with the step: no logits kept alive
                chosen.append(choice)
            return logits

        return [record, make_forced_processor(self._tokenizer, list(self._references[i]))]

    def agreement(self, i: int) -> float:
        """The share of the reference's tokens session `f<i>` chose itself, given the reference's history."""
        ref = self._references[i]
        return agreement(ref, tuple(int(c.item()) for c in self.choices.get(i, [])), len(ref))


async def forced_agreement(model: Path, bits: int, references: list[tuple[int, ...]]) -> list[float]:
    """Per session of four at once: the share of the 16-bit run's tokens this setting chooses greedily
    when fed that run's tokens so far (see `Teacher`)."""
    teacher = Teacher(references)
    async with MlxModelHost(str(model), kv_bits=bits, kv_budget=0, prefix_cache=0, processor_factory=teacher) as host:
        teacher.bind(host)
        args = GenerateArgs(max_tokens=max(len(r) for r in references) + 1, temperature=0.0)
        await each_prompt([host.session(f"f{i}") for i in range(len(references))], args)
        return [round(teacher.agreement(i), 4) for i in range(len(references))]


def agreement(reference: tuple[int, ...], other: tuple[int, ...], n: int = AGREEMENT_TOKENS) -> float:
    """The share of the reference's first `n` tokens the other run generated too, position for position."""
    ref = reference[:n]
    return sum(a == b for a, b in zip(ref, other)) / len(ref) if ref else 1.0


async def measure(
    model: Path,
    workload: Workload,
    settings: list[int],
    budget: int | None,
    options: dict[str, Any],
) -> tuple[BudgetRun, list[BudgetRun], dict[int, DecodeRun]]:
    """The unbounded 16-bit run (the working set, every setting's shape), then each setting under one
    budget, then each setting's decode part, `decode_repeats` rounds taking the settings in turn (the
    median of each is reported: a shared machine's load moves single rounds). `options`: fraction,
    force, drop, decode_tokens, decode_repeats."""
    n = len(workload.openings)
    force, drop = options["force"], options["drop"]
    free = await pressure(model, workload, 16, None, n + 1, force, drop)
    if not free.completed:
        raise SubagentError("the unbounded 16-bit run failed: " + "; ".join(free.errors))
    needed = least_needed(free)
    if budget is None:  # a share of the 16-bit working set, at least one 16-bit conversation's need
        least = least_budget(KVShape(*free.kv_shape), free.trimmable, needed)
        budget = max(int(free.stats.pool["peak_bytes"] * options["fraction"]), least)
    runs = []
    for bits in settings:
        shape = free.shapes.get(bits)
        shape = shape if isinstance(shape, KVShape) else KVShape(*free.kv_shape)  # it runs at 16: the same
        m = pick_max_sessions(budget, shape, free.trimmable, needed, n + 1)
        try:
            runs.append(await pressure(model, workload, bits, budget, m, force, drop))
        except SubagentError as exc:  # the host refused the budget (window too small): report it
            runs.append(BudgetRun(f"{bits}-bit", budget, m, 0, 0.0, [], [str(exc)], None, kv_bits=bits))
    decodes = {bits: DecodeRun() for bits in settings}
    for _ in range(options["decode_repeats"]):
        for bits in settings:
            await decode(model, bits, options["decode_tokens"], decodes[bits])
    references = [r[: options["decode_tokens"]] for r in decodes[settings[0]].tokens[max(DECODE_SESSIONS)]]
    for bits in settings:  # the first setting's too: forced on its own tokens it must choose them all
        decodes[bits].forced = await forced_agreement(model, bits, references)
    return free, runs, decodes


def least_needed(free: BudgetRun) -> int:
    """The tokens every session's window must hold: the longest conversation and its reply."""
    return max(g[-1].usage.prompt_tokens for g in free.replies) + 64


def summarize(
    free: BudgetRun,
    runs: list[BudgetRun],
    decodes: dict[int, DecodeRun],
    settings: list[int],
    *,
    arch: str,
    model: str,
    workload: Workload,
    drop: bool,
    decode_tokens: int,
) -> dict[str, Any]:
    base_bits = settings[0]
    rows = []
    for bits, run in zip(settings, runs, strict=True):
        pool = run.stats.pool if run.stats is not None else {}
        dec = decodes[bits]
        ref = decodes[base_bits].tokens[max(DECODE_SESSIONS)]
        agree = [
            round(agreement(r, o, decode_tokens), 4) for r, o in zip(ref, dec.tokens[max(DECODE_SESSIONS)], strict=True)
        ]
        rows.append(
            {
                "kv_bits": bits,
                "ran_at_bits": run.kv_bits,
                "completed": run.completed,
                "errors": run.errors,
                "budget_bytes": run.budget,
                "max_sessions": run.max_sessions,
                "window_tokens": run.window,
                "kv_bytes_per_token": run.kv_shape[1],
                # polled every ~20 ms: on average through the run, the most at once, and at its end
                "sessions_resident": round(statistics.mean(run.resident), 2) if run.resident else 0.0,
                "sessions_resident_peak": pool.get("peak_sessions", 0),
                "sessions_resident_end": run.resident[-1] if run.resident else 0,
                "peak_kv_bytes": pool.get("peak_bytes", 0),
                **pool_counters(pool),
                "seconds": round(run.seconds, 3),
                "decode_tps": {str(k): round(dec.median(dec.tps, k), 2) for k in dec.tps},
                "decode_tps_rounds": {str(k): [round(v, 2) for v in vs] for k, vs in dec.tps.items()},
                "decode_cpu_tps": {str(k): round(dec.median(dec.cpu_tps, k), 2) for k in dec.cpu_tps},
                "decode_cpu_tps_rounds": {str(k): [round(v, 2) for v in vs] for k, vs in dec.cpu_tps.items()},
                "generated_tokens": {str(k): [len(t) for t in v] for k, v in dec.tokens.items()},
                "agreement": agree,
                "agreement_mean": round(sum(agree) / len(agree), 4) if agree else 0.0,
                "forced_agreement": dec.forced,
                "forced_agreement_mean": round(sum(dec.forced) / len(dec.forced), 4) if dec.forced else 0.0,
            }
        )
    base = rows[0]

    def ratio(row: dict[str, Any], key: str) -> float | None:
        a, b = row[key], base[key]
        return round(a / b, 3) if b else (1.0 if a == b else None)

    def at_4(row: dict[str, Any], key: str) -> float | None:
        ours, theirs = (r[key].get(str(max(DECODE_SESSIONS)), 0.0) for r in (row, base))
        return round(ours / theirs, 3) if theirs else None

    for row in rows:
        row["sessions_resident_ratio"] = ratio(row, "sessions_resident")
        row["reprefilled_ratio"] = ratio(row, "reprefilled_tokens")
        row["decode_at_4_ratio"] = at_4(row, "decode_tps")
        row["decode_at_4_cpu_ratio"] = at_4(row, "decode_cpu_tps")
    eight = next((r for r in rows if r["kv_bits"] == 8), None)
    targets = {}
    if eight is not None and base["kv_bits"] == 16:
        targets = {
            "sessions_resident_8_vs_16": (eight["sessions_resident_ratio"] or 0) >= TARGET_SESSIONS_RATIO,
            "reprefilled_8_vs_16": eight["reprefilled_tokens"] <= TARGET_REPREFILL_RATIO * base["reprefilled_tokens"],
            "decode_at_4_8_vs_16": (eight["decode_at_4_ratio"] or 0) >= TARGET_DECODE_RATIO,
            "decode_at_4_cpu_8_vs_16": (eight["decode_at_4_cpu_ratio"] or 0) >= TARGET_DECODE_RATIO,
            "agreement_8": eight["agreement_mean"] >= TARGET_AGREEMENT,
        }
    return {
        "benchmark": "kv_pressure",
        "mode": "kv_bits",
        "arch": arch,
        "model": model,
        "forced": free.forced,
        "evict": "drop" if drop else "spill",
        "sessions": len(workload.openings),
        "turns": len(workload.calls[0]),
        "result_lines": workload.result_lines,
        "working_set_bytes": free.stats.pool["peak_bytes"],
        "least_budget_bytes": least_budget(KVShape(*free.kv_shape), free.trimmable, least_needed(free)),
        "final_prompt_tokens": [g[-1].usage.prompt_tokens for g in free.replies],
        "decode_tokens": decode_tokens,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "settings": rows,
        "targets": targets,
        "targets_met": bool(targets) and all(targets.values()),
    }


def print_table(report: dict[str, Any]) -> None:
    print(
        f"kv pressure by --kv-bits: {report['model']} ({report['arch']}), {report['sessions']} sessions x "
        f"{report['turns']} turns, tool results of {report['result_lines']} lines, evicted caches "
        f"{'dropped (re-prefilled)' if report['evict'] == 'drop' else 'spilled to disk'}; load average "
        f"{report['load_average']}"
    )
    rows = report["settings"]
    print(
        f"one budget: {rows[0]['budget_bytes'] / 2**20:.2f} MiB (the unbounded 16-bit working set "
        f"{report['working_set_bytes'] / 2**20:.2f} MiB); final prompts {report['final_prompt_tokens']} tokens"
    )
    print()
    header = (
        f"{'bits':>4} {'B/token':>8} {'resident':>8} {'peak':>4} {'end':>3} {'evict':>5} {'spill':>5} {'drop':>4} {'reprefill':>9} "
        f"{'waits':>5} {'tok/s@1':>8} {'tok/s@4':>8} {'@4 vs 16':>8} {'cpu@4 vs 16':>11} {'agree':>6} {'forced':>6} "
        f"{'wall s':>7} {'ok':>3}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        at4, cpu4 = ("-" if r[k] is None else f"{r[k]:.2f}x" for k in ("decode_at_4_ratio", "decode_at_4_cpu_ratio"))
        print(
            f"{r['kv_bits']:>4} {r['kv_bytes_per_token']:>8} {r['sessions_resident']:>8.2f} "
            f"{r['sessions_resident_peak']:>4} {r['sessions_resident_end']:>3} {r['evictions']:>5} "
            f"{r['spills']:>5} {r['drops']:>4} {r['reprefilled_tokens']:>9} {r['admission_waits']:>5} "
            f"{r['decode_tps'].get('1', 0):>8.1f} {r['decode_tps'].get('4', 0):>8.1f} {at4:>8} {cpu4:>11} "
            f"{r['agreement_mean']:>6.3f} {r['forced_agreement_mean']:>6.3f} {r['seconds']:>7.1f} "
            f"{'yes' if r['completed'] else 'NO':>3}"
        )
        for error in r["errors"]:
            print(f"  {r['kv_bits']}-bit: {error}")
        if r["ran_at_bits"] not in (None, r["kv_bits"]):
            print(f"  {r['kv_bits']}-bit: the model cannot take it; it ran at {r['ran_at_bits']} bits")
    print()
    for name, met in report["targets"].items():
        print(f"{'PASS' if met else 'FAIL'}: {name}")
    print(
        "(resident: sessions whose caches were in memory at once, on average through the run (the target's "
        "measure), at most and at the end; agree: per session, the share of "
        f"the {report['decode_tokens']} first generated tokens identical to the first setting's, mean; forced: "
        "the same tokens fed to this setting, the share it would have chosen itself, mean)"
    )


def plot(report: dict[str, Any], path: Path) -> None:
    """Two panels: sessions resident and re-prefilled tokens, per setting."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SubagentError("--plot needs matplotlib: pip install matplotlib") from None
    rows = report["settings"]
    labels = [f"{r['kv_bits']}-bit" for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    left.bar(labels, [r["sessions_resident"] for r in rows], color="#4477aa")
    left.axhline(report["sessions"], color="grey", ls="--", lw=1, label="sessions in the workload")
    left.set_title("sessions resident at once (mean over the run)")
    left.legend(loc="lower right", fontsize=7)
    right.bar(labels, [r["reprefilled_tokens"] for r in rows], color="#cc6677")
    right.set_title("re-prefilled tokens")
    budget = rows[0]["budget_bytes"] / 2**20
    fig.suptitle(f"{report['model']}: {report['sessions']} sessions under one KV budget of {budget:.1f} MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
