"""Per-agent memory: a folder an agent keeps notes in across runs (`memory: user | project | local`).

    user      $MLX_SUBAGENTS_HOME/agent-memory/<agent>/
    project   <workspace>/.mlx-subagents/agent-memory/<agent>/          (kept in the repository)
    local     <workspace>/.mlx-subagents/agent-memory-local/<agent>/    (git-ignore it)

The first `MAX_MEMORY_LINES` lines of its `MEMORY.md` go into the system prompt after the project
instructions, read once per run so every session's prompt is byte-identical. An agent with a tool that
writes through the workspace's paths (`Tool.writes_memory`: edit, write; `MEMORY_TOOLS`) may write in
that folder (the one exception to the workspace rule, `Workspace.memory`); one without gets its memory
read-only and no instruction to edit it.

A project or local memory folder lies in the workspace, which a cloned repository fills: no part of it
(`.mlx-subagents`, the scope's folder, the agent's) may be a symbolic link, nor its `MEMORY.md`, since a
link would open the folder it points to, outside the workspace, to the agent's tools. Such a folder is
refused in one line (`memory_folder`); the user's own memory folder in the state home is checked the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from ..errors import RequestError, SubagentError
from ..home import state_home
from ..userfiles import decode_text, linked_part, read_head

MemoryScope = Literal["user", "project", "local"]
MEMORY_FILE = "MEMORY.md"
MAX_MEMORY_LINES = 200
MAX_MEMORY_BYTES = 64 * 1024


def memory_folder(scope: MemoryScope, agent: str, workspace: Path) -> Path:
    """The folder an agent's memory lives in, for its scope (made when a writer starts, `start_memory`);
    a `RequestError` line when a part of it, or its `MEMORY.md`, is a symbolic link."""
    if scope == "user":
        base, relative = state_home(), Path("agent-memory", agent)
    else:
        kind = "agent-memory" if scope == "project" else "agent-memory-local"
        base, relative = workspace, Path(".mlx-subagents", kind, agent)
    if (link := linked_part(base, relative / MEMORY_FILE)) is not None:
        raise RequestError(
            f"{link}: the memory of agent '{agent}' (memory: {scope}) goes through this symbolic link, which could "
            f"lead outside {base}; make it a real folder (or file), or give the agent another memory scope"
        )
    return base / relative


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


def memory_block(folder: Path, writable: bool, workspace: Path) -> str:
    """The memory's part of the system prompt: where it is, the head of `MEMORY.md`, and (when
    `writable`) how to keep it; a note says when the file was cut. A project or local memory is named by
    its path in `workspace` (the tools read it so): no system prompt names the workspace, so an agent's
    prompt is one shared prefix in every workspace; a user memory's folder is the same in all of them."""
    file = folder / MEMORY_FILE
    path = file.relative_to(workspace) if file.is_relative_to(workspace) else file
    text = ""
    if file.exists():
        try:
            data, whole = read_head(file, "memory file", SubagentError, MAX_MEMORY_BYTES)
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
