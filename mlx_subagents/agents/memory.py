"""Per-agent memory: a folder an agent keeps notes in across runs (`memory: user | project | local`).

    user      $MLX_SUBAGENTS_HOME/agent-memory/<agent>/
    project   <workspace>/.mlx-subagents/agent-memory/<agent>/          (kept in the repository)
    local     <workspace>/.mlx-subagents/agent-memory-local/<agent>/    (git-ignore it)

The first `MAX_MEMORY_LINES` lines of its `MEMORY.md` go into the system prompt after the project
instructions, read once per run so every session's prompt is byte-identical. An agent with a tool that
writes through the workspace's paths (`Tool.writes_memory`: edit, write; `MEMORY_TOOLS`) may write in
that folder (the one exception to the workspace rule, `Workspace.memory`); one without gets its memory
read-only and no instruction to edit it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from ..errors import SubagentError
from ..home import state_home
from ..userfiles import decode_text, read_head

MemoryScope = Literal["user", "project", "local"]
MEMORY_FILE = "MEMORY.md"
MAX_MEMORY_LINES = 200
MAX_MEMORY_BYTES = 64 * 1024


def memory_folder(scope: MemoryScope, agent: str, workspace: Path) -> Path:
    """The folder an agent's memory lives in, for its scope (made when a writer starts, `start_memory`)."""
    if scope == "user":
        return state_home() / "agent-memory" / agent
    kind = "agent-memory" if scope == "project" else "agent-memory-local"
    return workspace / ".mlx-subagents" / kind / agent


def memory_heading(agent: str) -> str:
    """The first line of a new `MEMORY.md`: the line writers anchor their edits to."""
    return f"# Memory of {agent}\n"


def start_memory(folder: Path, agent: str) -> None:
    """Make the folder and, if missing, a `MEMORY.md` holding only its heading, so that writers add lines
    with `edit` (compare-and-replace: parallel runs never lose one) instead of each creating the file."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with (folder / MEMORY_FILE).open("x", encoding="utf-8") as file:  # O_EXCL: never over a file or link
            file.write(memory_heading(agent))
    except FileExistsError:
        pass


def memory_block(folder: Path, writable: bool) -> str:
    """The memory's part of the system prompt: where it is, the head of `MEMORY.md`, and (when
    `writable`) how to keep it; a note says when the file was cut."""
    path = folder / MEMORY_FILE
    text = ""
    if path.exists():
        try:
            data, whole = read_head(path, "memory file", SubagentError, MAX_MEMORY_BYTES)
            text = decode_text(data, path, "memory file", SubagentError, cut=not whole)
        except SubagentError as exc:
            text, whole = f"[left out: {exc}]", True
        lines = text.splitlines()
        text = "\n".join(lines[:MAX_MEMORY_LINES])
        if len(lines) > MAX_MEMORY_LINES or not whole:
            text += f"\n[memory cut at {MAX_MEMORY_LINES} lines; read {path} for the rest]"
    head = f"Your memory ({path}), kept across runs:\n\n{text or '(empty)'}"
    if writable:
        head += (
            f"\n\nKeep what you learn that will help next time: add one short line per fact to {path} with edit "
            "(never write over it: other runs of you may be adding lines too); paths in that folder are allowed "
            "though it is outside the workspace."
        )
    return head
