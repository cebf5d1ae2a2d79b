"""Transcripts: every run saved under `$MLX_SUBAGENTS_HOME/runs/<run-id>/`, to show and to resume.

A run folder holds `run.json` (mode, cwd, tasks, outcome) and one JSONL file per task. Each line of
a task file is one record with a `type`:

    task       who and what: agent, model, cwd, task text, label (first line)
    event      a session event as it happened (tool calls, tool results, messages, usage)
    follow_up  a `resume` message that started a new generation of the task
    messages   the whole conversation at the end of a generation (what `resume` rebuilds from)
    result     the task's full result at the end of a generation (uncapped answer)

Every record carries `generation` (1 for the first run, +1 per resume). Events are written as they
happen, so a crash still leaves the trail; messages and result are written when a generation ends,
also when it was aborted.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Literal

from pydantic import BaseModel, ValidationError

from .errors import RunNotFoundError
from .events import Event
from .home import make_state_dir, state_home
from .host.protocol import Message
from .results import Mode, RunResult

RUN_FILE = "run.json"
LATEST_ALIASES = ("last", "latest")
RunStatus = Literal["running", "finished", "interrupted"]


def runs_dir(home: Path | None = None) -> Path:
    return (home or state_home()) / "runs"


def new_run_id() -> str:
    """Sortable by time to the millisecond: `20260131-142501-042-3fa9` (date, time, ms, random)."""
    now = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"{stamp}-{int(now * 1000) % 1000:03d}-{secrets.token_hex(2)}"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("._") or "task"


def _dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, default=str)


# --- the run record -------------------------------------------------------------------------------


class TaskEntry(BaseModel):
    """One task of a run as `run.json` lists it; `file` is None for a task that never started."""

    index: int
    label: str
    agent: str
    step_id: str | None = None
    file: str | None = None
    status: str | None = None


class RunRecord(BaseModel):
    """`run.json`: what was run, where, and how it ended."""

    run_id: str
    mode: Mode
    created: str
    cwd: str
    tasks: list[TaskEntry]
    status: RunStatus = "running"
    succeeded: int | None = None
    total: int = 0
    error: str | None = None
    folder: Path | None = None

    def write(self) -> None:
        assert self.folder is not None
        data = self.model_dump(mode="json", exclude={"folder"})
        tmp = self.folder / f".{RUN_FILE}.tmp"
        tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
        tmp.replace(self.folder / RUN_FILE)

    def task(self, key: str | None) -> TaskEntry:
        """The task named by label, step id or 1-based position; the only one when `key` is None."""
        if key is None:
            if len(self.tasks) == 1:
                return self.tasks[0]
            labels = ", ".join(t.label for t in self.tasks)
            raise RunNotFoundError(
                f"run {self.run_id} has {len(self.tasks)} tasks ({labels}); pick one with --task LABEL"
            )
        for entry in self.tasks:
            if key in (entry.label, entry.step_id, str(entry.index + 1)):
                return entry
        labels = ", ".join(t.label for t in self.tasks)
        raise RunNotFoundError(f"run {self.run_id} has no task '{key}'; its tasks are: {labels}")

    def transcript_path(self, entry: TaskEntry) -> Path:
        if entry.file is None or self.folder is None:
            raise RunNotFoundError(f"task '{entry.label}' of run {self.run_id} never started: it has no transcript")
        return self.folder / entry.file


class RunRecorder:
    """Creates a run folder and one `TaskTranscript` per started task."""

    def __init__(self, mode: Mode, cwd: Path, entries: list[TaskEntry], home: Path | None = None) -> None:
        self.run_id = new_run_id()
        folder = make_state_dir(runs_dir(home) / self.run_id, home=home, exist_ok=False)
        self.record = RunRecord(
            run_id=self.run_id,
            mode=mode,
            created=_now(),
            cwd=str(cwd),
            tasks=entries,
            total=len(entries),
            folder=folder,
        )
        self.record.write()

    @property
    def folder(self) -> Path:
        assert self.record.folder is not None
        return self.record.folder

    def transcript(self, index: int) -> TaskTranscript:
        entry = self.record.tasks[index]
        entry.file = f"{index + 1:02d}-{_slug(entry.label)}.jsonl"
        self.record.write()
        return TaskTranscript(self.folder / entry.file)

    def finish(self, results: list[RunResult], *, interrupted: bool, error: str | None) -> None:
        for entry, result in zip(self.record.tasks, results):
            entry.status = result.status
        self.record.status = "interrupted" if interrupted else "finished"
        self.record.succeeded = sum(r.ok for r in results)
        self.record.error = error
        self.record.write()


@dataclass
class TaskTranscript:
    """Appends one task's records; `generation` is 1 for a new task, the next one for a resume."""

    path: Path
    generation: int = 1
    _file: IO[str] | None = field(default=None, repr=False)

    def write(self, record_type: str, /, **data: Any) -> None:
        if self._file is None:
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(_dumps({"type": record_type, "generation": self.generation, "time": _now(), **data}) + "\n")
        self._file.flush()

    def start(self, **meta: Any) -> None:
        self.write("task", **meta)

    def follow_up(self, message: str) -> None:
        self.write("follow_up", message=message)

    def event(self, event: Event) -> None:
        self.write("event", **event.to_json())

    def finish(self, messages: list[Message], result: RunResult) -> None:
        self.write("messages", messages=messages)
        self.write("result", result=result.model_dump(mode="json"))
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# --- reading ---------------------------------------------------------------------------------------


