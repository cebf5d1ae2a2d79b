"""Speculative decoding: one session's reply decoded one token per forward (drafts off: the single path,
`SingleStream`) and with prompt-lookup drafts verified in one forward (`DraftedStream`), side by side;
then four sessions decoding together in the host's batch, `--draft off` against `--draft lookup`.

Workloads an agent makes, each a prompt rendered with the model's chat template and a greedy reply of
`--tokens` tokens (or until the end of the reply):

- edit: a 60-line function the agent read, then asked for an `edit` call quoting the function as
  `old_text` and writing it again with one name changed as `new_text`;
- rewrite: a 40-line file, written again whole with two changes;
- summary: a free-form summary of that file, naming its functions;
- random: text with nothing to copy (a short story on a subject the prompt does not contain).

Per workload: identical (the same tokens both ways, asserted: greedy drafts change no token),
tokens_per_forward (kept tokens per verifying forward with drafts: hardware-independent), the
drafted and accepted tokens, decode tokens per second both ways and their ratio, and the wall
(prefill and decode). `forward_cost` is this machine's cost of a forward of the mean drafted length
over a one-token forward: on a memory-bound device (a Mac's GPU) it is about 1, so the decode speeds
up by about tokens_per_forward; on a CPU the cost grows with the tokens. Each mode runs `--repeats`
times, interleaved (off, on, on, off, ...); the medians are reported.

Four sessions (`sessions`): the mixed workload, one session of each workload above, through a real
`MlxModelHost` (its decode stage's batch, `drafted_batch.py` where rows draft), each prompt prefilled
first by a one-token reply so that the timed replies are decode: per session, the same tokens both
ways (asserted), tokens per forward of its row (its tokens over its tokens less the drafts it kept)
and its drafted and kept tokens; over all four, decode tokens per second both ways and their ratio.

Run (from the repository root):

    python benchmarks/speculative.py                      # tiny random qwen3
    python benchmarks/speculative.py --model smollm2 --json
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from workload import Report, code_line, make_parser, run_report

from mlx_subagents.host import GenerateArgs, MlxModelHost
from mlx_subagents.host.mlx.drafted import DraftedStream
from mlx_subagents.host.mlx.drafts import LookupDrafter
from mlx_subagents.host.mlx.single import SingleStream
from mlx_subagents.host.mlx.verify import Sampling


def function_text(rng: random.Random, lines: int) -> str:
    return "\n".join(["def handle_request(request: Request) -> Response:"] + [code_line(rng) for _ in range(lines - 1)])


def workloads() -> dict[str, str]:
    """Each workload's user message."""
    rng = random.Random(67)
    function, file = function_text(rng, 60), function_text(rng, 40)
    return {
        "edit": f"You read src/server.py:\n```python\n{function}\n```\nCall the edit tool on src/server.py: "
        "`old_text` is the function above, quoted exactly; `new_text` is the same function with "
        "`handle_request` renamed `serve_request`. Answer with the call's JSON only.",
        "rewrite": f"Here is src/cache.py:\n```python\n{file}\n```\nWrite the whole file again with two "
        "changes: `handle_request` becomes `serve_request`, and every `strict=True` becomes `strict=False`.",
        "summary": f"Here is src/cache.py:\n```python\n{file}\n```\nSummarize what this file does, naming "
        "each function it defines and what it calls.",
        "random": "Write a short story about a lighthouse keeper who finds a map in a bottle.",
    }


