"""A session's inbox: messages that reach a running agent at its next turn boundary.

Whoever holds a task (a parent, a chat, an MCP client) may steer it while it runs, and a parent
learns that a background child ended; neither may cut into a tool call or a reply. Both put a
`Delivery` here; the session takes everything pending just before its next model call (after the
tool results of the current turn) as one user message. Nothing is lost: what arrives after the
session's last turn is taken by its owner, which starts a new generation with it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from ..events import EventData, EventKind

DeliveryKind = Literal["task_send", "task_notice", "child_message"]


@dataclass(frozen=True)
class Delivery:
    """One message for the agent.

    Args:
        kind: `task_send` (someone steers the task), `task_notice` (a background call ended) or
            `child_message` (a child said something, `parent_send`).
        key: the task it is about: a notice is dropped if its answer was read before delivery; a
            child's messages are counted by it.
    """

    kind: DeliveryKind
    text: str
    key: str | None = None


async def _nothing_to_wait_for() -> bool:
    return False


async def _nothing_to_drain() -> None:
    return None


@dataclass
class Inbox:
    """Pending deliveries, in arrival order.

    Args:
        settle: called when the agent gives a final answer with nothing pending; waits for something
            worth another turn (a background child ending) and says whether it came. The default
            waits for nothing: the answer ends the generation.
        drain: called when the agent gives a final answer with no turn left: waits until its
            background children have ended (the default waits for nothing).
        report: reports an event as the session's own (its kind and payload), into its transcript and
            to the caller; set by the session that reads this inbox.
    """

    settle: Callable[[], Awaitable[bool]] = _nothing_to_wait_for
    drain: Callable[[], Awaitable[None]] = _nothing_to_drain
    report: Callable[[EventKind, EventData], None] | None = None
    _items: list[Delivery] = field(default_factory=list)

    def put(self, delivery: Delivery) -> None:
        self._items.append(delivery)

    def discard(self, key: str) -> None:
        """Drop the notices about task `key` (its answer was read another way)."""
        self._items = [d for d in self._items if not (d.kind == "task_notice" and d.key == key)]

    def take(self, kind: DeliveryKind | tuple[DeliveryKind, ...] | None = None) -> list[Delivery]:
        """Everything pending (or only some kinds), in order; the inbox keeps the rest."""
        taken = [d for d in self._items if _of(d, kind)]
        self._items = [d for d in self._items if d not in taken]
        return taken

    def count(self, kind: DeliveryKind | None = None, key: str | None = None) -> int:
        """How many deliveries (of one kind, about one task) wait: messages to and from a child are bounded."""
        return sum((kind is None or d.kind == kind) and (key is None or d.key == key) for d in self._items)

    def pending(self, kind: DeliveryKind | tuple[DeliveryKind, ...] | None = None) -> bool:
        return any(_of(d, kind) for d in self._items)


def _of(delivery: Delivery, kind: DeliveryKind | tuple[DeliveryKind, ...] | None) -> bool:
    """Whether `delivery` is of `kind` (one, several, or any: None)."""
    return kind is None or delivery.kind == kind or (isinstance(kind, tuple) and delivery.kind in kind)
