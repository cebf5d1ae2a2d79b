"""What each task is doing now, read from its events: the one state behind the live status lines of
the commands (`cli/live.py`) and the snapshots `subagent watch` reads (`runs/published.py`).

`LiveTasks` is an event sink; each task it has seen is a `TaskNow`: its activity (queued, waiting for
the writer lease, waiting for the model, prefilling, decoding, running a tool, ended), its turn,
tokens, rate, KV bytes and the text its reply has streamed so far, and `describe()` says the activity
in the words every view shows ("prefilling 901 tokens", "decoding at 6.1 tok/s", "running bash ...").
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, cast

from ..events import DecodeData, Event, PrefillData, TaskEndData, TextData, ToolCallData, UsageData, WaitingData
from ..render import CHILD, end_status

Activity = Literal[
    "queued",
    "waiting",
    "starting",
    "model",
    "prefilling",
    "decoding",
    "tool",
    "working",
    "done",
    "failed",
    "skipped",
    "aborted",
]
ENDED: tuple[Activity, ...] = ("done", "failed", "skipped", "aborted")
# The streamed text a task keeps for its live line: the end of the current reply.
MAX_TEXT_CHARS = 4000


@dataclass
class TaskNow:
    """One task as its events left it; times are `time.time()` seconds."""

    label: str
    agent: str
    activity: Activity = "queued"
    waiting_for: str = ""  # while `waiting`: a slot, the writer lease
    turn: int = 0
    prefill_tokens: int = 0
    cached: int = 0
    reply_tokens: int = 0  # generated so far by the reply decoding now
    tps: float = 0.0  # the reply decoding now, else the last one's
    tool: str = ""  # the call running now: its description (`bash pytest -q`)
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    kv_bytes: int = 0
    started: float | None = None
    ended: float | None = None
    text: str = ""  # what the current reply has streamed (its end, at most MAX_TEXT_CHARS)

    @property
    def parent(self) -> str | None:
        """The parent's label (`a > b` is `a`'s child), None for a top-level task."""
        head, sep, _ = self.label.rpartition(CHILD)
        return head if sep else None

    @property
    def depth(self) -> int:
        return self.label.count(CHILD)

    @property
    def alive(self) -> bool:
        return self.activity not in ENDED

    @property
    def tokens(self) -> int:
        """Tokens generated so far in the whole task, the reply decoding now included."""
        return self.output_tokens + (self.reply_tokens if self.activity == "decoding" else 0)

    def elapsed(self, now: float | None = None) -> float:
        if self.started is None:
            return 0.0
        end = self.ended if self.ended is not None else (now or time.time())
        return max(0.0, end - self.started)

    def describe(self) -> str:
        """The activity in a view's words."""
        if self.activity == "waiting":
            return f"waiting for {self.waiting_for or 'the writer lease'}"
        if self.activity == "model":
            return "waiting for the model"
        if self.activity == "prefilling":
            cached = f" ({self.cached:,} cached)" if self.cached else ""
            return f"prefilling {self.prefill_tokens:,} tokens{cached}"
        if self.activity == "decoding":
            return f"decoding at {self.tps:.1f} tok/s" if self.tps else "decoding"
        if self.activity == "tool":
            return f"running {self.tool}"
        return self.activity

    def last_line(self) -> str:
        """The last line of what the current reply has streamed, for a one-line view."""
        lines = [line for line in self.text.strip().splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""


@dataclass
class LiveTasks:
    """Every task's `TaskNow`, kept from the events it is given (pass `handle` as an event sink).

    Args:
        planned: `(label, agent)` of the tasks a multi-task command will run, shown queued until they start.
    """

    planned: Sequence[tuple[str, str]] = ()
    tasks: dict[str, TaskNow] = field(default_factory=dict)
    changed: float = 0.0  # when an event last changed a task

    def __post_init__(self) -> None:
        for label, agent in self.planned:
            self.tasks[label] = TaskNow(label, agent)

    def handle(self, event: Event) -> None:
        if not event.label:  # a warning of the run itself, no task's
            return
        task = self.tasks.get(event.label)
        if task is None:
            task = self.tasks[event.label] = TaskNow(event.label, event.agent)
        _update(task, event, time.time())
        self.changed = time.time()

    def ordered(self) -> Iterator[TaskNow]:
        """The tasks in their planned (or first-seen) order, each one's sub-agents right after it."""
        children: dict[str | None, list[TaskNow]] = {}
        for task in self.tasks.values():
            parent = task.parent if task.parent in self.tasks else None
            children.setdefault(parent, []).append(task)

        def walk(parent: str | None) -> Iterator[TaskNow]:
            for task in children.get(parent, []):
                yield task
                yield from walk(task.label)

        return walk(None)

    def alive(self) -> list[TaskNow]:
        return [task for task in self.ordered() if task.alive]

    def running_trees(self) -> list[TaskNow]:
        """The tasks of every top-level task that has not ended: it and all its sub-agents, ended or not."""
        roots = {task.label for task in self.tasks.values() if task.parent is None and task.alive}
        return [task for task in self.ordered() if task.label.split(CHILD, 1)[0] in roots]


def _update(task: TaskNow, event: Event, now: float) -> None:
    kind = event.kind
    if kind == "waiting":
        task.activity, task.waiting_for = "waiting", cast(WaitingData, event.data).get("waiting_for", "")
    elif kind == "task_start":
        task.activity, task.started, task.ended = "starting", now, None
    elif kind == "turn_start":
        task.activity, task.turn, task.text, task.reply_tokens = "model", event.turn, "", 0
    elif kind == "prefill":
        prefill = cast(PrefillData, event.data)
        task.activity, task.prefill_tokens, task.cached = "prefilling", prefill["tokens"], prefill["cached"]
    elif kind == "decode":
        decode = cast(DecodeData, event.data)
        task.activity, task.reply_tokens = "decoding", decode["tokens"]
        task.tps = decode["tps"] or task.tps
    elif kind == "text":
        task.text = (task.text + cast(TextData, event.data)["text"])[-MAX_TEXT_CHARS:]
    elif kind == "usage":
        usage = cast(UsageData, event.data)
        task.input_tokens, task.output_tokens = usage["input_tokens"], usage["output_tokens"]
        task.cached_tokens, task.kv_bytes = usage["cached_tokens"], usage["kv_bytes"]
        task.tps, task.reply_tokens = usage["tps"] or task.tps, 0
        if task.activity == "decoding":
            task.activity = "working"  # between the reply and what it leads to (a call, the answer)
    elif kind == "tool_call":
        task.activity, task.tool = "tool", cast(ToolCallData, event.data)["description"]
    elif kind == "tool_result":
        task.activity, task.tool = "working", ""
    elif kind == "task_end":
        end = cast(TaskEndData, event.data)
        task.activity, task.ended, task.tool = cast(Activity, end_status(end)), now, ""
        if "usage" in end:
            task.kv_bytes = end["usage"]["kv_bytes"]