def decode(model: Any, tokenizer: Any, prompt: list[int], n: int, drafts: bool) -> dict[str, Any]:
    """One greedy reply of at most `n` tokens, with or without drafts: its tokens, the forwards run, the
    drafted and accepted tokens, the prefill and decode seconds."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    start = time.perf_counter()
    cache = make_prompt_cache(model)
    model(mx.array([prompt[:-1]]), cache=cache)
    mx.eval([c.state for c in cache])
    prefilled = time.perf_counter()
    eos = set(tokenizer.eos_token_ids)
    tokens: list[int] = []
    if drafts:
        stream = DraftedStream(model, cache, prompt, Sampling(0.0), LookupDrafter())
        while len(tokens) < n and not eos & set(tokens):
            tokens += stream.next(limit=n - len(tokens))
        counts = stream.counts
        forwards, drafted, accepted = counts.forwards, counts.drafted, counts.accepted
    else:
        single = SingleStream(model, cache, prompt, make_sampler(temp=0.0), [])
        while len(tokens) < n and not eos & set(tokens):
            tokens.append(single.next())
        forwards, drafted, accepted = len(tokens), 0, 0
    end = time.perf_counter()
    cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return {
        "tokens": tokens[:cut],
        "forwards": forwards,
        "drafted": drafted,
        "accepted": accepted,
        "prefill_s": prefilled - start,
        "decode_s": end - prefilled,
    }


def forward_cost(model: Any, prompt: list[int], width: int, repeats: int = 5) -> float:
    """The seconds of a forward of `width` tokens over a one-token forward's, at the prompt's depth (the
    cache trimmed back after each, so each runs at the same depth)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([prompt[:-1]]), cache=cache)
    mx.eval([c.state for c in cache])

    def timed(tokens: int) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            mx.eval(model(mx.array([prompt[-tokens:]]), cache=cache))
            times.append(time.perf_counter() - t0)
            trim_prompt_cache(cache, tokens)
        return statistics.median(times)

    timed(1)  # warm
    return timed(width) / timed(1)


def measure(model_path: Path, label: str, tokens: int, repeats: int, parts: str = "both") -> Report:
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(model_path))
    rows: dict[str, Any] = {}
    for name, message in workloads().items() if parts != "batched" else ():
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
        runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for i in range(repeats):
            for drafts in (False, True) if i % 2 == 0 else (True, False):
                runs[drafts].append(decode(model, tokenizer, prompt, tokens, drafts))
        off, on = runs[False], runs[True]
        print(f"  {name}: done", file=sys.stderr, flush=True)
        identical = all(r["tokens"] == off[0]["tokens"] for r in off + on)
        n = len(on[0]["tokens"])

        def rate(rs: list[dict[str, Any]]) -> float:
            return statistics.median(len(r["tokens"]) / r["decode_s"] for r in rs)

        per_forward = n / on[0]["forwards"]
        rows[name] = {
            "prompt_tokens": len(prompt),
            "reply_tokens": n,
            "identical": identical,
            "tokens_per_forward": round(per_forward, 2),
            "drafted": on[0]["drafted"],
            "accepted": on[0]["accepted"],
            "decode_tps_off": round(rate(off), 1),
            "decode_tps_on": round(rate(on), 1),
            "speedup": round(rate(on) / rate(off), 2),
            "wall_s_off": round(statistics.median(r["prefill_s"] + r["decode_s"] for r in off), 3),
            "wall_s_on": round(statistics.median(r["prefill_s"] + r["decode_s"] for r in on), 3),
            "forward_cost": round(forward_cost(model, prompt, max(1, round(per_forward))), 2),
        }
    report = {"model": label, "tokens": tokens, "repeats": repeats, "sessions": 1, "workloads": rows}
    return report | {"batched": batched(model_path, tokens, repeats) if parts != "single" else None}


async def together(model_path: Path, tokens: int, draft: str) -> dict[str, Any]:
    """One session per workload decoding together on one host with `draft`: each one's reply (its prompt
    prefilled first by a one-token reply) and the seconds the four took."""
    import asyncio

    async with MlxModelHost(str(model_path), draft=draft, context_window=4096) as host:
        messages = {name: [{"role": "user", "content": text}] for name, text in workloads().items()}
        await asyncio.gather(*(host.session(n).generate(m, GenerateArgs(max_tokens=1)) for n, m in messages.items()))
        start = time.perf_counter()
        replies = await asyncio.gather(
            *(host.session(n).generate(m, GenerateArgs(max_tokens=tokens)) for n, m in messages.items())
        )
        return {"replies": dict(zip(messages, replies, strict=True)), "seconds": time.perf_counter() - start}


