"""Interference: sessions keep decoding while a long prompt is prefilled, and a short prompt that
arrives meanwhile is not behind it; prefill slicing off (the old behaviour) against on, side by side.

One run: three sessions decode (their replies forced, so none stops early); once each has decoded
`--before` tokens, (a) a fourth session arrives with a long prompt, and (b) a quarter of (a)'s
time alone later, a fifth with a short one (`--contexts LONG SHORT`, default 8000 and 200 tokens:
generated source lines, as a `read` of a file returns them). (a) and (b) generate `--reply` tokens
greedily. The decoders decode a fixed number of tokens, enough to keep them decoding through (a)'s
prefill at half their speed (from the same decoders' rate and (a)'s time alone, measured first).

Two hosts on the same model, one with `--prefill-slice off` and one with `auto` (or `--slice N`),
each first runs (a) alone, (b) alone and the decoders alone, then the runs, `--repeats` times,
interleaved (off, on, on, off, ...). Figures per mode, the median of its runs:

- decode_retention: the decoders' tokens per second while (a) is prefilled (from its arrival to its
  first token) over their tokens per second before it arrived (from their `--warm`-th token on);
- depth_matched_retention: the same, but over the decoders' own speed alone at the same depths (their
  tokens decoded during (a)'s prefill took this share of the time alone): a decoder gets slower as its
  context grows, by itself, which on the tiny model (attention is most of a step) is most of the
  literal figure's loss over a long prefill;
- long_ttft_ratio: (a)'s time to first token (`Usage.prompt_seconds`, from its admission) over its
  time alone;
- short_ttft_s and short_ttft_ratio: (b)'s time to first token, and over its time alone;
- wall_s: from the decoders' start to the end of the last reply (the same work in both modes);
- prefill_wait_s: the decoders' mean time waiting behind the other sessions' prefills (`Usage`);
- identical_outputs: every run's tokens equal the ones alone: (a)'s and (b)'s greedy replies, and
  the decoders' forced ones.

Targets (issue 40), slicing on, on the tiny model and on SmolLM2 (smaller contexts): decode_retention
at least 0.5, long_ttft_ratio at most 2.0, short_ttft_ratio at most 3.0, identical outputs. Missing a
target still exits 0 (a measurement); errors exit nonzero.

Run (from the repository root; other work on the machine slows both modes alike, but run it niced
and read `load_avg_1min`):

    python benchmarks/interference.py                          # tiny random qwen3
    python benchmarks/interference.py --json
    python benchmarks/interference.py --model smollm2 --contexts 600 60 --before 6 --reply 4
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workload import Report, code_line, make_parser, model_arch, run_report

from mlx_subagents.host import GenerateArgs, MlxModelHost, Reply
from mlx_subagents.host.protocol import Message
from mlx_subagents.testing import make_forced_processor

N_DECODERS = 3
MODES = ("off", "on")
TARGET_RETENTION, TARGET_LONG_TTFT, TARGET_SHORT_TTFT = 0.5, 2.0, 3.0
SHORT_AT = 0.25  # (b) arrives this share of (a)'s time alone after (a)
SYSTEM: Message = {"role": "system", "content": "You are a scout sub-agent. Read what you are given and report."}
WORDS = "the cache holds what was read so the next turn only prefills what is new while the others decode".split()


def source(tokenizer: Any, n_tokens: int, seed: int) -> str:
    """Generated source lines of about `n_tokens` tokens (a file as `read` returns it)."""
    rng, lines, total = random.Random(seed), [], 0
    while total < n_tokens:  # counted a line at a time: within a few tokens of the whole text's count
        lines.append(f"{len(lines) + 1:>6}\t{code_line(rng)}")
        total += len(tokenizer.encode(lines[-1] + "\n", add_special_tokens=False))
    return "\n".join(lines)


def prompt(text: str, what: str) -> list[Message]:
    return [SYSTEM, {"role": "user", "content": f"{what}\n\n{text}\n\nWhat does this code do?"}]


class Clock:
    """A logits processor that forces a script and stamps each token's step (one call per token)."""

    def __init__(self, forced: Any) -> None:
        self.forced, self.stamps = forced, []

    def __call__(self, tokens: Any, logits: Any) -> Any:
        self.stamps.append(time.perf_counter())
        return self.forced(tokens, logits)


