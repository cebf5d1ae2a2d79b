"""The agent eval harness (`benchmarks/agent_eval.py`): scoring, the task file checked on the real
pinned sdist, and whole runs through the real runner with scripted replies."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import agent_eval
from eval.replies import task_replies, write_replies
from eval.scoring import Finding, overlaps, parse_findings, score_scout
from eval.source import changed_files, fresh_copy, unpack
from eval.tasks import (
    DEFAULT_TASKS,
    Expect,
    ScoutTask,
    WorkerTask,
    apply_bug,
    check_tasks,
    load_task_file,
)

from mlx_subagents.errors import RequestError

TASKS = load_task_file(DEFAULT_TASKS)
EXPECT = Expect(path="pkg/mod.py", lines=(10, 20), contains="def f")


@pytest.fixture
def source(eval_source: Path) -> Path:
    return eval_source


def task(task_id: str) -> Any:
    return next(t for t in TASKS.tasks if t.id == task_id)


def run_eval(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], replies: Path, *args: str
) -> dict[str, Any]:
    """The harness on the fixture's cached sdist (the cache folder holds the unpacked tree)."""
    cache = str(source.parent)
    code = agent_eval.main(
        ["--model", f"scripted:{replies}", "--cache", cache, "--out", str(tmp_path / "run"), "--json", *args]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out.strip().splitlines()[-1])


def rows(report: dict[str, Any], mode: str = "series") -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in report["modes"][mode]["tasks"]}


# -- scoring ----------------------------------------------------------------------------------------


def test_findings_lines_are_parsed_as_the_scout_writes_them() -> None:
    text = (
        "Looked around.\n\nFindings:\n"
        "- more_itertools/more.py:162-194 — chunked\n"
        "- `./more_itertools/recipes.py:98` — take\n"
        "* tests/test_more.py:60 - 50 — reversed range\n"
        "\nSummary: see more.py:1-2 — not a finding\n"
    )
    assert parse_findings(text) == [
        Finding("more_itertools/more.py", 162, 194),
        Finding("more_itertools/recipes.py", 98, 98),
        Finding("tests/test_more.py", 50, 60),
    ]
    assert parse_findings("Findings: none\n\nSummary: searched for chunked") == []
    assert parse_findings("chunked is in more.py:162") == []


def test_line_ranges_overlap_when_they_share_a_line() -> None:
    assert overlaps((1, 5), (5, 9))
    assert overlaps((12, 12), (10, 20))
    assert not overlaps((1, 4), (5, 9))
    assert not overlaps((21, 30), (10, 20))


@pytest.mark.parametrize(
    ("answer", "ok", "why"),
    [
        ("Findings:\n- pkg/mod.py:15-18 — f", True, "pkg/mod.py:15-18 overlaps pkg/mod.py:10-20"),
        ("Findings:\n- pkg/other.py:15-18 — f", False, "wrong file: pkg/other.py (expected pkg/mod.py:10-20)"),
        ("Findings:\n- pkg/mod.py:21-30 — f", False, "right file, lines 21-30 miss pkg/mod.py:10-20"),
        ("Findings:\n- pkg/mod.py:1-900 — all", False, "lines 1-900 too wide (over 200 lines) for pkg/mod.py:10-20"),
        ("Findings: none\n\nSummary: nothing", False, "no findings lines (expected pkg/mod.py:10-20)"),
        (
            "Findings:\n" + "".join(f"- pkg/mod.py:{n}-{n} — x\n" for n in range(10, 16)),
            False,
            "6 findings, more than 5",
        ),
    ],
)
def test_a_scout_answer_is_scored_with_its_reason(answer: str, ok: bool, why: str) -> None:
    verdict = score_scout(answer, EXPECT)
    assert (verdict.ok, verdict.why) == (ok, why)


# -- the task file ------------------------------------------------------------------------------------


def test_the_task_file_has_enough_of_each_kind() -> None:
    assert TASKS.package.pin == "more-itertools==10.5.0"
    assert sum(isinstance(t, ScoutTask) for t in TASKS.tasks) >= 20
    assert sum(isinstance(t, WorkerTask) for t in TASKS.tasks) >= 5


