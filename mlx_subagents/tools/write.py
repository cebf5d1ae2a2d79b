"""`write`: create or overwrite a file, making its parent folders."""

from __future__ import annotations

from pydantic import BaseModel, Field

from ..errors import ToolError
from .base import Tool
from .workspace import open_regular


class WriteTool(Tool):
    name = "write"
    description = (
        "Create or overwrite a file in the workspace with the given content; missing parent directories are created."
    )
    read_only = False
    writes = True
    writes_memory = True
    by_default = True
    claude_names = ("Write",)

    class Params(BaseModel):
        path: str = Field(description="File to write, relative to the workspace root.")
        content: str = Field(description="The complete new content of the file.")

    def execute(self, params: Params) -> str:
        path = self.workspace.resolve(params.path)
        if path.is_dir():
            raise ToolError(f"{params.path!r} is a directory; give a file path to write")
        data = params.content.encode("utf-8")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open_regular(path, params.path, write=True) as file:  # a FIFO or device is refused, never blocks
            file.write(data)
        return f"Wrote {len(data)} bytes to {self.workspace.relative(path)}"
