"""Smoke tests: the throughput and KV-pressure benchmarks run end to end on tiny models.

They check the report's shape and its correctness flags, never speed ratios (machines are noisy).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import statistics
import sys
from typing import Any

import pytest

from tests.helpers import REPO

THROUGHPUT_KEYS = {
    "benchmark", "arch", "model", "forced", "tokens_per_session", "repeats", "session_counts",
    "prompt_tokens", "results", "ratio_batched_vs_serialized", "ratio_host_vs_raw_batch",
    "ratio_host_vs_raw_batch_steady", "ratio_host_vs_raw_batch_cpu", "batched_scaling_vs_1", "ratio_batched_vs_serialized_at_4",
    "ratio_host_vs_raw_batch_at_4", "identical_outputs", "exact_token_counts", "targets", "targets_met",
    "stream_generate_at_1", "ratio_host_vs_stream_generate_at_1", "startup_overhead_s", "load_s", "host_ready_s",
    "ttft_shared_prefix_s", "ttft_private_prefix_s", "ttft_shared_prefix_cached_tokens", "load_avg_1min",
    "at_1_pairs", "ratio_host_vs_stream_generate_at_1_decode_cpu", "ratio_batched_vs_serialized_cpu", "at_4_pairs",
}  # fmt: skip
THROUGHPUT_ROW_KEYS = {
    "sessions", "generated_tokens", "decode_tok_s", "decode_tok_s_median", "e2e_tok_s", "steady_tok_s", "cpu_ms_per_token",
    "decode_s", "wall_s", "ttft_p50_s", "ttft_p95_s",
}  # fmt: skip
KV_KEYS = {
    "benchmark", "arch", "model", "forced", "share_prefix", "sessions", "turns", "kv_fixed_bytes",
    "kv_per_token_bytes", "working_set_bytes", "final_prompt_tokens", "identical_outputs",
    "all_within_budget", "budgets", "targets", "targets_met",
}  # fmt: skip
KV_ROW_KEYS = {
    "label", "budget_bytes", "max_sessions", "window_tokens", "completed", "errors", "peak_kv_bytes",
    "peak_sampled_kv_bytes", "within_budget", "evictions", "spills", "restores", "drops",
    "reprefilled_tokens", "admission_waits", "seconds", "wall_vs_unbounded", "prefix_hit_rate",
    "held_reuse_rate", "identical_outputs",
}  # fmt: skip


def ratio_of_rounded(x: float, y: float, r: float, step: float) -> bool:
    """Whether `r`, a ratio printed to 0.001, is `x / y` for `x` and `y` printed to `step`: within what the three
    roundings allow, which grows with the ratio (a stalled run at 32.9 tok/s against 687.5: 0.025 by rounding alone)."""
    return abs(x / y - r) <= 0.0005 + (x / y) * (step / 2 / x + step / 2 / y) + 1e-9


def run_benchmark(script: str, *args: str) -> dict[str, Any]:
    """`benchmarks/SCRIPT --json ARGS` through the script's own `main`, in this process: its `--json` line.
    (A process of its own paid seconds of CPU to import mlx-lm and train the tiny tokenizer, which this
    worker has done already; the script's arguments, work and report are the same.)"""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    module = importlib.import_module(script.removesuffix(".py"))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = module.main(["--json", *args])
    assert code == 0, printed.getvalue()[-2000:]
    return json.loads(printed.getvalue().strip().splitlines()[-1])


@pytest.mark.slow
def test_throughput_benchmark_json() -> None:
    report = run_benchmark("throughput.py", "--tokens", "8", "--repeats", "1", "--tokens-at-1", "12", "--pairs", "3")

    assert THROUGHPUT_KEYS <= report.keys()
    assert report["benchmark"] == "throughput" and report["arch"] == "qwen3" and report["forced"] is True
    assert report["session_counts"] == [1, 2, 4]
    assert set(report["results"]) == {"serialized", "batched", "raw"}
    for mode in report["results"].values():
        assert set(mode) == {"1", "2", "4"}
        for n, row in mode.items():
            assert THROUGHPUT_ROW_KEYS <= row.keys()
            assert row["generated_tokens"] == 8 * int(n)
            assert row["decode_tok_s"] > 0 and row["ttft_p50_s"] <= row["ttft_p95_s"]
    assert all(100 <= n <= 300 for n in report["prompt_tokens"])
    assert isinstance(report["ratio_batched_vs_serialized_at_4"], float)
    assert isinstance(report["ratio_host_vs_raw_batch_at_4"], float)
    assert report["identical_outputs"] is True
    assert report["exact_token_counts"] is True
    stream = report["stream_generate_at_1"]
    assert THROUGHPUT_ROW_KEYS <= stream.keys() and stream["generated_tokens"] == 8
    assert report["host_ready_s"] > 0 and report["load_s"] > 0
    assert report["startup_overhead_s"] == round(max(0.0, report["host_ready_s"] - report["load_s"]), 4)
    assert report["ttft_shared_prefix_cached_tokens"] > 0
    assert set(report["targets"]) == {
        "host_vs_stream_generate_at_1", "batched_vs_serialized_at_1", "startup_overhead_s", "ttft_shared_prefix_s",
        "batched_vs_serialized_at_4", "host_vs_raw_batch_at_4", "host_vs_raw_batch_at_4_paired", "identical_outputs",
    }  # fmt: skip
    assert report["targets_met"] == all(t["met"] for t in report["targets"].values())
    # At four sessions, the host against the raw batch next to the raw batch against itself (the null).
    at_4 = report["at_4_pairs"]
    assert (at_4["tokens"], at_4["pairs"], at_4["identical"]) == (8, 3, True)
    assert (
        set(at_4["ratios"])
        == set(at_4["median"])
        == {"host_vs_raw", "null", "host_vs_raw_decode_cpu", "null_decode_cpu"}
    )
    for key, ratios in at_4["ratios"].items():
        assert (
            len(ratios) == 3
            and all(r > 0 for r in ratios)
            and at_4["median"][key] == round(statistics.median(ratios), 3)
        )
    assert at_4["null_range"]["null"] == [min(at_4["ratios"]["null"]), max(at_4["ratios"]["null"])]
    for x, y, r in zip(at_4["decode_tok_s"]["raw_again"], at_4["decode_tok_s"]["raw"], at_4["ratios"]["null"]):
        assert ratio_of_rounded(x, y, r, 0.1)
    paired = report["targets"]["host_vs_raw_batch_at_4_paired"]
    assert paired["value"] == at_4["median"]["host_vs_raw"]
    assert paired["met"] == (paired["value"] >= at_4["null_range"]["null"][0])
    # At one session the ratios are the medians of interleaved pairs of longer runs, each round with
    # a null pair (the batched host twice) between the two real ones.
    pairs = report["at_1_pairs"]
    assert (pairs["tokens"], pairs["pairs"]) == (12, 3)
    forward = "stream_generate, batched, batched_again, serialized"
    backward = "serialized, batched_again, batched, stream_generate"
    assert pairs["order"] == [forward, backward, forward]
    real = {
        "host_vs_stream_generate",
        "host_vs_stream_generate_decode_cpu",
        "batched_vs_serialized",
        "batched_vs_serialized_cpu",
    }
    nulls = {"null", "null_decode_cpu", "null_cpu"}
    assert set(pairs["ratios"]) == set(pairs["median"]) == set(pairs["best"]) == real | nulls
    assert pairs["null_of"] == {
        "host_vs_stream_generate": "null", "host_vs_stream_generate_decode_cpu": "null_decode_cpu",
        "batched_vs_serialized": "null", "batched_vs_serialized_cpu": "null_cpu",
    }  # fmt: skip
    for key, ratios in pairs["ratios"].items():
        assert len(ratios) == 3 and all(isinstance(r, float) and r > 0 for r in ratios)
        assert pairs["median"][key] == round(statistics.median(ratios), 3)
        assert isinstance(pairs["best"][key], float) and pairs["best"][key] > 0
    assert set(pairs["null_median"]) == set(pairs["null_range"]) == set(pairs["null_iqr"]) == nulls
    for key in nulls:
        ratios = sorted(pairs["ratios"][key])
        assert pairs["null_median"][key] == pairs["median"][key] == ratios[1]
        assert pairs["null_range"][key] == [ratios[0], ratios[2]]
        # numpy's linear quartiles of three values: halfway between neighbours
        quartiles = [(ratios[0] + ratios[1]) / 2, (ratios[1] + ratios[2]) / 2]
        assert pairs["null_iqr"][key] == pytest.approx(quartiles, abs=0.0011)  # of the unrounded ratios
    for unit in ("decode_tok_s", "cpu_ms_per_token", "decode_cpu_ms_per_token"):
        assert set(pairs[unit]) == {"stream_generate", "batched", "batched_again", "serialized"}
        assert all(len(v) == 3 for v in pairs[unit].values())
    # Each ratio is between neighbours of a round: batched next to stream_generate, batched_again
    # next to serialized and to batched.
    rates = pairs["decode_tok_s"]  # rounded to 0.1 tok/s
    for key, a, b in (
        ("host_vs_stream_generate", "batched", "stream_generate"),
        ("batched_vs_serialized", "batched_again", "serialized"),
        ("null", "batched_again", "batched"),
    ):
        for x, y, r in zip(rates[a], rates[b], pairs["ratios"][key]):
            assert ratio_of_rounded(x, y, r, 0.1)
        assert ratio_of_rounded(max(rates[a]), max(rates[b]), pairs["best"][key], 0.1)
    cpu = pairs["cpu_ms_per_token"]
    for x, y, r in zip(cpu["batched"], cpu["batched_again"], pairs["ratios"]["null_cpu"]):
        assert ratio_of_rounded(x, y, r, 0.001)
    assert ratio_of_rounded(min(cpu["batched"]), min(cpu["batched_again"]), pairs["best"]["null_cpu"], 0.001)
    assert report["ratio_host_vs_stream_generate_at_1"] == pairs["median"]["host_vs_stream_generate"]
    assert (
        report["ratio_host_vs_stream_generate_at_1_decode_cpu"] == pairs["median"]["host_vs_stream_generate_decode_cpu"]
    )
    assert report["ratio_batched_vs_serialized"]["1"] == pairs["median"]["batched_vs_serialized"]
    assert report["ratio_batched_vs_serialized_cpu"]["1"] == pairs["median"]["batched_vs_serialized_cpu"]
    assert report["targets"]["batched_vs_serialized_at_1"]["value"] == pairs["median"]["batched_vs_serialized"]


@pytest.mark.slow
def test_kv_pressure_benchmark_json() -> None:
    report = run_benchmark("kv_pressure.py", "--sessions", "4", "--turns", "2")

    assert KV_KEYS <= report.keys()
    assert report["benchmark"] == "kv_pressure" and report["forced"] is True and report["share_prefix"] is True
    assert report["sessions"] == 4 and report["turns"] == 2
    rows = report["budgets"]
    assert [r["label"] for r in rows] == ["unbounded", "50%", "25%"]
    for row in rows:
        assert KV_ROW_KEYS <= row.keys()
    unbounded, half, quarter = rows
    assert unbounded["budget_bytes"] is None and unbounded["completed"] is True
    assert unbounded["evictions"] == 0 and unbounded["spills"] == 0
    assert unbounded["peak_kv_bytes"] == report["working_set_bytes"] > 0
    assert unbounded["held_reuse_rate"] == 1.0  # every later turn reuses all the session held
    # A share of the working set (the scout's prompt held once for the four), at least one whole conversation.
    least = report["least_budget_bytes"]
    assert 0 < least < report["working_set_bytes"]
    assert half["budget_bytes"] == max(report["working_set_bytes"] // 2, least)
    assert quarter["budget_bytes"] == max(report["working_set_bytes"] // 4, least)
    assert half["completed"] is True and half["evictions"] > 0
    assert quarter["completed"] is True and quarter["spills"] > 0 and quarter["restores"] > 0
    assert report["all_within_budget"] is True
    assert all(r["within_budget"] and r["peak_kv_bytes"] <= r["budget_bytes"] for r in (half, quarter))
    assert all(r["identical_outputs"] is True for r in rows)


def test_steady_tokens_count_the_host_pieces_by_their_text() -> None:
    """The host streams a piece of text per wake-up, not a token: the tokens a session had before
    every session began are its share of the text by then (serialized: all or nothing)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import throughput

    stamps, ids = [[1.0, 2.0], [5.0, 6.0]], [tuple(range(10)), tuple(range(10))]
    host = throughput.make_run(0.0, 10.0, (0.0, 0.0, 0.0), stamps, ids, [10, 10], [0, 0], sizes=[[3, 7], [5, 5]])
    assert (host.steady_tokens, host.steady_s) == (0 + 5, 5.0)
    per_token = throughput.make_run(0.0, 10.0, (0.0, 0.0, 0.0), stamps, ids, [10, 10], [0, 0])
    assert per_token.steady_tokens == (10 - 2) + (10 - 1)
