"""Smoke test: the notices benchmark (`benchmarks/notices.py`) runs its three flows side by side on the
scripted host and reports what a parent pays in each: its turns, prompt tokens and notices."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import notices

pytestmark = pytest.mark.slow


def test_one_notice_costs_the_parent_three_turns_where_a_notice_per_end_costs_one_per_child(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert notices.main(["--json", "--scouts", "2", "--gap", "0.5"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    rows = {row["flow"]: row for row in report["flows"]}
    assert list(rows) == ["one notice", "each", "each, read"]
    # the call, the answer while they work, then per notice: an answer (each), or a read and an answer
    assert [(r["turns"], r["notices"]) for r in rows.values()] == [(3, 1), (4, 2), (6, 2)]
    assert rows["one notice"]["input_tokens"] < rows["each"]["input_tokens"] < rows["each, read"]["input_tokens"]
    ratios = report["ratios_to_one_notice"]
    assert ratios["each"]["turns"] == round(4 / 3, 2) and ratios["each, read"]["turns"] == 2.0
    expected = round(rows["each, read"]["input_tokens"] / rows["one notice"]["input_tokens"], 2)
    assert ratios["each, read"]["input_tokens"] == expected
    assert report["met"] is True


def test_the_table_names_every_flow_and_the_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert notices.main(["--scouts", "1", "--gap", "0.2"]) == 0
    table = capsys.readouterr().out
    assert "A parent and 1 background scouts ending 0.2 s apart (scripted host)" in table
    for line in (
        "  one notice       3",
        "  each             3",
        "  each, read       4",
        "one notice in 3 parent turns: met",
    ):
        assert line in table
