"""Scripted replies for every task (one `scripted:` file each), so the harness itself can be proven
without a model: `right` answers each question with its expected lines and undoes each bug with the
edit tool; `wrong` names a file that is not the answer and leaves each bug in place."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml

from .tasks import EvalTask, ScoutTask

ReplyKind = Literal["right", "wrong"]


def task_replies(task: EvalTask, kind: ReplyKind) -> list[Any]:
    """The replies a scripted model gives for `task`, as the scripted host reads them."""
    if isinstance(task, ScoutTask):
        path, (first, last) = task.expect.path, task.expect.lines
        if kind == "wrong":
            path, first, last = "setup.py", 1, 3
        read = {"name": "read", "arguments": {"path": path, "offset": first, "limit": last - first + 1}}
        answer = f"Findings:\n- {path}:{first}-{last} — {task.expect.contains}\n\nSummary: it is in {path}."
        return [{"tool_calls": [read]}, answer]
    bug = task.bug
    read = {"name": "read", "arguments": {"path": bug.path}}
    if kind == "wrong":
        return [{"tool_calls": [read]}, "I could not find the bug."]
    edit = {"name": "edit", "arguments": {"path": bug.path, "old_text": bug.replace, "new_text": bug.find}}
    return [{"tool_calls": [read]}, {"tool_calls": [edit]}, f"Fixed {bug.path}."]


def write_replies(tasks: list[EvalTask], folder: Path, kind: ReplyKind) -> Path:
    """`folder/<task id>.yaml` for every task; run with `--model scripted:<folder>`."""
    folder.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        (folder / f"{task.id}.yaml").write_text(yaml.safe_dump({"replies": task_replies(task, kind)}, sort_keys=False))
    return folder
