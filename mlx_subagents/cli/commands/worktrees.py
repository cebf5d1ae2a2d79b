"""`subagent apply` and `worktrees` (and `prune`): what isolated tasks left in their worktrees."""

from __future__ import annotations

from typing import Annotated

import typer

from ..flags import JsonOpt
from ..output import err, out, warn
from . import listing

app = typer.Typer()


@app.command()
def apply(
    ref: Annotated[str, typer.Argument(help="The worktree's name, branch, run id or task label (subagent worktrees).")],
) -> None:
    """Bring an isolated task's changes (its branch) into the workspace it started from.

    Refuses, naming the files, when they conflict or the workspace changed them since.

    Example: subagent apply subagent/20260131-142501-042-3fa9-worker
    """
    from ...runs.worktrees import apply_worktree, find_worktree

    worktree = find_worktree(ref)
    files = apply_worktree(worktree)
    err.print(f"applied {worktree.branch} to {worktree.repo}", markup=False)
    out.print("\n".join(files), markup=False)
    err.print("[dim]remove its worktree and branch with: subagent worktrees prune[/]")


worktrees_app = typer.Typer(help="The worktrees isolated tasks left; prune the merged or abandoned.")
app.add_typer(worktrees_app, name="worktrees")


@listing(worktrees_app)
def worktrees(as_json: JsonOpt = False) -> None:
    """List the kept worktrees of isolated tasks (isolation: worktree), oldest first.

    Example: subagent worktrees --json
    """
    from ...runs.worktrees import list_worktrees
    from ..show import worktree_json, worktree_line

    kept = list_worktrees(warn=warn)
    if as_json:
        out.print_json(data={"worktrees": [worktree_json(w) for w in kept]})
        return
    for w in kept:
        out.print(worktree_line(w), markup=False)
    if not kept:
        err.print("no kept worktrees; tasks with isolation: worktree keep theirs when they change files")


@worktrees_app.command("prune")
def worktrees_prune(as_json: JsonOpt = False) -> None:
    """Remove the worktrees (and branches) that are merged, applied or abandoned; then git worktree prune.

    Example: subagent worktrees prune
    """
    from ...runs.worktrees import prune_worktrees
    from ..show import worktree_json

    removed = prune_worktrees(warn=warn)
    if as_json:
        out.print_json(data={"removed": [worktree_json(w) for w in removed]})
        return
    for w in removed:
        out.print(f"removed {w.name} ({w.branch})", markup=False)
    if not removed:
        err.print("nothing to prune: every kept worktree has changes not yet applied or merged")