class Processors:
    """The hosts' processor factory: decoder sessions (`dec-...`) say their script, stamped."""

    def __init__(self) -> None:
        self.tokenizer: Any = None
        self.scripts: dict[int, list[int]] = {}
        self.clocks: dict[str, Clock] = {}

    def bind(self, tokenizer: Any, n_tokens: int) -> None:
        self.tokenizer = tokenizer
        for i in range(N_DECODERS):
            rng, ids = random.Random(100 + i), []
            while len(ids) < n_tokens + 8:
                ids += tokenizer.encode(" " + " ".join(rng.choice(WORDS) for _ in range(64)), add_special_tokens=False)
            self.scripts[i] = [t for t in ids if t not in set(tokenizer.eos_token_ids)][: n_tokens + 8]

    def __call__(self, session: str, prompt_ids: list[int]) -> list[Any]:
        if not session.startswith("dec-"):
            return []
        clock = Clock(make_forced_processor(self.tokenizer, self.scripts[int(session.rsplit("-", 1)[1])]))
        self.clocks[session] = clock
        return [clock]


@dataclass
class Run:
    """One run of the scenario in one mode."""

    mode: str
    retention: float
    matched: float
    long_ttft_s: float
    short_ttft_s: float
    wall_s: float
    prefill_wait_s: float
    long_ids: tuple[int, ...]
    short_ids: tuple[int, ...]
    decoder_ids: list[tuple[int, ...]] = field(default_factory=list)
    decoded_during: int = 0


@dataclass
class Alone:
    """What each part does with nothing else running, on one host."""

    long_s: float
    short_s: float
    decoder_tps: float  # tokens per second of one decoder, the three decoding together
    long_ids: tuple[int, ...]
    short_ids: tuple[int, ...]
    curve: list[list[float]] = field(default_factory=list)  # each decoder's token stamps, decoding alone


async def depth_curve(host: MlxModelHost, processors: Processors, base: Alone, args: Any, tag: str) -> None:
    """The decoders alone for as many tokens as a run decodes: their speed at each depth (`matched`)."""
    tasks = await decoders(host, f"curve-{tag}", decode_tokens(base, args))
    await asyncio.gather(*tasks)
    base.curve = [processors.clocks[f"dec-curve-{tag}-{i}"].stamps for i in range(N_DECODERS)]


def decode_tokens(base: Alone, args: Any) -> int:
    """What each decoder decodes in a run: enough to decode through (a)'s prefill at half speed."""
    return min(args.max_decode, args.before + int(1.3 * base.decoder_tps * base.long_s) + 16)


def matched(run_stamps: list[list[float]], curve: list[list[float]], arrived: float, end: float) -> float:
    """The decoders' time alone for the tokens they decoded in [arrived, end), over that time (mean)."""
    shares = []
    for stamps, alone in zip(run_stamps, curve, strict=True):
        k0, k1 = sum(t < arrived for t in stamps), min(sum(t < end for t in stamps), len(alone) - 1)
        shares.append((alone[k1] - alone[k0]) / (end - arrived) if k1 > k0 else 0.0)
    return round(statistics.mean(shares), 3)


async def reply(host: MlxModelHost, name: str, messages: list[Message], n_tokens: int) -> Reply:
    session = host.session(name)
    try:
        return await session.generate(messages, GenerateArgs(max_tokens=n_tokens))
    finally:
        await session.close()


async def decoders(host: MlxModelHost, tag: str, n_tokens: int) -> list[asyncio.Task[Reply]]:
    return [
        asyncio.create_task(reply(host, f"dec-{tag}-{i}", prompt(f"Task {i}: report.", "Decode."), n_tokens))
        for i in range(N_DECODERS)
    ]


