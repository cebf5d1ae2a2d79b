"""Transcripts: every run saved under `$MLX_SUBAGENTS_HOME/runs/<run-id>/`, to show and to resume.

A run folder holds `run.json` (mode, cwd, tasks, outcome) and one JSONL file per task. Each line of
a task file is one record with a `type`:

    task       who and what: agent, model, cwd, task text, label, the tools its parent withheld (first line)
    event      a session event as it happened (tool calls, tool results, messages, usage)
    task_send  a message sent to the task, as it reached it (its next turn, or a new generation)
    task_notice  a background call of the task ended (its children's ids, status, the answers as it read them)
    child_message  a child of the task sent it a message while it worked (`parent_send`: id, message)
    task_cancel  the task was cancelled by whoever held it (reason)
    follow_up  a `resume` message that started a new generation of the task
    messages   the whole conversation at the end of a generation (what `resume` rebuilds from); a
               fork's holds only what follows its parent's messages (`from_parent`: how many)
    result     the task's full result at the end of a generation (uncapped answer)

Every record carries `generation` (1 for the first run, +1 per resume). Events are written as they
happen, so a crash still leaves the trail; messages and result are written when a generation ends,
also when it was aborted.

Any text round-trips: lone surrogates and the characters other readers take for line breaks
(U+2028, U+2029, U+0085) are written as JSON escapes, and the reader splits on `\n` only. A damaged
file loses only its damaged records: an append after a cut line starts on a fresh line, and a line
that is not a record of the right shape is skipped and listed in `TaskLog.skipped`.

A fork refers to its parent's conversation rather than copying it: its `task` record's `fork_of`
names the parent (label, run id, how many of its messages, their digest), and its `messages` records
hold the rest. Reading one back (`TaskLog.messages`) reads the parent's transcript through: the
parent's run folder holds the fork's (`<parent run>/runs/<fork run>/`). A fork whose own compaction
rewrote those first messages, and a transcript from before references, hold the whole conversation.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO, Literal

from pydantic import BaseModel, ValidationError

from ..errors import DamagedStateError, RunNotFoundError, SubagentError, TaskStateError
from ..events import Event
from ..home import file_name, make_state_dir, state_home
from ..results import Mode, RunResult, chain_stop
from ..userfiles import open_regular, read_text
from .transcript_records import record_problem

if TYPE_CHECKING:
    from ..host.protocol import Message

RUN_FILE = "run.json"
MAX_RUN_RECORD_BYTES = 16 * 2**20  # far more than the task caps allow a run's record to hold
# Events that are records of their own type (the same fields as an `event` record).
NOTE_KINDS = ("task_send", "task_notice", "child_message", "task_cancel")
# Events a transcript does not record: the streamed text is all in the `message` event after it.
UNRECORDED_KINDS = ("text",)
LATEST_ALIASES = ("last", "latest")
RunStatus = Literal["running", "finished", "interrupted"]


def runs_dir(home: Path | None = None) -> Path:
    return (home or state_home()) / "runs"


def new_run_id() -> str:
    """Sortable by time to the millisecond: `20260131-142501-042-3fa9` (date, time, ms, random)."""
    now = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"{stamp}-{int(now * 1000) % 1000:03d}-{secrets.token_hex(2)}"


def _now(timespec: str = "seconds") -> str:
    return datetime.now(timezone.utc).isoformat(timespec=timespec)


def messages_digest(messages: Sequence[Message]) -> str:
    """A short digest of messages as they are saved, which checks that a parent's saved conversation
    still begins with the messages a fork took from it (a compaction may have rewritten them)."""
    return hashlib.sha256(_dumps(list(messages)).encode("utf-8")).hexdigest()[:16]


def _slug(label: str) -> str:
    return file_name(label, "task")


# Lone surrogates cannot be encoded as UTF-8; the line and paragraph separators are line breaks to
# `str.splitlines` and to older readers. As JSON escapes, all of them read back as the same text.
_UNSAFE_CHARS = re.compile("[\ud800-\udfff\u2028\u2029\x85]")


def _dumps(record: Any, *, indent: int | None = None) -> str:
    """JSON text that always encodes as UTF-8 and holds no line break but the ones `indent` adds."""
    text = json.dumps(record, ensure_ascii=False, default=str, indent=indent)
    return _UNSAFE_CHARS.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


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

    @classmethod
    def new(cls, mode: Mode, cwd: Path, entries: list[TaskEntry], home: Path | None = None) -> RunRecord:
        """A new run: its folder under `home`'s runs, and its `run.json` listing its tasks."""
        run_id = new_run_id()
        folder = make_state_dir(runs_dir(home) / run_id, home=home, exist_ok=False)
        record = cls(
            run_id=run_id, mode=mode, created=_now(), cwd=str(cwd), tasks=entries, total=len(entries), folder=folder
        )
        record.write()
        return record

    def write(self) -> None:
        assert self.folder is not None
        data = self.model_dump(mode="json", exclude={"folder"})
        tmp = self.folder / f".{RUN_FILE}.tmp"
        tmp.write_text(_dumps(data, indent=2), encoding="utf-8")
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

    def transcript(self, entry: TaskEntry, generation: int = 1) -> TaskTranscript:
        """The task's transcript, for one of its generations; its file is named here when it has none yet."""
        if entry.file is None:
            entry.file = f"{entry.index + 1:02d}-{_slug(entry.label)}.jsonl"
            self.write()
        return TaskTranscript(self.transcript_path(entry), generation=generation)

    def task_ended(self, entry: TaskEntry, status: str) -> None:
        """A task of this run ended with `status`; once every task has ended the run has too, as the
        last one to end did (a run of several tasks is then finished whole: `finish`)."""
        entry.status = status
        if all(t.status is not None for t in self.tasks):
            self.status = "interrupted" if status == "aborted" else "finished"
            self.succeeded = sum(t.status == "completed" for t in self.tasks)
        self.write()

    def finish(self, results: list[RunResult], *, interrupted: bool) -> None:
        """The whole run ended: each task's status, the run's and, for a chain that stopped, why."""
        for entry, result in zip(self.tasks, results):
            entry.status = result.status
        self.status = "interrupted" if interrupted else "finished"
        self.succeeded = sum(r.ok for r in results)
        self.error = chain_stop(results) if self.mode == "chain" else None
        self.write()

    def transcript_path(self, entry: TaskEntry) -> Path:
        if entry.file is None or self.folder is None:
            raise RunNotFoundError(f"task '{entry.label}' of run {self.run_id} never started: it has no transcript")
        return self.folder / entry.file


