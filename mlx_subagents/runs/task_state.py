"""`TaskState`: where a task is in its life, the one state field of its handle (`task.py`)."""

from __future__ import annotations

import enum


class TaskState(enum.IntEnum):
    """Where a task is in its life; the ended states come last, as in vLLM's `RequestStatus`.

        NEW ──ask, send, a plan──▶ QUEUED ──a slot──▶ RUNNING ──it ends──▶ KEPT ──a message──▶ QUEUED
                                     │                  │                   └──let go──▶ LET_GO
                                     └─cancel──▶ (ends) └──not held──▶ ENDED

    NEW: prepared; no generation asked for yet (a chat before its first message, a reopened task).
    QUEUED: a generation waits for the steps it needs, a slot or the writer lease.
    RUNNING: a generation runs and holds a slot.
    KEPT: ended; its conversation is held, so a message continues it on its own KV cache.
    ENDED: ended; its conversation is not held here (a top-level run, an aborted foreground child).
    LET_GO: ended; its conversation was let go (to make room, or its parent ended).
    """

    NEW = enum.auto()
    QUEUED = enum.auto()
    RUNNING = enum.auto()
    KEPT = enum.auto()
    ENDED = enum.auto()
    LET_GO = enum.auto()

    @property
    def alive(self) -> bool:
        """Queued or running: it counts against its board's cap."""
        return self in (TaskState.QUEUED, TaskState.RUNNING)

    @property
    def is_finished(self) -> bool:
        return self >= TaskState.KEPT