@pytest.mark.parametrize(
    ("tasks", "message"),
    [
        ([{"id": "a", "kind": "scout", "question": "q", "expect": {"path": "x", "lines": [3, 1], "contains": "y"}}],
         "lines 3-1: the first line must not come after the last"),
        ([{"id": "a", "kind": "scout", "question": "q", "expect": {"path": "x", "lines": [1, 1], "contains": "y"}}] * 2,
         "duplicate task id(s): a; give each task its own id"),
    ],
)  # fmt: skip
def test_a_bad_task_file_is_one_line(tmp_path: Path, tasks: list[dict[str, Any]], message: str) -> None:
    path = tmp_path / "tasks.yaml"
    path.write_text(yaml.safe_dump({"package": TASKS.package.model_dump(), "tasks": tasks}))
    with pytest.raises(RequestError, match="^" + str(path)) as info:
        load_task_file(path)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.process
def test_every_scout_task_and_a_bug_hold_on_the_pinned_source(source: Path) -> None:
    scouts = [t for t in TASKS.tasks if isinstance(t, ScoutTask)]
    assert check_tasks([*scouts, task("w-quantify")], source) == {t.id: None for t in [*scouts, task("w-quantify")]}


@pytest.mark.slow
@pytest.mark.process
def test_the_check_names_tasks_that_do_not_hold(source: Path) -> None:
    chunked, quantify = task("s-chunked"), task("w-quantify")
    shifted = chunked.model_copy(update={"expect": chunked.expect.model_copy(update={"lines": (1, 3)})})
    harmless = quantify.model_copy(update={"bug": quantify.bug.model_copy(update={"replace": "    return sum(map(pred, iterable))  # same\n"})})  # fmt: skip
    absent = quantify.model_copy(update={"id": "absent", "bug": quantify.bug.model_copy(update={"find": "nowhere"})})
    assert check_tasks([shifted, harmless, absent], source) == {
        "s-chunked": "more_itertools/more.py:1-3 does not contain 'def chunked'",
        "w-quantify": "tests/test_recipes.py::QuantifyTests::test_custom_predicate still passes with the bug planted; "
        "the bug does not break it",
        "absent": "bug in more_itertools/recipes.py: its 'find' text occurs 0 times, not once; quote more of the line",
    }


