"""`ls`: the entries of one workspace directory."""

from __future__ import annotations

import os

from pydantic import BaseModel, Field

from .base import Tool, cap_lines

MAX_LS_ENTRIES = 500


class LsTool(Tool):
    name = "ls"
    description = "List a directory in the workspace, hidden entries included. Directories end with '/'."
    read_only = True
    writes = False
    by_default = True
    claude_names = ("LS",)

    class Params(BaseModel):
        path: str = Field(default=".", description="Directory to list.")

    def execute(self, params: Params) -> str:
        directory = self.workspace.existing(params.path, "directory")
        with os.scandir(directory) as scan:
            names = sorted(map(_label, scan))
        hint = "list a subdirectory or use find with a pattern"
        return cap_lines(names, MAX_LS_ENTRIES, "entries", hint) or f"({params.path} is empty)"


def _label(entry: os.DirEntry[str]) -> str:
    """The entry's name, with `/` for a directory; a link that cannot be followed (a loop, a
    dangling or unreadable target) is listed by its name alone."""
    try:
        is_dir = entry.is_dir()
    except OSError:
        is_dir = False
    return entry.name + ("/" if is_dir else "")