def stamps(processors: Processors, tag: str) -> list[float]:
    return sorted(t for i in range(N_DECODERS) for t in processors.clocks[f"dec-{tag}-{i}"].stamps)


async def alone(host: MlxModelHost, processors: Processors, texts: tuple[str, str], args: Any, tag: str) -> Alone:
    long = await reply(host, f"long-alone-{tag}", prompt(texts[0], "Read this."), args.reply)
    short = await reply(host, f"short-alone-{tag}", prompt(texts[1], "Read this."), args.reply)
    tasks = await decoders(host, f"alone-{tag}", 4 * args.before)
    await asyncio.gather(*tasks)
    times = stamps(processors, f"alone-{tag}")[N_DECODERS * args.warm :]
    tps = (len(times) - 1) / (times[-1] - times[0]) / N_DECODERS
    return Alone(long.usage.prompt_seconds, short.usage.prompt_seconds, tps, long.token_ids, short.token_ids)


async def scenario(
    host: MlxModelHost, processors: Processors, texts: tuple[str, str], base: Alone, args: Any, tag: str
) -> Run:
    """The decoders, then (a), then (b) during (a)'s prefill; figures from the decoders' stamps."""
    n_decode = decode_tokens(base, args)
    start = time.perf_counter()
    tasks = await decoders(host, tag, n_decode)
    clocks = [processors.clocks.get(f"dec-{tag}-{i}") for i in range(N_DECODERS)]
    while not all(c is not None and len(c.stamps) >= args.before for c in clocks):
        await asyncio.sleep(0.002)
        clocks = [processors.clocks.get(f"dec-{tag}-{i}") for i in range(N_DECODERS)]
    arrived = time.perf_counter()
    long = asyncio.create_task(reply(host, f"long-{tag}", prompt(texts[0], "Read this."), args.reply))
    await asyncio.sleep(SHORT_AT * base.long_s)
    short = asyncio.create_task(reply(host, f"short-{tag}", prompt(texts[1], "Read this."), args.reply))
    a, b, *decoded = await asyncio.gather(long, short, *tasks)
    wall = time.perf_counter() - start
    times = stamps(processors, tag)
    first = sorted(c.stamps[args.warm] for c in clocks if c is not None)[-1]
    before = [t for t in times if first <= t < arrived]
    rate_before = (len(before) - 1) / (before[-1] - before[0]) if len(before) > 1 else 0.0
    end = arrived + a.usage.prompt_seconds
    during = [t for t in times if arrived <= t < end]
    rate_during = len(during) / (end - arrived) if end > arrived else 0.0
    return Run(
        mode="",
        retention=round(rate_during / rate_before, 3) if rate_before else 0.0,
        matched=matched([c.stamps for c in clocks if c is not None], base.curve, arrived, end),
        long_ttft_s=a.usage.prompt_seconds,
        short_ttft_s=b.usage.prompt_seconds,
        wall_s=wall,
        prefill_wait_s=statistics.mean(r.usage.prefill_wait_seconds for r in decoded),
        long_ids=a.token_ids,
        short_ids=b.token_ids,
        decoder_ids=[r.token_ids for r in decoded],
        decoded_during=len(during),
    )


