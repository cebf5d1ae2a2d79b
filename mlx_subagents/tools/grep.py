"""`grep`: regex search over workspace files with ripgrep, in a process that can be killed.

`rg` comes with the `ripgrep` dependency. Its regex engine runs in linear time (no catastrophic
backtracking), it cuts long lines itself, and the call kills it on timeout or cancellation, so a
hostile pattern or a 200 MB one-line file costs neither the program's memory nor its exit. It
prints `path:line:text` in path order and skips `.git`, hidden entries, symlinks, binary files and
what .gitignore lists.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from ..errors import ToolError
from .base import MAX_LINE_CHARS, CappedLines, Tool, ToolResult
from .threads import DEFAULT_TOOL_TIMEOUT
from .workspace import glob_matcher

MAX_GREP_MATCHES = 200
HINT = "narrow the pattern, path or glob"


def find_rg() -> str:
    """The `rg` binary of the `ripgrep` wheel installed next to this Python, else one on PATH."""
    name = "rg.exe" if os.name == "nt" else "rg"
    folders = [sysconfig.get_path("scripts"), os.path.dirname(sys.executable)]
    folders.append(sysconfig.get_path("scripts", f"{os.name}_user"))
    for folder in folders:
        candidate = os.path.join(folder, name)
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(name)
    if found is None:
        raise ToolError("ripgrep (rg) is not installed; reinstall mlx-subagents, which depends on the ripgrep package")
    return found


class GrepTool(Tool):
    name = "grep"
    description = (
        "Search file contents in the workspace with a regular expression. Returns matching lines as path:line:text."
    )
    read_only = True

    class Params(BaseModel):
        pattern: str = Field(min_length=1, description="Regular expression to search for.")
        path: str = Field(default=".", description="File or directory to search in.")
        glob: str | None = Field(
            default=None,
            description="Only search files whose path matches this glob: '*.py', 'src/**/*.ts'.",
        )
        ignore_case: bool = Field(default=False, description="Match case-insensitively.")

    async def run(self, params: Params) -> ToolResult:
        target = self.workspace.existing(params.path)
        if params.glob:
            glob_matcher(params.glob)  # a bad glob gets the same one line as in find
        if not (target.is_dir() or target.is_file()):
            raise ToolError(f"{params.path!r} is not a regular file (a FIFO, device or socket); grep only reads files")
        matches = CappedLines(MAX_GREP_MATCHES)
        proc = await asyncio.create_subprocess_exec(
            *self._args(params, target),
            cwd=self.workspace.root,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            limit=1 << 20,  # bytes in one output line; rg's are cut to MAX_LINE_CHARS already
        )
        try:
            error = await asyncio.wait_for(self._collect(proc, matches), DEFAULT_TOOL_TIMEOUT)
        except asyncio.TimeoutError:
            raise ToolError(f"grep took longer than {DEFAULT_TOOL_TIMEOUT:g}s and was stopped; {HINT}") from None
        finally:
            if proc.returncode is None:  # timed out or cancelled: rg dies with the call
                proc.kill()
                await proc.wait()
        if proc.returncode == 2 and error:
            raise ToolError(self._failure(params, error))
        if matches.n_total:
            return ToolResult(matches.text("matches", HINT))
        where = f" (glob {params.glob!r})" if params.glob else ""
        return ToolResult(f"No matches for {params.pattern!r} in {params.path}{where}")

    def _args(self, params: Params, target: Path) -> list[str]:
        args = [find_rg(), "--line-number", "--no-heading", "--with-filename", "--color", "never"]
        args += ["--sort", "path", "--no-config", "--no-messages", "--no-ignore-parent"]
        # rg cuts long lines itself, so a minified file never reaches this process whole.
        args += ["--max-columns", str(MAX_LINE_CHARS), "--max-columns-preview"]
        args += ["--ignore-case"] if params.ignore_case else []
        args += ["--glob", params.glob] if params.glob else []
        args += ["--regexp", params.pattern]
        # rg prints paths as given: pass none for the root so they carry no "./" prefix.
        return args + ([] if target == self.workspace.root else ["--", self.workspace.relative(target)])

    @staticmethod
    async def _collect(proc: asyncio.subprocess.Process, matches: CappedLines) -> str:
        """Feed rg's output lines to `matches`; rg's error text once it is done."""
        assert proc.stdout is not None and proc.stderr is not None
        errors = asyncio.ensure_future(proc.stderr.read())  # with --no-messages: fatal errors only
        try:
            async for raw in proc.stdout:
                matches.add(raw.decode("utf-8", errors="replace").removesuffix("\n"))
            await proc.wait()
            return (await errors).decode("utf-8", errors="replace").strip()
        finally:
            errors.cancel()

    @staticmethod
    def _failure(params: Params, error: str) -> str:
        """rg's error in one line: a regex error names the pattern and its problem."""
        lines = [line.strip() for line in error.splitlines() if line.strip()]
        if lines[0].endswith("regex parse error:"):
            problem = next((line.removeprefix("error: ") for line in lines if line.startswith("error: ")), lines[-1])
            return f"invalid regex {params.pattern!r}: {problem}; escape regex special characters with a backslash"
        return f"grep failed: {lines[0].removeprefix('rg: ')}; check the pattern, path and glob"

    def describe(self, arguments: dict[str, Any]) -> str:
        label = f'grep "{arguments.get("pattern", "")}" {arguments.get("path", ".")}'
        if arguments.get("glob"):
            label += f" --glob {arguments['glob']}"
        return label + (" -i" if arguments.get("ignore_case") else "")
