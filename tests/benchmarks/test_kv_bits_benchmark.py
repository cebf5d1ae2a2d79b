"""`benchmarks/kv_pressure.py --kv-bits`: each setting under one budget, side by side, in its `--json`."""

from __future__ import annotations

import pytest

from tests.benchmarks.test_benchmarks_batching import run_benchmark

ROW_KEYS = {
    "kv_bits",
    "ran_at_bits",
    "kv_bytes_per_token",
    "sessions_resident",
    "sessions_resident_peak",
    "sessions_resident_end",
    "evictions",
    "spills",
    "drops",
    "reprefilled_tokens",
    "decode_tps",
    "agreement",
    "forced_agreement",
    "sessions_resident_ratio",
    "reprefilled_ratio",
    "decode_at_4_ratio",
    "decode_cpu_tps",
    "decode_at_4_cpu_ratio",
}


@pytest.mark.slow
def test_kv_bits_comparison_json() -> None:
    args = ("--sessions", "4", "--turns", "2", "--result-lines", "4", "--decode-tokens", "8", "--decode-repeats", "1")
    report = run_benchmark("kv_pressure.py", "--kv-bits", "16,8", *args)
    assert (report["mode"], report["evict"], report["sessions"], report["forced"]) == ("kv_bits", "drop", 4, True)
    sixteen, eight = report["settings"]
    assert ROW_KEYS <= sixteen.keys() and ROW_KEYS <= eight.keys()
    assert [r["kv_bits"] for r in report["settings"]] == [r["ran_at_bits"] for r in report["settings"]] == [16, 8]
    # the tiny model with 64-wide heads: 2 layers x (keys, values) x 2 heads x 64 fp32 values, or 8-bit in groups
    assert (sixteen["kv_bytes_per_token"], eight["kv_bytes_per_token"]) == (2048, 576)
    # 0.4 of the 16-bit working set (the scout's prompt held once), at least one whole 16-bit conversation
    budget = max(int(report["working_set_bytes"] * 0.4), report["least_budget_bytes"])
    assert sixteen["budget_bytes"] == eight["budget_bytes"] == budget
    assert 0 < sixteen["sessions_resident"] < eight["sessions_resident"] <= 4  # a mean over the run
    assert 1 <= sixteen["sessions_resident_end"] < eight["sessions_resident_end"] == 4  # all four fit at 8 bits
    assert sixteen["sessions_resident_peak"] <= eight["sessions_resident_peak"] == 4
    assert sixteen["drops"] > 0 and sixteen["reprefilled_tokens"] > eight["reprefilled_tokens"]
    assert all(r["completed"] and r["spills"] == 0 for r in report["settings"])  # --evict drop: nothing spilled
    assert sixteen["agreement"] == [1.0] * 4  # the reference against itself
    assert sixteen["forced_agreement"] == [1.0] * 4  # fed its own tokens, it chooses each of them
    assert len(eight["forced_agreement"]) == 4 and all(0 <= a <= 1 for a in eight["forced_agreement"])
    assert report["targets"].keys() == {
        "sessions_resident_8_vs_16",
        "reprefilled_8_vs_16",
        "decode_at_4_8_vs_16",
        "decode_at_4_cpu_8_vs_16",
        "agreement_8",
    }
