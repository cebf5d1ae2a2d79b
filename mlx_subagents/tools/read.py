"""`read`: numbered lines of one text file, a window at a time.

The file is read in chunks and each line is kept only up to the clip, so memory stays bounded
however long a line or the file is (a 200 MB minified file made of one line).
"""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from itertools import islice
from typing import Any, BinaryIO

from pydantic import BaseModel, Field

from ..errors import ToolError
from .base import MAX_LINE_CHARS, Tool, ToolResult, take_capped
from .threads import checkpoint
from .workspace import BINARY_SNIFF_BYTES, open_regular

DEFAULT_READ_LIMIT = 400
CHUNK_BYTES = 64 * 1024
# UTF-8 continuation bytes: deleting them from a run of bytes leaves one byte per character.
_CONTINUATION_BYTES = bytes(range(0x80, 0xC0))


def _number(n: int, line: str) -> str:
    """One output line in `cat -n` layout."""
    return f"{n:>6}\t{line}"


def clipped_lines(file: BinaryIO, max_chars: int = MAX_LINE_CHARS) -> Iterator[str]:
    """The file's lines (split on `\n`, a trailing `\r` dropped), each decoded and cut to
    `max_chars` like `clip_line`, holding at most one chunk and one clipped line in memory."""
    keep = 4 * max_chars  # enough bytes for `max_chars` characters of UTF-8
    head = bytearray()
    n_chars = 0
    pending = False  # a line has begun
    while chunk := file.read(CHUNK_BYTES):
        checkpoint()
        start = 0
        while start < len(chunk):
            end = chunk.find(b"\n", start)
            piece = chunk[start : len(chunk) if end == -1 else end]
            if len(head) < keep:
                head += piece[: keep - len(head)]
            n_chars += len(piece.translate(None, _CONTINUATION_BYTES))
            pending = True
            if end == -1:
                break
            yield _clip(head, n_chars, max_chars)
            head.clear()
            n_chars, pending, start = 0, False, end + 1
    if pending:
        yield _clip(head, n_chars, max_chars)


def _clip(head: bytearray, n_chars: int, max_chars: int) -> str:
    text = bytes(head).removesuffix(b"\r").decode("utf-8", errors="replace")
    if n_chars <= max_chars and len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}... [line truncated: {max(n_chars, len(text))} chars]"


class ReadTool(Tool):
    name = "read"
    description = (
        "Read a text file in the workspace. Returns numbered lines (like cat -n); "
        "long files come in windows: use offset to read further."
    )
    read_only = True
    writes = False
    by_default = True
    claude_names = ("Read",)
    uses_editor = True

    class Params(BaseModel):
        path: str = Field(description="File path, relative to the workspace root.")
        offset: int = Field(default=1, ge=1, description="1-based line number to start from.")
        limit: int = Field(default=DEFAULT_READ_LIMIT, ge=1, description="Maximum number of lines to return.")

    async def run(self, params: Params) -> ToolResult:
        """The file as the editor has it (an unsaved buffer too) where it reads files; else from the disk."""
        if self.editor is None or not self.editor.reads_files:
            return await super().run(params)
        path = self.workspace.resolve(params.path)  # confined here, whatever the editor could reach
        try:
            text = await self.editor.read_text(path)
        except FileNotFoundError:
            return await super().run(params)  # the disk's answer: the same error line as ever
        data = text.encode("utf-8", "surrogatepass")
        return ToolResult(self.numbered(io.BytesIO(data), params, len(data)))

    def execute(self, params: Params) -> str:
        path = self.workspace.existing(params.path, "file")
        with open_regular(path, params.path) as file:
            return self.numbered(file, params, path.stat().st_size)

    def numbered(self, file: BinaryIO, params: Params, size: int) -> str:
        """The window of `file` that `params` asks for, as numbered lines under the caps."""
        if b"\0" in file.read(BINARY_SNIFF_BYTES):  # the test git and rg use
            raise ToolError(f"{params.path!r} is a binary file ({size} bytes); read only shows text files")
        file.seek(0)
        lines = clipped_lines(file)
        n_skipped = sum(1 for _ in islice(lines, min(params.offset - 1, sys.maxsize)))
        numbered = (_number(n, line) for n, line in enumerate(lines, params.offset))
        capped = take_capped(numbered, params.limit)
        kept, n_rest = capped.kept, capped.n_total
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
