"""A saved task opened again to take more messages (`resume`, `chat --resume`): its run and entry, its
transcript read back under a hold that keeps a second process from continuing it too, and the task it
is prepared from again (its agent, its model, its workspace, a worktree it works in held).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from ..agents.discovery import AgentCatalog
from ..errors import RunNotFoundError
from ..host.protocol import Message
from ..tools import Workspace
from .tasks import TaskSpec
from .transcripts import RunRecord, TaskEntry, TaskLog, hold_task, load_run, read_transcript
from .worktrees import hold_worktree_of, release_worktree


@dataclass
class SavedTask:
    """A saved task read back to be continued; `holds` (on its transcript, on the worktree it works in)
    are let go when its handle is done."""

    record: RunRecord
    entry: TaskEntry
    log: TaskLog
    messages: list[Message]  # its latest conversation (a fork's with its parent's read through)
    task: TaskSpec  # what it is prepared from again
    workspace: Workspace
    holds: ExitStack


def open_saved(
    run_id: str, key: str | None, *, catalog: AgentCatalog, model: str | None, home: Path | None = None
) -> SavedTask:
    """The saved task `key` of run `run_id`, held and read back; nothing is held when it fails.

    Args:
        run_id: a run id, a unique prefix of one, or `last`.
        key: the task's label, step id or 1-based position, when the run has several.
        model: the model the run's options name (default: the one it ran on, unless that was its engine's).
    """
    record = load_run(run_id, home)
    entry = record.task(key)
    path = record.transcript_path(entry)
    holds = ExitStack()
    holds.enter_context(hold_task(path, entry.label, record.run_id))
    try:
        log = read_transcript(path)
        messages = log.messages
        if messages is None:
            raise RunNotFoundError(f"task '{entry.label}' of run {record.run_id} has no saved conversation to continue")
        spec = catalog.get(log.meta["agent"])
        saved = log.meta["model"]  # on an engine, its model id: the agent's own engine or --engine takes it there
        model = model or (None if saved == spec.engine_model else saved)
        again = TaskSpec(agent=spec.name, task="", label=entry.label, model=model, step_id=entry.step_id)
        if (tree := hold_worktree_of(Path(log.meta["cwd"]))) is not None:  # an isolated task's
            holds.callback(release_worktree, tree)
    except BaseException:
        holds.close()
        raise
    return SavedTask(record, entry, log, messages, again, Workspace(Path(log.meta["cwd"])), holds)
