"""`edit`: replace one exact, unique piece of text in a file."""

from __future__ import annotations

from pydantic import BaseModel, Field

from ..errors import ToolError
from .base import Tool


class EditTool(Tool):
    name = "edit"
    description = (
        "Replace text in a file. old_text must match the file exactly (whitespace included) "
        "and occur exactly once; include surrounding lines to make it unique."
    )
    read_only = False

    class Params(BaseModel):
        path: str = Field(description="File to edit, relative to the workspace root.")
        old_text: str = Field(min_length=1, description="Exact text to replace.")
        new_text: str = Field(description="Text to put in its place.")

    def execute(self, params: Params) -> str:
        path = self.workspace.existing(params.path, "file")
        # newline="" keeps \r\n as is, so only the replaced span changes.
        try:
            with path.open(encoding="utf-8", newline="") as file:
                text = file.read()
        except UnicodeDecodeError:
            raise ToolError(f"{params.path!r} is not UTF-8 text; edit only changes text files") from None
        start = self._find_once(text, params)
        with path.open("w", encoding="utf-8", newline="") as file:
            file.write(text[:start] + params.new_text + text[start + len(params.old_text) :])
        first = text.count("\n", 0, start) + 1
        last = first + params.new_text.count("\n")
        lines = f"line {first}" if last == first else f"lines {first}-{last}"
        return f"Edited {self.workspace.relative(path)}: replaced text at {lines}"

    @staticmethod
    def _find_once(text: str, params: Params) -> int:
        """Where `old_text` starts; raises unless it occurs exactly once."""
        n_found = text.count(params.old_text)
        if n_found == 0:
            raise ToolError(
                f"old_text not found in {params.path}; read the file and copy the text exactly, "
                "including whitespace and indentation"
            )
        if n_found > 1:
            raise ToolError(
                f"old_text occurs {n_found} times in {params.path}; include more surrounding "
                "lines so it matches exactly once"
            )
        return text.index(params.old_text)