@dataclass
class TaskLog:
    """One task transcript, read back: its first `task` record and the latest conversation."""

    path: Path
    meta: dict[str, Any]
    records: list[dict[str, Any]]

    @property
    def generations(self) -> int:
        return max((r.get("generation", 1) for r in self.records), default=0)

    @property
    def messages(self) -> list[Message] | None:
        found = [r["messages"] for r in self.records if r.get("type") == "messages"]
        return found[-1] if found else None

    @property
    def results(self) -> list[RunResult]:
        return [RunResult.model_validate(r["result"]) for r in self.records if r.get("type") == "result"]


def read_transcript(path: Path) -> TaskLog:
    """Parse a task's JSONL file; a truncated last line (a crash mid-write) is skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise RunNotFoundError(f"{path}: cannot read the transcript ({exc.strerror})") from None
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    meta = next((r for r in records if r.get("type") == "task"), None)
    if meta is None:
        raise RunNotFoundError(f"{path}: not a task transcript (no 'task' record)")
    return TaskLog(path, meta, records)


def load_run(run_id: str, home: Path | None = None) -> RunRecord:
    """The run with this id, a unique prefix of one, or `last` for the newest."""
    folder = _find_run_folder(run_id, runs_dir(home))
    try:
        record = RunRecord.model_validate_json((folder / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValidationError, ValueError) as exc:
        raise RunNotFoundError(f"{folder / RUN_FILE}: unreadable run record ({type(exc).__name__})") from None
    record.folder = folder
    return record


def _find_run_folder(run_id: str, root: Path) -> Path:
    ids = sorted(p.name for p in root.glob("*") if (p / RUN_FILE).is_file()) if root.is_dir() else []
    if run_id in LATEST_ALIASES and ids:
        return root / ids[-1]
    if run_id in ids:
        return root / run_id
    matches = [i for i in ids if i.startswith(run_id)] if run_id else []
    if len(matches) == 1:
        return root / matches[0]
    if matches:
        raise RunNotFoundError(f"run id '{run_id}' is ambiguous: {', '.join(matches[:5])}; give more of it")
    raise RunNotFoundError(f"no saved run '{run_id}' in {root}; `subagent runs` lists the saved runs")


def list_runs(limit: int = 20, home: Path | None = None) -> list[RunRecord]:
    """The newest runs first; unreadable folders are skipped."""
    root = runs_dir(home)
    if not root.is_dir():
        return []
    records = []
    for folder in sorted(root.iterdir(), reverse=True):
        if len(records) >= limit:
            break
        try:
            record = RunRecord.model_validate_json((folder / RUN_FILE).read_text(encoding="utf-8"))
        except (OSError, ValidationError, ValueError):
            continue
        record.folder = folder
        records.append(record)
    return records
