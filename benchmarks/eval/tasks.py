"""The eval's task file: scout questions with the lines a right answer names, and worker tasks that
plant a known bug for the package's own test to catch. `check_tasks` proves every expectation on
the pinned source, so a wrong task can never be scored as an agent's mistake."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mlx_subagents.errors import RequestError
from mlx_subagents.userfiles import first_error, load_file

from .source import Package, fresh_copy

DEFAULT_TASKS = Path(__file__).resolve().parent / "tasks.yaml"
DEFAULT_TEST_TIMEOUT = 120.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Expect(_Strict):
    """Where the answer is: a file, an inclusive line range, and text those lines must hold."""

    path: str = Field(min_length=1)
    lines: tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]]
    contains: str = Field(min_length=1)

    @model_validator(mode="after")
    def _ordered(self) -> Expect:
        if self.lines[0] > self.lines[1]:
            raise ValueError(f"lines {self.lines[0]}-{self.lines[1]}: the first line must not come after the last")
        return self


class Bug(_Strict):
    """A planted bug: `find` (the right text, once in `path`) becomes `replace`."""

    path: str = Field(min_length=1)
    find: str = Field(min_length=1)
    replace: str = Field(min_length=1)


class ScoutTask(_Strict):
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    kind: Literal["scout"]
    question: str = Field(min_length=1)
    expect: Expect

    @property
    def agent(self) -> str:
        return "scout"

    def prompt(self) -> str:
        return self.question


class WorkerTask(_Strict):
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    kind: Literal["worker"]
    bug: Bug
    test: str = Field(min_length=1, description="a pytest node id, run from the copy's root")
    symptom: str = Field(min_length=1)

    @property
    def agent(self) -> str:
        return "worker"

    def prompt(self) -> str:
        return (
            f"{self.symptom} Find the bug in the package's source and fix it with the smallest change. "
            f"Do not change the tests or any other file. You can run the test with `python -m pytest -q {self.test}`."
        )


EvalTask = Annotated[Union[ScoutTask, WorkerTask], Field(discriminator="kind")]


class TaskFile(_Strict):
    package: Package
    tasks: list[EvalTask] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_ids(self) -> TaskFile:
        if duplicates := sorted(i for i, n in Counter(t.id for t in self.tasks).items() if n > 1):
            raise ValueError(f"duplicate task id(s): {', '.join(duplicates)}; give each task its own id")
        return self


def load_task_file(path: Path) -> TaskFile:
    """Read and validate a task file; any problem is one `RequestError` line naming the file."""
    data = load_file(Path(path), "yaml", "eval tasks file", RequestError)
    try:
        return TaskFile.model_validate(data)
    except ValidationError as exc:
        raise RequestError(f"{path}: {first_error(exc)}") from None


def select(tasks: list[EvalTask], only: list[str] | None, limit: int | None) -> list[EvalTask]:
    """The tasks named by `--only` (in file order), then the first `--limit` of them."""
    if only:
        known = {t.id for t in tasks}
        if unknown := [i for i in only if i not in known]:
            raise RequestError(f"--only: no task {', '.join(unknown)}; the task file has {', '.join(sorted(known))}")
        tasks = [t for t in tasks if t.id in only]
    return tasks[:limit] if limit else tasks


def apply_bug(tree: Path, bug: Bug) -> None:
    """Plant `bug` in the copy at `tree`; the text must be there exactly once."""
    path = tree / bug.path
    text = path.read_text()
    if (n := text.count(bug.find)) != 1:
        raise RequestError(_not_once(bug, n))
    path.write_text(text.replace(bug.find, bug.replace))


@dataclass(frozen=True)
class TestRun:
    """One run of the package's own test in a copy."""

    passed: int
    failed: int
    returncode: int
    output: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.passed > 0 and self.failed == 0


_COUNT = re.compile(r"(\d+) (passed|failed|error)")


def run_test(tree: Path, test: str, timeout: float = DEFAULT_TEST_TIMEOUT) -> TestRun:
    """`python -m pytest` on one node id from the copy's root (so the copy's package is imported), writing no
    bytecode: a `.pyc` records its source's size and mtime in whole seconds, so an edit of the same length
    within the second of the run before (a planted bug `pred` -> `bool`, or a worker's fix) ran the old code."""
    cmd = [sys.executable, "-B", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header", "-rN", test]
    try:
        proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return TestRun(0, 0, -1, f"the test ran longer than {timeout:g} s")
    output = proc.stdout + proc.stderr
    counts = Counter()
    for n, what in _COUNT.findall(output.strip().splitlines()[-1] if output.strip() else ""):
        counts[what] += int(n)
    return TestRun(counts["passed"], counts["failed"] + counts["error"], proc.returncode, output)


def check_tasks(tasks: list[EvalTask], source: Path) -> dict[str, str | None]:
    """Each task's problem on the pinned source (None when it holds): a scout's lines must exist and
    hold `contains`; a worker's bug must apply once, make its test fail, and the test pass without it."""
    problems: dict[str, str | None] = {}
    with tempfile.TemporaryDirectory(prefix="eval-check-") as tmp:
        for task in tasks:
            if isinstance(task, ScoutTask):
                problems[task.id] = _check_scout(task.expect, source)
            else:
                problems[task.id] = _check_worker(task, source, Path(tmp) / task.id)
    return problems


def _check_scout(expect: Expect, source: Path) -> str | None:
    path = source / expect.path
    if not path.is_file():
        return f"{expect.path} is not a file of the source"
    lines = path.read_text().splitlines()
    first, last = expect.lines
    if last > len(lines):
        return f"{expect.path} has {len(lines)} lines, the task expects lines {first}-{last}"
    if expect.contains not in "\n".join(lines[first - 1 : last]):
        return f"{expect.path}:{first}-{last} does not contain {expect.contains!r}"
    return None


def _check_worker(task: WorkerTask, source: Path, tree: Path) -> str | None:
    if (source / task.bug.path).is_file() and (n := (source / task.bug.path).read_text().count(task.bug.find)) != 1:
        return _not_once(task.bug, n)
    fresh_copy(source, tree)
    clean = run_test(tree, task.test)
    if not clean.ok:
        return f"{task.test} does not pass on the clean source ({_last_line(clean)})"
    try:
        apply_bug(tree, task.bug)
    except (RequestError, OSError) as exc:
        return str(exc)
    broken = run_test(tree, task.test)
    if broken.ok:
        return f"{task.test} still passes with the bug planted; the bug does not break it"
    return None


def _not_once(bug: Bug, n: int) -> str:
    return f"bug in {bug.path}: its 'find' text occurs {n} times, not once; quote more of the line"


def _last_line(run: TestRun) -> str:
    return (run.output.strip().splitlines() or ["no output"])[-1]
