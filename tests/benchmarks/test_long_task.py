"""An agent run as an MCP task outlives the call budget (issue 65): `benchmarks/long_task.py` in small.

The server's call budget is 1 s and the agent works 3 s (three real `bash` calls of `sleep 1`): the task
still ends `completed` with the call's whole result, while a plain call on the same server, made
meanwhile, answers at the budget that the agent has not finished."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import long_task

pytestmark = [pytest.mark.slow, pytest.mark.process]


def test_a_task_outlives_a_call_budget_far_shorter_than_its_run(capsys: Any) -> None:
    code = long_task.main(["--duration", "3", "--step", "1", "--call-budget", "1", "--json"])
    printed = capsys.readouterr().out
    report = json.loads(printed.strip().splitlines()[-1])
    assert code == 0, printed
    assert (report["status"], report["completed"], report["steps_done"]) == ("completed", True, 3)
    assert report["elapsed_s"] >= 3 > report["call_budget_s"] == 1
    assert report["handle_s"] < report["elapsed_s"]  # the handle came before the work was done
    assert "It has not finished (waited 1 s, this server's call budget: call again)" in report["budget_probe"]
    assert report["answer"] == "Parallel: 1/1 tasks completed"
    assert "### [worker] completed\nWorked through all 3 steps of 1 s.\n" in printed
    assert "worker: completed in " in printed and ", 4 turns, " in printed
