"""`read`: numbered lines of one text file, a window at a time."""

from __future__ import annotations

import sys
from itertools import islice
from typing import Any

from pydantic import BaseModel, Field

from ..errors import ToolError
from .base import Tool, clip_line, take_capped
from .workspace import is_binary

DEFAULT_READ_LIMIT = 400


def _number(n: int, line: str) -> str:
    """One output line in `cat -n` layout."""
    return f"{n:>6}\t" + clip_line(line.removesuffix("\n"))


class ReadTool(Tool):
    name = "read"
    description = (
        "Read a text file in the workspace. Returns numbered lines (like cat -n); "
        "long files come in windows: use offset to read further."
    )
    read_only = True

    class Params(BaseModel):
        path: str = Field(description="File path, relative to the workspace root.")
        offset: int = Field(default=1, ge=1, description="1-based line number to start from.")
        limit: int = Field(default=DEFAULT_READ_LIMIT, ge=1, description="Maximum number of lines to return.")

    def execute(self, params: Params) -> str:
        path = self.workspace.existing(params.path, "file")
        if is_binary(path):
            raise ToolError(
                f"{params.path!r} is a binary file ({path.stat().st_size} bytes); read only shows text files"
            )
        with path.open(encoding="utf-8", errors="replace") as file:
            n_skipped = sum(1 for _ in islice(file, min(params.offset - 1, sys.maxsize)))
            numbered = (_number(n, line) for n, line in enumerate(file, params.offset))
            kept, n_rest = take_capped(numbered, params.limit)
        n_lines = n_skipped + n_rest
        if n_rest == 0:
            return self._past_end(params, n_lines)
        last = params.offset + len(kept) - 1
        if last < n_lines:
            kept.append(
                f"[... truncated: showing lines {params.offset}-{last} of {n_lines}; "
                f"use offset={last + 1} to read more]"
            )
        return "\n".join(kept)

    def _past_end(self, params: Params, n_lines: int) -> str:
        if n_lines == 0:
            return f"({params.path} is empty)"
        raise ToolError(
            f"offset {params.offset} is past the end of {params.path!r} ({n_lines} lines); "
            f"use an offset from 1 to {n_lines}"
        )

    def describe(self, arguments: dict[str, Any]) -> str:
        label = f"read {arguments.get('path', '')}"
        if "offset" not in arguments and "limit" not in arguments:
            return label
        start = arguments.get("offset", 1)
        limit = arguments.get("limit", DEFAULT_READ_LIMIT)
        if isinstance(start, int) and isinstance(limit, int):
            return f"{label}:{start}-{start + limit - 1}"
        return label
