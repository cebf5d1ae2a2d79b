"""Typed events a running session reports, for live progress and `--events`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

# `reasoning`: a delta of a thinking model's reasoning as it is generated (`data["text"]`).
# `task_send`: a message reached a task (`data["message"]`); `task_notice`: a background child of
# the task ended (`data`: id, status, first_line, text); `task_cancel`: a task was cancelled (`data["reason"]`);
# `hook_warning`: a hook failed without blocking, or project hooks were not allowed (`data["message"]`).
EventKind = Literal[
    "waiting",
    "task_start",
    "turn_start",
    "reasoning",
    "tool_call",
    "tool_result",
    "message",
    "usage",
    "compaction",
    "task_end",
    "task_send",
    "task_notice",
    "task_cancel",
    "hook_warning",
]


@dataclass(frozen=True)
class Event:
    """One thing that happened in one task; `data` depends on `kind`."""

    kind: EventKind
    label: str
    agent: str
    turn: int = 0
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


EventSink = Callable[[Event], None]


@dataclass
class Fanout:
    """One sink that passes each event to several; a front end adds its views as it builds them."""

    targets: list[EventSink] = field(default_factory=list)

    def __call__(self, event: Event) -> None:
        for target in self.targets:
            target(event)


def ignore_event(_event: Event) -> None:
    """The default sink."""