def batched(model_path: Path, tokens: int, repeats: int) -> dict[str, Any]:
    """The four sessions with drafts off and on, interleaved `repeats` times: per session its tokens per
    forward, drafted and kept tokens; over all, decode tokens per second both ways."""
    import asyncio

    runs: dict[str, list[dict[str, Any]]] = {"off": [], "lookup": []}
    for i in range(repeats):
        for draft in ("off", "lookup") if i % 2 == 0 else ("lookup", "off"):
            runs[draft].append(asyncio.run(together(model_path, tokens, draft)))
    print("  4 sessions: done", file=sys.stderr, flush=True)
    first = runs["lookup"][0]["replies"]
    identical = all(
        r.token_ids == first[name].token_ids
        for run in runs["off"] + runs["lookup"]
        for name, r in run["replies"].items()
    )

    def rate(draft: str) -> float:
        return statistics.median(
            sum(len(r.token_ids) for r in run["replies"].values()) / run["seconds"] for run in runs[draft]
        )

    sessions = {
        name: {
            "reply_tokens": len(r.token_ids),
            "tokens_per_forward": round(len(r.token_ids) / max(1, len(r.token_ids) - r.usage.accepted_tokens), 2),
            "drafted": r.usage.drafted_tokens,
            "accepted": r.usage.accepted_tokens,
        }
        for name, r in first.items()
    }
    off, on = rate("off"), rate("lookup")
    return {
        "sessions": sessions,
        "identical": identical,
        "decode_tps_off": round(off, 1),
        "decode_tps_on": round(on, 1),
        "speedup": round(on / off, 2),
    }


def print_table(report: Report) -> None:
    print(f"speculative: {report['model']}, 1 session, up to {report['tokens']} tokens, median of {report['repeats']}")
    head = f"{'workload':<9} {'same':>5} {'tok/fwd':>8} {'drafted':>8} {'kept':>6} {'off t/s':>8} {'on t/s':>8} {'on/off':>7} {'fwd cost':>9}"
    print(head)
    for name, r in report["workloads"].items():  # none with --parts batched
        print(
            f"{name:<9} {('yes' if r['identical'] else 'NO'):>5} {r['tokens_per_forward']:>8} {r['drafted']:>8} "
            f"{r['accepted']:>6} {r['decode_tps_off']:>8} {r['decode_tps_on']:>8} {r['speedup']:>7} {r['forward_cost']:>9}"
        )
    b = report["batched"]
    if b is None:
        return
    print("\n4 sessions together in the host's batch (the mixed workload: one session of each), --draft off vs lookup")
    print(
        f"{'session':<9} {'same':>5} {'tok/fwd':>8} {'drafted':>8} {'kept':>6} {'off t/s':>8} {'on t/s':>8} {'on/off':>7}"
    )
    for name, r in b["sessions"].items():
        print(
            f"{name:<9} {('yes' if b['identical'] else 'NO'):>5} {r['tokens_per_forward']:>8} {r['drafted']:>8} {r['accepted']:>6}"
        )
    print(
        f"{'all 4':<9} {('yes' if b['identical'] else 'NO'):>5} {'':>8} {'':>8} {'':>6} {b['decode_tps_off']:>8} {b['decode_tps_on']:>8} {b['speedup']:>7}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__ or "")
    parser.add_argument("--tokens", type=int, default=160, help="reply tokens at most, per workload")
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode, interleaved")
    parser.add_argument(
        "--parts", choices=("both", "single", "batched"), default="both", help="one session, four in a batch, or both"
    )
    args = parser.parse_args(argv)
    return run_report(
        args,
        lambda path, label: measure(path, label, args.tokens, args.repeats, args.parts),
        print_table,
        context_window=4096,
    )


if __name__ == "__main__":
    sys.exit(main())