async def measure(
    model: Path, args: Any
) -> tuple[dict[str, Alone], dict[str, list[Run]], dict[str, Any], dict[int, list[int]]]:
    import mlx_lm

    load_before = os.getloadavg()[0]
    tokenizer = mlx_lm.load(str(model))[1]
    long_tokens, short_tokens = args.contexts
    texts = (source(tokenizer, long_tokens, 1), source(tokenizer, short_tokens, 2))
    processors = Processors()
    # Enough script for the longest the decoders are asked for (a generous bound, before calibrating).
    processors.bind(tokenizer, args.max_decode)
    common = dict(processor_factory=processors, kv_budget=0, prefix_cache=0, context_window=args.window)
    hosts = {
        "off": MlxModelHost(str(model), prefill_slice="off", **common),
        "on": MlxModelHost(str(model), prefill_slice=args.slice, **common),
    }
    for host in hosts.values():
        await host.start()
    try:
        for mode, host in hosts.items():  # untimed: kernels, the shared system prompt
            await reply(host, f"warm-{mode}", prompt(texts[1], "Read this."), 2)
        base = {mode: await alone(host, processors, texts, args, mode) for mode, host in hosts.items()}
        for mode, host in hosts.items():
            await depth_curve(host, processors, base[mode], args, mode)
        runs: dict[str, list[Run]] = {mode: [] for mode in MODES}
        for rep in range(args.repeats):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                run = await scenario(hosts[mode], processors, texts, base[mode], args, f"{mode}{rep}")
                run.mode = mode
                runs[mode].append(run)
                print(
                    f"  {mode} run {rep + 1}: retention {run.retention:.2f} (at the same depths {run.matched:.2f}), long TTFT {run.long_ttft_s:.2f}s "
                    f"(alone {base[mode].long_s:.2f}s), short TTFT {run.short_ttft_s:.2f}s "
                    f"(alone {base[mode].short_s:.2f}s), wall {run.wall_s:.1f}s",
                    file=sys.stderr,
                )
        prompt_tokens = [await hosts["on"].count_tokens(prompt(t, "Read this.")) for t in texts]
    finally:
        for host in hosts.values():
            await host.stop()
    info = {"prompt_tokens": prompt_tokens, "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    return base, runs, info, processors.scripts


def summarize(
    base: dict[str, Alone], runs: dict[str, list[Run]], info: dict[str, Any], scripts: dict[int, list[int]], args: Any
) -> Report:
    rows = {}
    for mode in MODES:
        rs, b = runs[mode], base[mode]
        rows[mode] = {
            "decode_retention": round(statistics.median(r.retention for r in rs), 3),
            "depth_matched_retention": round(statistics.median(r.matched for r in rs), 3),
            "long_ttft_s": round(statistics.median(r.long_ttft_s for r in rs), 3),
            "long_alone_s": round(b.long_s, 3),
            "long_ttft_ratio": round(statistics.median(r.long_ttft_s for r in rs) / b.long_s, 3),
            "short_ttft_s": round(statistics.median(r.short_ttft_s for r in rs), 3),
            "short_alone_s": round(b.short_s, 3),
            "short_ttft_ratio": round(statistics.median(r.short_ttft_s for r in rs) / b.short_s, 3),
            "wall_s": round(statistics.median(r.wall_s for r in rs), 3),
            "prefill_wait_s": round(statistics.median(r.prefill_wait_s for r in rs), 3),
            "decoder_tok_s_alone": round(b.decoder_tps, 1),
            "decoded_during_prefill": [r.decoded_during for r in rs],
            "runs": [
                {
                    "retention": r.retention,
                    "depth_matched_retention": r.matched,
                    "long_ttft_s": round(r.long_ttft_s, 3),
                    "short_ttft_s": round(r.short_ttft_s, 3),
                    "wall_s": round(r.wall_s, 3),
                }
                for r in rs
            ],
        }
    identical = all(
        r.long_ids == base[r.mode].long_ids == base["off"].long_ids
        and r.short_ids == base[r.mode].short_ids == base["off"].short_ids
        and all(list(ids) == scripts[i][: len(ids)] for i, ids in enumerate(r.decoder_ids))
        for mode in MODES
        for r in runs[mode]
    )
    on = rows["on"]
    targets = {
        "decode_retention": {"value": on["decode_retention"], "target": f">= {TARGET_RETENTION}"},
        "long_ttft_ratio": {"value": on["long_ttft_ratio"], "target": f"<= {TARGET_LONG_TTFT}"},
        "short_ttft_ratio": {"value": on["short_ttft_ratio"], "target": f"<= {TARGET_SHORT_TTFT}"},
        "identical_outputs": {"value": identical, "target": True},
    }
    targets["decode_retention"]["met"] = on["decode_retention"] >= TARGET_RETENTION
    targets["long_ttft_ratio"]["met"] = on["long_ttft_ratio"] <= TARGET_LONG_TTFT
    targets["short_ttft_ratio"]["met"] = on["short_ttft_ratio"] <= TARGET_SHORT_TTFT
    targets["identical_outputs"]["met"] = identical
    return {
        "benchmark": "interference",
        "slice": args.slice,
        "contexts": list(args.contexts),
        "decoders": N_DECODERS,
        "repeats": args.repeats,
        "results": rows,
        "identical_outputs": identical,
        "targets": targets,
        "targets_met": all(t["met"] for t in targets.values()),
        **info,
    }


def print_table(report: Report) -> None:
    long, short = report["prompt_tokens"]
    print(
        f"interference: {report['model']} ({report['arch']}), {report['decoders']} decoders, a {long}-token prompt "
        f"and a {short}-token one during its prefill; slicing off vs {report['slice']} "
        f"(median of {report['repeats']}; load {report['load_avg_1min']})"
    )
    header = (
        f"{'slicing':<8} {'retention':>9} {'same depth':>10} {'long TTFT s':>11} {'alone s':>8} {'ratio':>6} "
        f"{'short TTFT s':>12} {'alone s':>8} {'ratio':>6} {'wall s':>7} {'waited s':>8}"
    )
    print(header)
    print("-" * len(header))
    for mode, r in report["results"].items():
        print(
            f"{mode:<8} {r['decode_retention']:>9.2f} {r['depth_matched_retention']:>10.2f} {r['long_ttft_s']:>11.2f} {r['long_alone_s']:>8.2f} "
            f"{r['long_ttft_ratio']:>6.2f} {r['short_ttft_s']:>12.2f} {r['short_alone_s']:>8.2f} "
            f"{r['short_ttft_ratio']:>6.2f} {r['wall_s']:>7.1f} {r['prefill_wait_s']:>8.2f}"
        )
    print(f"identical token ids (off = on = alone): {report['identical_outputs']}")
    for name, t in report["targets"].items():
        print(f"{'PASS' if t['met'] else 'FAIL'}: {name} = {t['value']} (target {t['target']})")


def parse_args(argv: Sequence[str] | None) -> Any:
    parser = make_parser(__doc__)
    parser.add_argument(
        "--contexts", type=int, nargs=2, default=[8000, 200], metavar=("LONG", "SHORT"), help="prompt tokens"
    )
    parser.add_argument("--slice", default="auto", help="the sliced host's --prefill-slice (default auto)")
    parser.add_argument("--before", type=int, default=200, help="tokens each decoder decodes before (a) arrives")
    parser.add_argument("--warm", type=int, default=32, help="decoder tokens left out of the rate before (a)")
    parser.add_argument("--reply", type=int, default=8, help="tokens (a) and (b) generate (default 8)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode, interleaved (default 2)")
    parser.add_argument("--max-decode", type=int, default=6000, help="the longest decoder script (tokens)")
    args = parser.parse_args(argv)
    if min(args.contexts) < 16 or args.warm >= args.before or min(args.reply, args.repeats) < 1:
        parser.error("--contexts must be at least 16 tokens, --warm below --before, --reply and --repeats >= 1")
    args.window = max(4096, args.contexts[0] + args.max_decode + 512)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    def measure_model(model: Path, label: str) -> Report:
        base, runs, info, scripts = asyncio.run(measure(model, args))
        return {"model": label, "arch": model_arch(model)} | summarize(base, runs, info, scripts, args)

    return run_report(args, measure_model, print_table, context_window=args.window)


if __name__ == "__main__":
    sys.exit(main())
