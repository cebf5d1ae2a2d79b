"""Project instructions (`AGENTS.md`, `CLAUDE.md`) for every agent's system prompt.

Users keep their project's rules in these files. They are found walking up from the workspace to the
repository root (the nearest folder holding `.git`; outside a repository, the workspace alone) and
read outermost first, so the nearest, most specific rules come last; in each folder `AGENTS.md`, then
`CLAUDE.md`. Together they are cut at `MAX_CONTEXT_CHARS`, with a one-line note saying so. The runner
reads them once per workspace, so every session of an agent gets a byte-identical system prompt and
the shared prefix survives. An agent opts out with `context: none` in its frontmatter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CONTEXT_FILES = ("AGENTS.md", "CLAUDE.md")
MAX_CONTEXT_CHARS = 8_000


@dataclass(frozen=True)
class ProjectContext:
    """The files that load for a workspace, and the block they make in a system prompt ("" if none)."""

    files: tuple[Path, ...] = ()
    text: str = ""
    n_chars: int = 0


def repository_root(folder: Path) -> Path | None:
    """The nearest folder at or above `folder` holding `.git`, or None outside a repository; the
    project's instructions and the writer lease both go by it."""
    return next((f for f in (folder, *folder.parents) if (f / ".git").exists()), None)


def context_files(workspace: Path) -> list[Path]:
    """The instruction files for a workspace, outermost first."""
    root = repository_root(workspace)
    # Not in a repository: the workspace's own files only.
    folders = [workspace] if root is None else [workspace, *workspace.parents[: len(workspace.parts) - len(root.parts)]]
    return [folder / name for folder in reversed(folders) for name in CONTEXT_FILES if (folder / name).is_file()]


def load_project_context(workspace: Path) -> ProjectContext:
    """The instructions for `workspace`; unreadable files are left out."""
    files, parts = [], []
    for path in context_files(workspace):
        try:
            text = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            continue
        if text:
            files.append(path)
            parts.append(f"## {path}\n{text}")
    if not parts:
        return ProjectContext()
    body = "\n\n".join(parts)
    n_chars = len(body)
    if n_chars > MAX_CONTEXT_CHARS:
        body = (
            body[:MAX_CONTEXT_CHARS].rstrip()
            + f"\n[project instructions cut at {MAX_CONTEXT_CHARS:,} of {n_chars:,} characters; read the files above for the rest]"
        )
    text = f"Project instructions (from the files named below; follow them):\n\n{body}"
    return ProjectContext(tuple(files), text, n_chars)
