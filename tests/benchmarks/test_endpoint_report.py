"""The endpoint benchmark's verdicts: the issue's targets as filed, and the TTFT targets restated against a
server that caches by content too, each computed from the measured rows (the runs themselves are minutes
of two servers: docs/benchmarks.md has their figures)."""

from __future__ import annotations

import sys
from typing import Any

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import endpoint


def report(ratios: dict[int, float], restart: tuple[float, float] | None) -> dict[str, Any]:
    rows = [{"k": k, "ttft_later_ratio": ratio} for k, ratio in ratios.items()]
    ends = (
        {}
        if restart is None
        else {"subagent": {"ttft_restart_s": restart[0]}, "mlx_lm": {"ttft_restart_s": restart[1]}}
    )
    return {"rows": rows, "restart": ends}


def test_the_restated_targets_are_parity_at_one_client_0_7x_at_four_and_0_3x_after_a_restart() -> None:
    assert endpoint.restated_targets(report({1: 1.0, 4: 0.7}, (3.0, 10.0))) == {
        "ttft_later_at_1_at_most_1.0x": True,
        "ttft_later_at_4_at_most_0.7x": True,
        "ttft_restart_at_most_0.3x": True,
    }
    assert endpoint.restated_targets(report({1: 1.27, 4: 0.71}, (3.1, 10.0))) == {
        "ttft_later_at_1_at_most_1.0x": False,
        "ttft_later_at_4_at_most_0.7x": False,
        "ttft_restart_at_most_0.3x": False,
    }


def test_a_case_not_run_is_neither_met_nor_missed() -> None:
    assert endpoint.restated_targets(report({4: 0.46}, None)) == {
        "ttft_later_at_1_at_most_1.0x": None,
        "ttft_later_at_4_at_most_0.7x": True,
        "ttft_restart_at_most_0.3x": None,
    }
