"""Warm starts: what the prefix store saves a `subagent run` that starts in a new process.

For an agent with a prompt of about 2k tokens (a user agent written by this script; the system
prompt, its tools and a generated list of rules), it runs the CLI as separate processes, one after
another, side by side in one run:

- cold: an empty prefix cache, task A (prefills the whole prompt and writes the prefix file);
- warm: the same agent, a new task B (loads the prefix, prefills only the task);
- cold B: task B again with `--prefix-cache off`, the cold counterpart of the warm run;
- corrupted: one byte of the prefix file flipped, task A again (one warning, a cold prefill).

Per run it reports the first turn's prefilled tokens (`input_tokens - cached_tokens` of its `usage`
event, `--max-turns 1`), time to first token (from the `turn_start` event's time to the `usage` event's, less
the generation of all but the first token at the reported rate) and the process's whole wall time.
`--json`: the last line is one object with `warm_prefill_tokens`, `cold_prefill_tokens`,
`warm_ttft_ratio` (warm over cold B), `identical_outputs` (warm == cold B and corrupted == cold, the
replies greedy) and per-run rows. Targets: the warm first turn prefills at most the task's tokens
plus 32; `warm_ttft_ratio` <= 0.3 on SmolLM2 (prefill dominates), <= 0.5 on the tiny model. Missing a
target still exits 0 (a measurement); errors exit nonzero.

Run (from the repository root):

    python benchmarks/warm_start.py                 # tiny random qwen3, built in a temporary folder
    python benchmarks/warm_start.py --json
    python benchmarks/warm_start.py --model ~/models/SmolLM2-135M-Instruct --target-ttft 0.3

`--model` takes any local model folder or imported name (`subagent models import FILE.gguf`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BODY_TOKENS = 1200  # with the three tools, a prompt of about 2k tokens
MAX_TOKENS = 16
TASK_A = "Where is the configuration parsed, and which function reads the file?"
TASK_B = "List the modules that import the logging helpers and say what each one logs."


@dataclass(frozen=True)
class ProcessRun:
    name: str
    task: str
    prompt_tokens: int
    prefill_tokens: int
    cached_tokens: int
    ttft_s: float
    wall_s: float
    output: str
    warned: bool


def agent_file(tokenizer_json: Path, target: int) -> str:
    """An agent whose body is about `target` tokens of this model's tokenizer."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    rules: list[str] = []
    body = ""
    while len(tokenizer.encode(body).ids) < target:
        i = len(rules)
        rules.append(f"Rule {i}: read file number {i} with care.")
        body = "You are a scout. " + " ".join(rules)
    return f"---\nname: bench\ndescription: a scout with a long prompt\ntools: read, grep, ls\n---\n{body}\n"


