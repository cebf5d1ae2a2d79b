"""`edit`: replace one exact, unique piece of text in a file.

Another task or process may change the file meanwhile (an appending log, a parallel worker). The
new text goes to a temporary file that replaces the original only if the original still holds
exactly what the edit was computed from; otherwise the edit is computed again from the new content
(parallel runs of one agent adding lines to its memory both keep theirs), and after `EDIT_ATTEMPTS`
it fails and the model reads the file again. Bytes appended to the original between that check and
the replacement are carried over.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from pathlib import Path
from typing import BinaryIO

from pydantic import BaseModel, Field

from ..errors import FileChangedError, ToolError
from .base import Tool, ToolResult, error_result
from .editor import REJECTED, Approval, FileChange
from .workspace import open_regular

CHANGED = "the file changed since it was read; read it again"
MAX_EDIT_BYTES = 10 * 1024 * 1024  # edit holds the file in memory, twice
EDIT_ATTEMPTS = 3
CARRY_OVER_ROUNDS = 5
CARRY_OVER_PAUSE_SECONDS = 0.01


class EditTool(Tool):
    name = "edit"
    description = (
        "Replace text in a file. old_text must match the file exactly (whitespace included) "
        "and occur exactly once; include surrounding lines to make it unique."
    )
    read_only = False
    writes = True
    writes_memory = True
    by_default = True
    claude_names = ("Edit", "MultiEdit")
    uses_editor = True

    class Params(BaseModel):
        path: str = Field(description="File to edit, relative to the workspace root.")
        old_text: str = Field(min_length=1, description="Exact text to replace.")
        new_text: str = Field(description="Text to put in its place.")

    def execute(self, params: Params) -> str:
        path = self.workspace.existing(params.path, "file")
        for _ in range(EDIT_ATTEMPTS - 1):
            try:
                return self._edit_once(path, params)
            except FileChangedError:
                continue  # computed again from what the other writer left
        return self._edit_once(path, params)

    def _edit_once(self, path: Path, params: Params) -> str:
        """Read, replace and check once; raises `FileChangedError` if the file changed meanwhile."""
        base, text = self._load(path, params)
        new, lines = self._replaced(text, params)
        replace_checked(path, params.path, base, new.encode("utf-8"))
        return f"Edited {self.workspace.relative(path)}: replaced text at {lines}"

    async def run(self, params: Params) -> ToolResult:
        """With an editor: the text it has (an unsaved buffer too), the person's approval of the diff,
        then the new text through it (or on the disk, checked as without one)."""
        editor = self.editor
        if editor is None:
            return await super().run(params)
        path = self.workspace.existing(params.path, "file")
        if editor.reads_files:
            text = await editor.read_text(path)
            base = text.encode("utf-8", "surrogatepass")
        else:
            base, text = await asyncio.to_thread(self._load, path, params)
        new, lines = self._replaced(text, params)
        shown = self.workspace.relative(path)
        if not await editor.approve(Approval(self.name, f"edit {shown}", change=FileChange(path, text, new))):
            return error_result(REJECTED)
        if editor.writes_files:
            await editor.write_text(path, new)
        else:
            await asyncio.to_thread(replace_checked, path, params.path, base, new.encode("utf-8"))
        return ToolResult(f"Edited {shown}: replaced text at {lines}")

    def _load(self, path: Path, params: Params) -> tuple[bytes, str]:
        """The file's bytes and their text; a file too big for an edit or not UTF-8 is one error line."""
        with open_regular(path, params.path) as file:
            base = file.read(MAX_EDIT_BYTES + 1)
        if len(base) > MAX_EDIT_BYTES:
            raise ToolError(
                f"{params.path!r} is over {MAX_EDIT_BYTES // 2**20} MB; edit changes smaller files (use bash for this one)"
            )
        try:
            return base, base.decode("utf-8")  # bytes as they are: \r\n stays, only the replaced span changes
        except UnicodeDecodeError:
            raise ToolError(f"{params.path!r} is not UTF-8 text; edit only changes text files") from None

    def _replaced(self, text: str, params: Params) -> tuple[str, str]:
        """The text with its one `old_text` replaced, and the lines the new text takes (`lines 3-5`)."""
        start = self._find_once(text, params)
        new = text[:start] + params.new_text + text[start + len(params.old_text) :]
        first = text.count("\n", 0, start) + 1
        last = first + params.new_text.count("\n")
        return new, (f"line {first}" if last == first else f"lines {first}-{last}")

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


def replace_checked(path: Path, shown: str, base: bytes, new: bytes) -> None:
    """Replace the file at `path` by `new` if it still holds `base`; raise `FileChangedError` if not.

    The replacement is a rename, so a reader never sees half a file. A process appending to the
    old file after the check (its `>>` opened it before the rename) would lose its bytes with the
    old inode: they are appended to the new file instead.
    """
    tmp = path.with_name(f".{path.name[:200]}.{secrets.token_hex(4)}.edit")
    try:
        with open_regular(tmp, shown, write=True) as out:
            out.write(new)
        with open_regular(path, shown) as current:
            os.chmod(tmp, os.fstat(current.fileno()).st_mode & 0o7777)
            if current.read() != base:
                raise FileChangedError(f"{shown}: {CHANGED}")
            os.replace(tmp, path)
            _carry_over(current, path)
    finally:
        tmp.unlink(missing_ok=True)


def _carry_over(old: BinaryIO, path: Path) -> None:
    """Append to `path` what reaches the old, replaced file (read on from where the check ended)
    until it has been quiet for a moment."""
    for _ in range(CARRY_OVER_ROUNDS):
        extra = old.read()
        if extra:
            with path.open("ab") as new:
                new.write(extra)
        else:
            time.sleep(CARRY_OVER_PAUSE_SECONDS)