def test_check_tasks_mode_prints_one_line_per_task(source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = agent_eval.main(["--check-tasks", "--cache", str(source.parent), "--only", "s-version", "--only", "s-sieve"])
    assert (code, capsys.readouterr().out) == (
        0,
        "s-sieve: ok\ns-version: ok\n2/2 tasks hold on more-itertools==10.5.0\n",
    )


def test_the_bug_goes_into_a_fresh_copy_every_time(source: Path, tmp_path: Path) -> None:
    bug = task("w-take").bug
    for attempt in range(2):
        copy = fresh_copy(source, tmp_path / "copy")
        assert changed_files(source, copy) == []
        apply_bug(copy, bug)
        assert changed_files(source, copy) == [bug.path], attempt
        (copy / "stray.txt").write_text("left over")
    assert changed_files(source, tmp_path / "copy") == [bug.path, "stray.txt"]
    assert bug.find in (source / bug.path).read_text()  # the cached source itself never changes


# -- whole runs with scripted replies ---------------------------------------------------------------

ONLY = ["--only", "s-chunked", "--only", "s-version", "--only", "w-take"]


@pytest.mark.slow
@pytest.mark.process
def test_right_replies_score_everything_right_in_series_and_in_parallel(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replies = write_replies(TASKS.tasks, tmp_path / "right", "right")
    report = run_eval(source, tmp_path, capsys, replies, *ONLY)

    assert list(report["modes"]) == ["series", "parallel-4"]
    for mode, figures in report["modes"].items():
        assert (figures["accuracy"], figures["worker_success"], figures["right"], figures["total"]) == (1.0, 1.0, 3, 3)
        by_id = rows(report, mode)
        assert by_id["w-take"]["tests_passed"] == 1  # the package's own test really ran
        assert by_id["w-take"]["why"] == "tests/test_recipes.py::TakeTests::test_simple_take: 1 passed, no other file changed"  # fmt: skip
        assert (by_id["s-chunked"]["turns"], by_id["s-chunked"]["tool_calls"]) == (2, 1)
        assert (by_id["w-take"]["turns"], by_id["w-take"]["tool_calls"]) == (3, 2)
        assert all(Path(r["transcript"]).is_file() for r in by_id.values())
        # the worker's copy is kept: fixed, and nothing else touched
        assert changed_files(source, Path(report["out"]) / mode / "w-take") == []
    assert figures["prompt_tokens"] > figures["cached_tokens"] > 0
    assert report["speedup"] > 0
    assert "| s-chunked | scout | right |" in Path(report["report"]).read_text()


@pytest.mark.slow
@pytest.mark.process
def test_wrong_replies_score_nothing_right(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    replies = write_replies(TASKS.tasks, tmp_path / "wrong", "wrong")
    report = run_eval(source, tmp_path, capsys, replies, *ONLY, "--concurrency", "1")

    assert list(report["modes"]) == ["series"]
    figures = report["modes"]["series"]
    assert (figures["accuracy"], figures["worker_success"], figures["right"]) == (0.0, 0.0, 0)
    by_id = rows(report)
    assert by_id["s-chunked"]["why"] == "wrong file: setup.py (expected more_itertools/more.py:162-194)"
    assert by_id["w-take"]["why"] == "test fails: AssertionError: Lists differ: [0, 1, 2, 3, 4, 5] != [0, 1, 2, 3, 4]"
    assert by_id["w-take"]["tests_passed"] == 0


@pytest.mark.slow
@pytest.mark.process
def test_a_worker_that_edits_another_file_fails(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    read_fix, fix, _ = task_replies(task("w-take"), "right")
    read = {"name": "read", "arguments": {"path": "README.rst", "limit": 3}}
    also = {
        "name": "edit",
        "arguments": {"path": "README.rst", "old_text": "More Itertools\n===", "new_text": "Itertools\n==="},
    }
    folder = tmp_path / "other"
    folder.mkdir()
    replies = [read_fix, fix, {"tool_calls": [read]}, {"tool_calls": [also]}, "Fixed."]
    (folder / "w-take.yaml").write_text(yaml.safe_dump({"replies": replies}))
    report = run_eval(source, tmp_path, capsys, folder, "--only", "w-take", "--concurrency", "1")

    row = rows(report)["w-take"]
    assert (row["ok"], row["why"], row["tests_passed"]) == (False, "other file changed: README.rst", 1)


@pytest.mark.slow
def test_a_task_that_times_out_is_scored_wrong(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "slow"
    folder.mkdir()
    slow = [{"content": "Findings:\n- more_itertools/more.py:162-194 — chunked", "delay": 30}]
    (folder / "s-chunked.yaml").write_text(yaml.safe_dump({"replies": slow}))
    (folder / "s-version.yaml").write_text(yaml.safe_dump({"replies": task_replies(task("s-version"), "right")}))
    report = run_eval(source, tmp_path, capsys, folder, "--only", "s-chunked", "--only", "s-version", "--timeout", "1")

    for mode in ("series", "parallel-4"):
        by_id = rows(report, mode)
        assert (by_id["s-chunked"]["ok"], by_id["s-chunked"]["stop_reason"]) == (False, "timeout")
        assert by_id["s-chunked"]["why"].startswith("stopped: timeout")
        assert by_id["s-version"]["ok"]
        assert report["modes"][mode]["accuracy"] == 0.5


def test_bad_options_are_one_error_line(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--cache", str(source.parent), "--out", str(tmp_path / "run")]
    assert agent_eval.main([*args, "--only", "s-nope", "--model", "scripted:x"]) == 2
    assert capsys.readouterr().err.startswith("error: --only: no task s-nope; the task file has ")
    (tmp_path / "empty").mkdir()
    assert agent_eval.main([*args, "--only", "s-sieve", "--model", f"scripted:{tmp_path / 'empty'}"]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'empty'}: no scripted replies for s-sieve; add <task id>.yaml for each\n"
    )


def test_a_source_archive_unpacks_inside_its_folder_without_tarfiles_filter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Debian 12's Python 3.11.2 has no `filter=` in extractall (3.11.4 added it): every eval test failed
    there on the keyword. Without it, only regular files and folders inside the folder are unpacked."""
    archive = tmp_path / "src.tar"
    with tarfile.open(archive, "w") as tar:
        for name, data in (("pkg-1.0/mod.py", b"def f(): ...\n"), ("../escaped.py", b"x = 1\n")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("pkg-1.0/passwd")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    monkeypatch.delattr(tarfile, "data_filter", raising=False)  # as on 3.11.2
    folder = tmp_path / "out"
    folder.mkdir()
    with tarfile.open(archive) as tar:
        unpack(tar, folder)
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == ["pkg-1.0", "pkg-1.0/mod.py"]
    assert (folder / "pkg-1.0" / "mod.py").read_bytes() == b"def f(): ...\n"
    assert not (tmp_path / "escaped.py").exists()