def run_cli(name: str, task: str, model: str, home: Path, cwd: Path, *extra: str) -> ProcessRun:
    """One `subagent run` process: its first turn's usage, its time to first token, its wall time."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLX_SUBAGENTS_HOME": str(home)}
    args = ["run", "bench", task, "--model", model, "--cwd", str(cwd), "--events", "--max-turns", "1"]
    args += ["--max-tokens", str(MAX_TOKENS), *extra]
    tic = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_subagents.cli", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    started = usage = None
    output = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        now = event["time"]  # stamped by the process as it happened: pipe buffering does not count
        if event.get("kind") == "turn_start" and started is None:
            started = now
        elif event.get("kind") == "usage" and usage is None:
            usage = event["data"], now
        elif event.get("kind") == "message":
            output = event["data"].get("text", "")
    errors = proc.stderr.read() if proc.stderr else ""
    proc.wait()
    wall = time.perf_counter() - tic
    if started is None or usage is None:
        raise SystemExit(f"{name}: no first turn (exit {proc.returncode}): {errors.strip()[-500:]}")
    data, at = usage
    tps = data.get("tps") or 0.0
    decode = (data["output_tokens"] - 1) / tps if tps > 0 else 0.0
    return ProcessRun(
        name,
        task,
        data["input_tokens"],
        data["input_tokens"] - data["cached_tokens"],
        data["cached_tokens"],
        max(0.0, at - started - decode),
        wall,
        output,
        "prefix cache:" in errors,
    )


def measure(model: str, model_dir: Path, work: Path) -> dict[str, object]:
    from mlx_subagents.host.kv.prefix_files import list_prefixes

    home, cwd = work / "home", work / "ws"
    (home / "agents").mkdir(parents=True)
    cwd.mkdir()
    (cwd / "README.md").write_text("# demo\n")
    (home / "agents" / "bench.md").write_text(agent_file(model_dir / "tokenizer.json", BODY_TOKENS))
    cold = run_cli("cold", TASK_A, model, home, cwd)
    stored = list_prefixes(home / "cache" / "prefixes")
    warm = run_cli("warm", TASK_B, model, home, cwd)
    cold_b = run_cli("cold B", TASK_B, model, home, cwd, "--prefix-cache", "off")
    for entry in stored:  # one byte of the arrays, far past the header
        data = bytearray(entry.path.read_bytes())
        data[-100] ^= 0xFF
        entry.path.write_bytes(bytes(data))
    corrupted = run_cli("corrupted", TASK_A, model, home, cwd)
    prefix = stored[0].n_tokens if stored else 0
    task_tokens = warm.prompt_tokens - prefix
    return {
        "model": model,
        "prefix_tokens": prefix,
        "cold_prefill_tokens": cold_b.prefill_tokens,
        "warm_prefill_tokens": warm.prefill_tokens,
        "warm_task_tokens": task_tokens,
        "warm_ttft_ratio": round(warm.ttft_s / cold_b.ttft_s, 3) if cold_b.ttft_s else None,
        "warm_wall_ratio": round(warm.wall_s / cold_b.wall_s, 3),
        "identical_outputs": warm.output == cold_b.output and corrupted.output == cold.output,
        "corruption_warned": corrupted.warned and corrupted.cached_tokens == 0,
        "target_prefill_met": bool(stored) and warm.prefill_tokens <= task_tokens + 32,
        "runs": [asdict(r) for r in (cold, warm, cold_b, corrupted)],
    }


def table(report: dict[str, object]) -> str:
    rows = [f"{'run':<10} {'prompt':>7} {'prefilled':>9} {'cached':>7} {'ttft s':>8} {'wall s':>7}  warning"]
    for r in report["runs"]:  # type: ignore[attr-defined]
        rows.append(
            f"{r['name']:<10} {r['prompt_tokens']:>7} {r['prefill_tokens']:>9} {r['cached_tokens']:>7} "
            f"{r['ttft_s']:>8.3f} {r['wall_s']:>7.2f}  {'yes' if r['warned'] else ''}"
        )
    rows.append(
        f"warm/cold time to first token {report['warm_ttft_ratio']} (target {report['target_ttft_ratio']}), "
        f"wall {report['warm_wall_ratio']}; identical outputs {report['identical_outputs']}"
    )
    return "\n".join(rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local model folder or imported name (default: a tiny random qwen3)")
    parser.add_argument("--target-ttft", type=float, default=None, help="warm_ttft_ratio target (0.5 tiny, 0.3 real)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="warm-start-") as tmp:
        work = Path(tmp)
        if args.model:
            from mlx_subagents.host.mlx.loading import resolve_model_path

            model, model_dir = args.model, resolve_model_path(args.model)
        else:
            from mlx_subagents.testing import make_tiny_model

            model_dir = make_tiny_model(work / "tiny", context_window=8192)  # room for a 2k-token prompt
            model = str(model_dir)
        report = measure(model, model_dir, work)
    target = args.target_ttft if args.target_ttft is not None else (0.3 if args.model else 0.5)
    ratio = report["warm_ttft_ratio"]
    report["target_ttft_ratio"] = target
    report["target_met"] = bool(report["target_prefill_met"]) and ratio is not None and ratio <= target  # type: ignore[operator]
    print(json.dumps(report) if args.json else table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