@dataclass
class TaskTranscript:
    """Appends one task's records; `generation` is 1 for a new task, the next one for a resume."""

    path: Path
    generation: int = 1
    _file: IO[str] | None = field(default=None, repr=False)

    @property
    def started(self) -> bool:
        """Whether the task record is written (a continued task's file already has it)."""
        return self._file is not None or (self.path.is_file() and self.path.stat().st_size > 0)

    def write(self, record_type: str, /, **data: Any) -> None:
        if self._file is None:
            self._file = self._open()
        self._file.write(
            _dumps({"type": record_type, "generation": self.generation, "time": _now("milliseconds"), **data}) + "\n"
        )
        self._file.flush()

    def _open(self) -> IO[str]:
        """Open for appending; after a line cut short (a crash, a full disk) start a fresh line."""
        file = self.path.open("a+b")
        if file.seek(0, os.SEEK_END) > 0:
            file.seek(-1, os.SEEK_END)
            if file.read(1) != b"\n":
                file.write(b"\n")
        return io.TextIOWrapper(file, encoding="utf-8", newline="\n")

    def start(self, **meta: Any) -> None:
        self.write("task", **meta)

    def follow_up(self, message: str) -> None:
        self.write("follow_up", message=message)

    def event(self, event: Event) -> None:
        if event.kind not in UNRECORDED_KINDS:
            self.write(event.kind if event.kind in NOTE_KINDS else "event", **event.to_json())

    def finish(self, messages: list[Message], result: RunResult) -> None:
        """Save the conversation and the result; a fork's conversation without its parent's messages
        while it still begins with them (`fork_of`), so four forks do not save their parent four times."""
        n = self._from_parent(messages)
        if n:
            self.write("messages", messages=messages[n:], from_parent=n)
        else:
            self.write("messages", messages=messages)
        self.write("result", result=result.model_dump(mode="json"))
        self.close()

    def _from_parent(self, messages: list[Message]) -> int:
        """How many first messages are the parent's, as this fork's `task` record names them (0: none,
        or they were rewritten); read from the file, so a resumed fork knows it too."""
        try:
            with self.path.open("rb") as file:
                first = json.loads(file.readline().decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            return 0
        fork = first.get("fork_of") if isinstance(first, dict) else None
        if not isinstance(fork, dict) or not fork.get("run"):
            return 0
        n = fork.get("messages")
        if not isinstance(n, int) or not 0 < n <= len(messages):
            return 0
        return n if messages_digest(messages[:n]) == fork.get("digest") else 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def hold_task(path: Path, label: str, run_id: str) -> BinaryIO:
    """An exclusive hold on continuing one saved task (`resume`, `chat --resume`), taken before its
    transcript is read; close the file to let go. A second writer is refused in one line rather than
    made to wait: it would continue a conversation the first is still extending (its follow-up lost,
    a generation number used twice). An `flock` on `.FILE.lock`: the OS lets go when the process ends,
    so a killed resume never leaves a stale hold."""
    file = path.with_name(f".{path.name}.lock").open("a+b")
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        file.close()
        raise TaskStateError(
            f"task '{label}' of run {run_id} is being continued elsewhere (another resume or chat); "
            "wait until that ends, then resume it again"
        ) from None
    return file


# --- reading ---------------------------------------------------------------------------------------


@dataclass
class TaskLog:
    """One task transcript, read back: its first `task` record and the latest conversation.

    `skipped` names each line that could not be used (`line 7: not valid JSON`), for `show` to say.
    """

    path: Path
    meta: dict[str, Any]
    records: list[dict[str, Any]]
    skipped: list[str] = field(default_factory=list)
    _parent: list[Message] | None = field(default=None, repr=False)

    @property
    def generations(self) -> int:
        return max((r.get("generation", 1) for r in self.records), default=0)

    @property
    def messages(self) -> list[Message] | None:
        """The latest conversation, a fork's with its parent's messages read through."""
        found = [r for r in self.records if r.get("type") == "messages"]
        if not found:
            return None
        last = found[-1]
        if not last.get("from_parent"):
            return last["messages"]
        return [*self.parent_messages(last["from_parent"]), *last["messages"]]

    def parent_messages(self, n: int) -> list[Message]:
        """The first `n` messages of this fork's parent, from the parent's transcript (whose run folder
        holds this one's); a missing or rewritten parent is one line saying which run it was."""
        if self._parent is None:
            self._parent = _parent_messages(self.path, self.meta.get("fork_of") or {}, n)
        return self._parent

    @property
    def results(self) -> list[RunResult]:
        return [RunResult.model_validate(r["result"]) for r in self.records if r.get("type") == "result"]


def _parent_messages(path: Path, fork: dict[str, Any], n: int) -> list[Message]:
    """A fork's first `n` messages from its parent's transcript: its latest saved conversation that
    still begins with them (their digest), else an earlier one."""
    label, run_id = fork.get("parent"), fork.get("run")
    folder = path.parent.parent.parent  # <parent run>/runs/<this run>/<file>
    where = f"{path}: this fork's first {n} messages are those of task '{label}' of run {run_id}"
    try:
        record = _read_run_record(folder)
        if record.run_id != run_id:
            raise FileNotFoundError
        parent = read_transcript(record.transcript_path(record.task(label)))
    except (OSError, ValidationError, ValueError, RecursionError, SubagentError):
        raise RunNotFoundError(
            f"{where}, and that run's transcript is missing from {folder}; restore that run folder to read this fork"
        ) from None
    saved = [r["messages"] for r in parent.records if r.get("type") == "messages" and not r.get("from_parent")]
    for messages in reversed(saved):
        if len(messages) >= n and messages_digest(messages[:n]) == fork.get("digest"):
            return messages[:n]
    raise RunNotFoundError(
        f"{where}, and its transcript no longer holds them ({parent.path}): compacted or cut short since"
    )


def read_transcript(path: Path) -> TaskLog:
    """Parse a task's JSONL file; a line that is not a well-formed record is skipped and listed."""
    try:  # through the guarded reader: a FIFO or a device in its place never blocks
        with open_regular(path, "transcript", RunNotFoundError, None, text=False) as file:
            data = file.read()
    except OSError as exc:
        raise RunNotFoundError(f"{path}: cannot read the transcript ({exc.strerror})") from None
    records: list[dict[str, Any]] = []
    skipped: list[str] = []
    # Split on \n only: JSON strings may hold characters `str.splitlines` also breaks on.
    for n, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        problem = record_problem(line)
        if isinstance(problem, str):
            skipped.append(f"line {n}: {problem}")
        else:
            records.append(problem)
    meta = next((r for r in records if r["type"] == "task"), None)
    if meta is None:
        raise RunNotFoundError(f"{path}: not a task transcript (no readable 'task' record)")
    return TaskLog(path, meta, records, skipped)


def load_run(run_id: str, home: Path | None = None) -> RunRecord:
    """The run with this id, a unique prefix of one, or `last` for the newest."""
    folder = _find_run_folder(run_id, runs_dir(home))
    try:
        record = _read_run_record(folder)
    except SubagentError as exc:
        raise RunNotFoundError(str(exc)) from None
    except (OSError, ValidationError, ValueError, RecursionError) as exc:
        raise RunNotFoundError(f"{folder / RUN_FILE}: unreadable run record ({type(exc).__name__})") from None
    return record


def _read_run_record(folder: Path) -> RunRecord:
    """`run.json` of a run folder; through `json`, which reads back the lone surrogates `_dumps`
    escapes (a task or folder name with bytes that are not UTF-8), where pydantic's parser stops."""
    text = read_text(folder / RUN_FILE, "run record", DamagedStateError, MAX_RUN_RECORD_BYTES)  # the guarded reader
    record = RunRecord.model_validate(json.loads(text))
    record.folder = folder
    return record


def _find_run_folder(run_id: str, root: Path) -> Path:
    """A top-level run, else a sub-agents' run saved inside one (`<parent>/runs/<id>`); `last` is
    the newest top-level run."""
    ids = sorted(p.name for p in root.glob("*") if (p / RUN_FILE).is_file()) if root.is_dir() else []
    if run_id in LATEST_ALIASES and ids:
        return root / ids[-1]
    if run_id in ids:
        return root / run_id
    matches = [root / i for i in ids if i.startswith(run_id)] if run_id else []
    if not matches and run_id and root.is_dir():
        nested = sorted(p.parent for p in root.glob(f"*/runs/**/{RUN_FILE}"))
        matches = [p for p in nested if p.name == run_id] or [p for p in nested if p.name.startswith(run_id)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        found = ", ".join(p.name for p in matches[:5])
        raise RunNotFoundError(f"run id '{run_id}' is ambiguous: {found}; give more of it")
    raise RunNotFoundError(f"no saved run '{run_id}' in {root}; `subagent runs` lists the saved runs")


def child_runs(record: RunRecord) -> list[RunRecord]:
    """The sub-agents' runs started by a run's tasks, oldest first (unreadable ones skipped)."""
    return list_runs(limit=10_000, home=record.folder)[::-1] if record.folder is not None else []


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
            record = _read_run_record(folder)
        except (SubagentError, OSError, ValidationError, ValueError, RecursionError):
            continue
        records.append(record)
    return records
