"""Typed events a running session reports, for live progress and `--events`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

EventKind = Literal[
    "waiting", "task_start", "turn_start", "tool_call", "tool_result", "message", "usage", "compaction", "task_end"
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
