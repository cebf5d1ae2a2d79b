"""Isolation: which tasks run in a worktree of their own (`isolation_of`, checked before anything
starts), the worktrees made as a run's tasks start (`isolate`: all or none), and where none is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..agents.spec import AgentSpec
from ..errors import RequestError
from ..tools import Workspace
from .prepared import PreparedTask
from .tasks import TaskSpec
from .worktrees import Worktree, check_isolation, make_worktree, remove_worktree


def isolation_of(spec: AgentSpec, task: TaskSpec, workspace: Workspace, run: str | None = None) -> str:
    """A task's isolation: the call site's (the task's own, else the run's `--isolation`), else its agent
    file's; `worktree` checked here, so that a request that cannot be isolated is refused whole before
    anything starts."""
    isolation = task.isolation or run or spec.isolation or "none"
    if isolation == "worktree":
        check_isolation(workspace.root)
    return isolation


def isolate(prepared: list[PreparedTask], run_id: str) -> tuple[list[PreparedTask], list[Worktree | None]]:
    """Each isolated task moved into a new worktree of its own (its `cwd` at the same place inside it),
    before its board, tools or lease are made from its workspace; all made or none."""
    moved: list[PreparedTask] = []
    trees: list[Worktree | None] = []
    try:
        for p in prepared:
            tree = None
            if p.isolation == "worktree":
                tree = make_worktree(
                    p.workspace.root, run_id=run_id, label=p.label, agent=p.spec.name, task=p.task.task
                )
                p = replace(p, workspace=Workspace(tree.workspace))
            moved.append(p)
            trees.append(tree)
    except BaseException:
        for made in trees:
            if made is not None:
                remove_worktree(made)
        raise
    return moved, trees


def refuse_isolated(prepared: Sequence[PreparedTask], what: str) -> None:
    """Refuse isolation where it is not built (a chat's multi-turn task), in one line: never a silent run
    in the shared tree."""
    if isolated := [p.label for p in prepared if p.isolation == "worktree"]:
        raise RequestError(
            f"isolation: worktree is not available for {what} ({', '.join(isolated)}); run it with subagent run, "
            "or give it isolation: none to work in the shared tree"
        )
