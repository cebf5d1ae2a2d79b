"""Project instructions (`AGENTS.md`, `CLAUDE.md`) for every agent's system prompt.

Users keep their project's rules in these files. They are found walking up from the workspace to the
repository root (the nearest folder holding `.git`; outside a repository, the workspace alone) and
read outermost first, so the nearest, most specific rules come last; in each folder `AGENTS.md`, then
`CLAUDE.md`. Together they are cut at `MAX_CONTEXT_CHARS`, with a one-line note saying so. They come
with a cloned repository, so each is read through the one guard (`userfiles.read_head`): only a regular
file (a FIFO or a link to a device is left out, named in `skipped`), and only its first
`MAX_CONTEXT_BYTES` (a huge sparse file costs what is read, not its size). The runner
reads them once per workspace, so every session of an agent gets a byte-identical system prompt and
the shared prefix survives. An agent opts out with `context: none` in its frontmatter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import SubagentError
from ..userfiles import decode_text, read_head

CONTEXT_FILES = ("AGENTS.md", "CLAUDE.md")
MAX_CONTEXT_CHARS = 8_000
# Enough bytes for MAX_CONTEXT_CHARS characters of any UTF-8 text: no more is read of any file.
MAX_CONTEXT_BYTES = 4 * MAX_CONTEXT_CHARS


@dataclass(frozen=True)
class ProjectContext:
    """The files that load for a workspace, and the block they make in a system prompt ("" if none).

    `n_chars` counts the characters read; `more` says a file held more than was read; `skipped` has one
    line per file left out (why).
    """

    files: tuple[Path, ...] = ()
    text: str = ""
    n_chars: int = 0
    more: bool = False
    skipped: tuple[str, ...] = ()


def repository_root(folder: Path) -> Path | None:
    """The nearest folder at or above `folder` holding `.git`, or None outside a repository; the
    project's instructions and the writer lease both go by it."""
    return next((f for f in (folder, *folder.parents) if (f / ".git").exists()), None)


def context_files(workspace: Path) -> list[Path]:
    """The instruction files for a workspace, outermost first."""
    root = repository_root(workspace)
    # Not in a repository: the workspace's own files only.
    folders = [workspace] if root is None else [workspace, *workspace.parents[: len(workspace.parts) - len(root.parts)]]
    # `exists`, not `is_file`: a FIFO or device is named in `skipped`, never opened in a way that waits.
    return [folder / name for folder in reversed(folders) for name in CONTEXT_FILES if (folder / name).exists()]


def load_project_context(workspace: Path) -> ProjectContext:
    """The instructions for `workspace`; files that cannot be read are left out (in `skipped`)."""
    files, parts, skipped, more = [], [], [], False
    # Each file is headed by its path from the repository's root (outside one, the workspace), not its
    # absolute path, so that two worktrees of one repository get the same block (and share its KV).
    top = repository_root(workspace) or workspace
    for path in context_files(workspace):
        try:
            data, whole = read_head(path, "project instructions file", SubagentError, MAX_CONTEXT_BYTES)
            text = decode_text(data, path, "project instructions file", SubagentError, cut=not whole).strip()
        except SubagentError as exc:
            skipped.append(str(exc))
            continue
        more = more or not whole
        if text:
            files.append(path)
            parts.append(f"## {path.relative_to(top).as_posix()}\n{text}")
    if not parts:
        return ProjectContext(skipped=tuple(skipped))
    body = "\n\n".join(parts)
    n_chars = len(body)
    if n_chars > MAX_CONTEXT_CHARS or more:
        of = f"more than {n_chars:,}" if more else f"{n_chars:,}"
        body = (
            body[:MAX_CONTEXT_CHARS].rstrip()
            + f"\n[project instructions cut at {MAX_CONTEXT_CHARS:,} of {of} characters; read the files above for the rest]"
        )
    text = f"Project instructions (from the files named below; follow them):\n\n{body}"
    return ProjectContext(tuple(files), text, n_chars, more, tuple(skipped))
