"""Smoke test: the prefix-reuse benchmark runs end to end on a tiny model and reports sanely."""

from __future__ import annotations

import pytest

from tests.benchmarks.test_benchmarks_batching import run_benchmark

pytestmark = pytest.mark.slow

REPORT_KEYS = {
    "arch", "model", "turns", "forced",
    "prompt_tokens_total", "prefill_tokens_with_reuse", "prefill_tokens_without_reuse",
    "cached_tokens_with_reuse", "generated_tokens_total", "prefill_ratio",
    "seconds_with_reuse", "seconds_without_reuse", "speedup",
    "identical_outputs", "target_prefill_ratio", "target_met", "per_turn",
}  # fmt: skip
PER_TURN_KEYS = {
    "reply", "prompt_tokens", "prompt_tokens_without_reuse", "cached_tokens_with_reuse",
    "prefill_tokens_with_reuse", "prefill_tokens_without_reuse", "generated_tokens",
    "seconds_with_reuse", "seconds_without_reuse", "identical_output",
}  # fmt: skip


def test_prefix_reuse_benchmark_json() -> None:
    report = run_benchmark("prefix_reuse.py", "--turns", "3")

    assert REPORT_KEYS <= report.keys()
    assert PER_TURN_KEYS <= report["per_turn"].keys()
    turns = report["per_turn"]
    assert report["turns"] == 3 and all(len(values) == 3 for values in turns.values())
    assert report["arch"] == "qwen3" and report["forced"] is True
    assert turns["reply"] == ["grep", "read", "answer"]

    assert report["identical_outputs"] is True
    assert report["prefill_tokens_with_reuse"] < report["prefill_tokens_without_reuse"]
    assert report["prompt_tokens_total"] == sum(turns["prompt_tokens"])
    assert report["prefill_tokens_without_reuse"] == report["prompt_tokens_total"]
    assert report["prefill_tokens_with_reuse"] + report["cached_tokens_with_reuse"] == report["prompt_tokens_total"]
    assert turns["cached_tokens_with_reuse"][0] == 0  # the warm-up lends the timed session nothing


def test_tool_calls_benchmark_turns_a_random_models_started_calls_into_valid_ones() -> None:
    report = run_benchmark("tool_calls.py", "--max-tokens", "24")
    assert report["requests"] == 24 and report["forced"] is True
    assert report["started_call_rate_off"] == report["started_call_rate_on"] == 1.0
    assert report["valid_call_rate_off"] == 0.0  # noise after the marker: no call parses
    assert report["valid_call_rate_on"] == report["parsed_call_rate_on"] == 1.0
    assert report["target_met"] is True and report["decode_ratio_on_vs_off"] > 0


def test_throughput_grammar_pair_reports_the_ratio_at_1_and_4_sessions() -> None:
    report = run_benchmark("throughput.py", "--grammar-pair", "--tokens", "8", "--repeats", "1")
    assert set(report["results"]) == {"1", "4"}
    assert {k for k in report if k.startswith("grammar_")} == {
        f"grammar_{kind}_{n}" for kind in ("decode_ratio", "cpu_ratio", "paired", "null", "null_range") for n in (1, 4)
    }
    arms = ("off", "on", "again")
    assert [report["results"][n][a]["generated_tokens"] for n in ("1", "4") for a in arms] == [8] * 3 + [32] * 3
    assert report["identical_outputs"] is True
    for n in (1, 4):  # one round: the null's range is its one ratio, the median too
        low, high = report[f"grammar_null_range_{n}"]
        assert low == high == report[f"grammar_null_{n}"] > 0 and report[f"grammar_paired_{n}"] > 0


def test_interference_benchmark_reports_both_modes_side_by_side() -> None:
    report = run_benchmark(
        "interference.py", "--contexts", "600", "40", "--before", "40", "--warm", "8", "--reply", "3",
        "--repeats", "1", "--max-decode", "1500",
    )  # fmt: skip
    assert report["benchmark"] == "interference" and report["slice"] == "auto" and report["decoders"] == 3
    assert set(report["results"]) == {"off", "on"}
    for row in report["results"].values():
        for part in ("long", "short"):  # the ratio is of the unrounded seconds
            ratio = row[f"{part}_ttft_ratio"]
            assert abs(ratio * row[f"{part}_alone_s"] - row[f"{part}_ttft_s"]) <= 0.0005 * (1 + ratio) + 1e-9
        assert row["decode_retention"] >= 0 and row["wall_s"] > 0 and len(row["runs"]) == 1
        assert 0 <= row["depth_matched_retention"] == row["runs"][0]["depth_matched_retention"]
    assert report["prompt_tokens"][0] > 600 and report["prompt_tokens"][1] < report["prompt_tokens"][0] // 4
    assert report["identical_outputs"] is True and report["targets"]["identical_outputs"]["met"] is True
    assert set(report["targets"]) == {"decode_retention", "long_ttft_ratio", "short_ttft_ratio", "identical_outputs"}


def test_speculative_benchmark_reports_each_workload_both_ways_with_the_same_tokens() -> None:
    report = run_benchmark("speculative.py", "--tokens", "12", "--repeats", "1")
    assert report["sessions"] == 1 and set(report["workloads"]) == {"edit", "rewrite", "summary", "random"}
    for row in report["workloads"].values():
        assert row["identical"] and row["reply_tokens"] > 0 and row["tokens_per_forward"] >= 1.0
        assert row["accepted"] <= row["drafted"] and row["decode_tps_off"] > 0 and row["decode_tps_on"] > 0
    batched = report["batched"]  # four sessions in the host's batch, drafts off and on
    assert batched["identical"] and set(batched["sessions"]) == set(report["workloads"])
    assert batched["decode_tps_off"] > 0 and batched["decode_tps_on"] > 0
    assert all(s["accepted"] <= s["drafted"] and s["tokens_per_forward"] >= 1.0 for s in batched["sessions"].values())
