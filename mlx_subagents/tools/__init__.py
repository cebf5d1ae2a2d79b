"""Workspace-confined tools for sub-agents: read, grep, find, ls, bash, edit, write."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from .base import Tool, ToolResult
from .bash import BashTool
from .edit import EditTool
from .find import FindTool
from .grep import GrepTool
from .ls import LsTool
from .processes import kill_all_processes
from .read import ReadTool
from .sandbox import Sandbox
from .workspace import Workspace
from .write import WriteTool

TOOL_NAMES: tuple[str, ...] = ("read", "grep", "find", "ls", "bash", "edit", "write")
TOOL_CLASSES: dict[str, type[Tool]] = {
    cls.name: cls for cls in (ReadTool, GrepTool, FindTool, LsTool, BashTool, EditTool, WriteTool)
}
READ_ONLY_TOOLS: frozenset[str] = frozenset(name for name, cls in TOOL_CLASSES.items() if cls.read_only)


def make_tools(names: Iterable[str], workspace: Workspace | Path, sandbox: Sandbox | None = None) -> dict[str, Tool]:
    """One instance of each named tool, all confined to `workspace`, `bash` in `sandbox` when one is
    given; unknown names raise."""
    if not isinstance(workspace, Workspace):
        workspace = Workspace(workspace)
    tools = {}
    for name in names:
        if name not in TOOL_CLASSES:
            raise ValueError(f"unknown tool {name!r}; available: {', '.join(TOOL_NAMES)}")
        tools[name] = BashTool(workspace, sandbox) if name == "bash" else TOOL_CLASSES[name](workspace)
    return tools


__all__ = [
    "READ_ONLY_TOOLS",
    "Sandbox",
    "TOOL_CLASSES",
    "TOOL_NAMES",
    "Tool",
    "ToolResult",
    "Workspace",
    "kill_all_processes",
    "make_tools",
]
