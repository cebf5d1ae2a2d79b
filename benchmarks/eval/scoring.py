"""Right or wrong, and why: a scout's `Findings:` lines against the expected lines, a worker's copy
against its test and the untouched rest of the source."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .source import changed_files
from .tasks import Expect, TestRun, WorkerTask, run_test

# A findings line as the built-in scout writes it: `- path/to/file.py:12-40 — what is there`
# (backticks and a single line number `:12` allowed).
FINDING = re.compile(r"^\s*[-*]\s*`?(?P<path>[^\s:`]+):(?P<start>\d+)(?:\s*-\s*(?P<end>\d+))?")
# More findings than this is a scattershot, not an answer.
MAX_FINDINGS = 5
# A finding wider than this many lines (or twice the expected range, if larger) points at nothing.
MAX_SPAN = 200


@dataclass(frozen=True)
class Finding:
    path: str
    start: int
    end: int


@dataclass(frozen=True)
class Verdict:
    ok: bool
    why: str


def parse_findings(text: str) -> list[Finding]:
    """The `path:start-end` lines after `Findings:` (until a blank line ends the list)."""
    _, found, rest = text.partition("Findings:")
    if not found:
        return []
    findings = []
    for line in rest.splitlines():
        if match := FINDING.match(line):
            start = int(match["start"])
            end = int(match["end"] or start)
            findings.append(Finding(normalise(match["path"]), min(start, end), max(start, end)))
        elif findings and not line.strip():
            break
    return findings


def normalise(path: str) -> str:
    """`./a/b.py` and `a/b.py` are the same file."""
    while path.startswith("./"):
        path = path[2:]
    return path


def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether two inclusive line ranges share a line."""
    return a[0] <= b[1] and b[0] <= a[1]


def score_scout(output: str, expect: Expect) -> Verdict:
    """Right when one of at most `MAX_FINDINGS` findings names the expected file with lines
    overlapping the expected range and no wider than `MAX_SPAN` (or twice the range)."""
    findings = parse_findings(output)
    want = f"{expect.path}:{expect.lines[0]}-{expect.lines[1]}"
    if not findings:
        return Verdict(False, f"no findings lines (expected {want})")
    if len(findings) > MAX_FINDINGS:
        return Verdict(False, f"{len(findings)} findings, more than {MAX_FINDINGS}")
    span = max(MAX_SPAN, 2 * (expect.lines[1] - expect.lines[0] + 1))
    in_file = [f for f in findings if f.path == expect.path]
    if not in_file:
        return Verdict(False, f"wrong file: {', '.join(sorted({f.path for f in findings}))} (expected {want})")
    for f in in_file:
        if overlaps((f.start, f.end), expect.lines) and f.end - f.start + 1 <= span:
            return Verdict(True, f"{f.path}:{f.start}-{f.end} overlaps {want}")
    got = ", ".join(f"{f.start}-{f.end}" for f in in_file)
    if any(overlaps((f.start, f.end), expect.lines) for f in in_file):
        return Verdict(False, f"lines {got} too wide (over {span} lines) for {want}")
    return Verdict(False, f"right file, lines {got} miss {want}")


def score_worker(task: WorkerTask, tree: Path, reference: Path) -> tuple[Verdict, TestRun]:
    """Right when the task's test passes in the copy and no file but the bugged one differs from
    the pinned source."""
    run = run_test(tree, task.test)
    others = [p for p in changed_files(reference, tree) if p != task.bug.path]
    if not run.ok:
        lines = run.output.strip().splitlines() or ["no output"]
        errors = [line[1:].strip() for line in lines if line.startswith("E ")]
        # the exception line of the traceback says most (`AssertionError: 9 != 5`)
        said = next((e for e in errors if "Error" in e), errors[0] if errors else lines[-1])
        return Verdict(False, f"test fails: {said}"), run
    if others:
        return Verdict(False, f"other file changed: {', '.join(others)}"), run
    return Verdict(True, f"{task.test}: {run.passed} passed, no other file changed"), run
