"""`find`: workspace files whose path matches a glob."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from .base import Tool, cap_lines

MAX_FIND_RESULTS = 500


class FindTool(Tool):
    name = "find"
    description = "Find files in the workspace by glob pattern. Returns sorted paths relative to the workspace root."
    read_only = True
    writes = False
    by_default = True
    claude_names = ("Glob",)

    class Params(BaseModel):
        pattern: str = Field(
            min_length=1,
            description=(
                "Glob matched against paths from the workspace root, such as '**/*.py' or "
                "'src/**/test_*.py'; a pattern without '/' matches file names at any depth."
            ),
        )
        path: str = Field(default=".", description="Directory to search in.")

    def execute(self, params: Params) -> str:
        directory = self.workspace.existing(params.path, "directory")
        files = self.workspace.walk(directory, params.pattern, skip_hidden=False)
        found = map(self.workspace.relative, files)
        hint = "use a narrower pattern or path"
        return cap_lines(found, MAX_FIND_RESULTS, "files", hint) or (
            f"No files match {params.pattern!r} in {params.path}"
        )

    def describe(self, arguments: dict[str, Any]) -> str:
        path = arguments.get("path", ".")
        return f"find {arguments.get('pattern', '')}" + ("" if path == "." else f" in {path}")
