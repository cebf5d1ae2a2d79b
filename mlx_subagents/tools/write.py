"""`write`: create or overwrite a file, making its parent folders."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pydantic import BaseModel, Field

from ..errors import ToolError
from .base import Tool, ToolResult, error_result
from .editor import REJECTED, Approval, Editor, FileChange
from .workspace import open_regular

# The text before an overwrite is read for its diff up to this size (a bigger file's diff shows it new).
MAX_DIFF_BYTES = 1024 * 1024


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
    uses_editor = True

    class Params(BaseModel):
        path: str = Field(description="File to write, relative to the workspace root.")
        content: str = Field(description="The complete new content of the file.")

    def execute(self, params: Params) -> str:
        path = self._target(params)
        data = params.content.encode("utf-8")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open_regular(path, params.path, write=True) as file:  # a FIFO or device is refused, never blocks
            file.write(data)
        return f"Wrote {len(data)} bytes to {self.workspace.relative(path)}"

    async def run(self, params: Params) -> ToolResult:
        """With an editor: the person's approval of the diff, then the file written through it (or here)."""
        editor = self.editor
        if editor is None:
            return await super().run(params)
        path = self._target(params)
        change = FileChange(path, await text_before(editor, path), params.content)
        if not await editor.approve(Approval(self.name, f"write {self.workspace.relative(path)}", change=change)):
            return error_result(REJECTED)
        if not editor.writes_files:
            return await super().run(params)
        await editor.write_text(path, params.content)
        return ToolResult(f"Wrote {len(params.content.encode('utf-8'))} bytes to {self.workspace.relative(path)}")

    def _target(self, params: Params) -> Path:
        path = self.workspace.resolve(params.path)
        if path.is_dir():
            raise ToolError(f"{params.path!r} is a directory; give a file path to write")
        return path


async def text_before(editor: Editor, path: Path) -> str | None:
    """A file's text before a write, for its diff: the editor's (an unsaved buffer), else the disk's (also
    where the editor refuses to read it); None for a new file, one that is not text, or one too big to show."""
    if editor.reads_files:
        try:
            return await editor.read_text(path)
        except FileNotFoundError:
            return None
        except ToolError:  # the editor would not read it (a client that refuses reads): the disk's text
            pass
    try:
        if not path.is_file() or path.stat().st_size > MAX_DIFF_BYTES:
            return None
        return await asyncio.to_thread(path.read_text, encoding="utf-8")
    except (FileNotFoundError, UnicodeDecodeError):
        return None
