"""`grep`: regex search over workspace files, with ripgrep when present and Python otherwise.

Both backends print `path:line:text` in path order, skip `.git`, hidden entries, symlinks and
binary files, so the model sees the same thing wherever it runs (rg also honours .gitignore).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from ..errors import ToolError
from .base import Tool, cap_lines, clip_line
from .workspace import Workspace, glob_matcher, is_binary

MAX_GREP_MATCHES = 200


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

    def __init__(self, workspace: Workspace, *, use_rg: bool | None = None) -> None:
        """`use_rg`: None finds ripgrep on PATH, False forces the Python backend."""
        super().__init__(workspace)
        self.rg = shutil.which("rg") if use_rg is not False else None

    def execute(self, params: Params) -> str:
        flags = re.IGNORECASE if params.ignore_case else 0
        try:
            regex = re.compile(params.pattern, flags)
        except re.error as exc:
            raise ToolError(
                f"invalid regex {params.pattern!r}: {exc}; escape regex special characters with a backslash"
            ) from None
        if params.glob:
            glob_matcher(params.glob)  # a bad glob is the same error on both backends
        target = self.workspace.existing(params.path)
        if self.rg:
            matches = self._rg(self.rg, params, target)
        else:
            matches = self._python(regex, params, target)
        hint = "narrow the pattern, path or glob"
        output = cap_lines((clip_line(m) for m in matches), MAX_GREP_MATCHES, "matches", hint)
        if output:
            return output
        where = f" (glob {params.glob!r})" if params.glob else ""
        return f"No matches for {params.pattern!r} in {params.path}{where}"

    def _python(self, regex: re.Pattern[str], params: Params, target: Path) -> Iterator[str]:
        if target.is_file():  # like rg: the glob filters only what the walk finds
            files: Iterable[Path] = [target]
        else:
            files = self.workspace.walk(target, params.glob, skip_hidden=True)
        for file in files:
            yield from self._search_file(regex, file)

    def _search_file(self, regex: re.Pattern[str], file: Path) -> Iterator[str]:
        label = self.workspace.relative(file)
        try:
            if is_binary(file):
                return
            with file.open(encoding="utf-8", errors="replace") as lines:
                for n, line in enumerate(lines, 1):
                    if regex.search(line):
                        yield f"{label}:{n}:" + line.removesuffix("\n")
        except OSError:
            return  # unreadable file: skipped, like rg --no-messages

    def _rg(self, rg: str, params: Params, target: Path) -> Iterator[str]:
        args = [rg, "--line-number", "--no-heading", "--with-filename", "--color", "never"]
        args += ["--sort", "path", "--no-config", "--no-messages", "--no-ignore-parent"]
        args += ["--ignore-case"] if params.ignore_case else []
        args += ["--glob", params.glob] if params.glob else []
        args += ["--regexp", params.pattern]
        # rg prints paths as given: pass none for the root so they carry no "./" prefix.
        args += [] if target == self.workspace.root else ["--", self.workspace.relative(target)]
        with subprocess.Popen(
            args,
            cwd=self.workspace.root,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            encoding="utf-8",
            errors="replace",
        ) as proc:
            assert proc.stdout is not None and proc.stderr is not None
            yield from (line.removesuffix("\n") for line in proc.stdout)
            error = proc.stderr.read().strip()
        if proc.returncode == 2 and error:
            raise ToolError(f"rg failed: {error.splitlines()[0]}; check the pattern and path")

    def describe(self, arguments: dict[str, Any]) -> str:
        label = f'grep "{arguments.get("pattern", "")}" {arguments.get("path", ".")}'
        if arguments.get("glob"):
            label += f" --glob {arguments['glob']}"
        return label + (" -i" if arguments.get("ignore_case") else "")
