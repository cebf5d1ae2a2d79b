"""Workspace-confined tools for sub-agents: read, grep, find, ls, bash, edit, write; `subagent` and
the background tools that come with it.

Each tool class says what it is (`Tool`: read-only, writes, memory, granted by default, Claude Code's
names); every name list here is derived from the registered classes (`REGISTRY`), so a new tool is a
class and one line in `REGISTRY`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .background import BACKGROUND_TOOLS
from .base import Tool, ToolResult
from .bash import BashTool
from .edit import EditTool
from .find import FindTool
from .grep import GrepTool
from .ls import LsTool
from .processes import kill_all_processes
from .read import ReadTool
from .sandbox import Sandbox
from .subagent import SubagentTool
from .workspace import Workspace
from .write import WriteTool


@dataclass(frozen=True)
class ToolRegistry:
    """The tool classes agents are granted, in the order a file without `tools:` lists them, and every
    name list derived from what each class says of itself."""

    classes: tuple[type[Tool], ...]

    @property
    def named(self) -> tuple[type[Tool], ...]:
        """The classes an agent file's `tools` names (not those that come with another's grant)."""
        return tuple(cls for cls in self.classes if cls.granted_with is None)

    @property
    def known(self) -> tuple[str, ...]:
        """Every name an agent file's `tools` may hold (besides MCP tools)."""
        return tuple(cls.name for cls in self.named)

    @property
    def by_default(self) -> dict[str, type[Tool]]:
        """The tools granted when a file has no `tools:`, by name: those `make_tools` makes from a workspace."""
        return {cls.name: cls for cls in self.named if cls.by_default}

    @property
    def read_only(self) -> frozenset[str]:
        """The named tools that only read (plan mode keeps them)."""
        return frozenset(cls.name for cls in self.named if cls.read_only)

    @property
    def writers(self) -> frozenset[str]:
        """The named tools that can change files: an agent holding one is a writer."""
        return frozenset(cls.name for cls in self.named if cls.writes)

    @property
    def memory_writers(self) -> frozenset[str]:
        """The named tools that can write an agent's memory folder: an agent holding one keeps its memory."""
        return frozenset(cls.name for cls in self.named if cls.writes_memory)

    @property
    def claude_names(self) -> dict[str, tuple[str, ...]]:
        """Claude Code's names of each named tool that has some (`bash`: `Bash`), for hook matchers."""
        return {cls.name: cls.claude_names for cls in self.named if cls.claude_names}

    @property
    def claude_map(self) -> dict[str, str]:
        """Our name for each Claude Code name a Claude agent file's `tools` may hold bare (`Read`: `read`):
        the tools granted by default. (Claude Code's `Task(...)` grants `subagent` with the agents it names.)"""
        return {claude: cls.name for cls in self.by_default.values() for claude in cls.claude_names}


REGISTRY = ToolRegistry(
    (ReadTool, GrepTool, FindTool, LsTool, BashTool, EditTool, WriteTool, SubagentTool, *BACKGROUND_TOOLS)
)
TOOL_CLASSES: dict[str, type[Tool]] = REGISTRY.by_default
TOOL_NAMES: tuple[str, ...] = tuple(TOOL_CLASSES)
KNOWN_TOOLS: tuple[str, ...] = REGISTRY.known
READ_ONLY_TOOLS: frozenset[str] = REGISTRY.read_only
WRITER_TOOLS: frozenset[str] = REGISTRY.writers
MEMORY_TOOLS: frozenset[str] = REGISTRY.memory_writers


def make_tools(names: Iterable[str], workspace: Workspace | Path, sandbox: Sandbox | None = None) -> dict[str, Tool]:
    """One instance of each named tool, all confined to `workspace`, `bash` in `sandbox` when one is
    given (writing in this workspace, wherever the task was first prepared: a worktree's, say);
    unknown names raise."""
    if not isinstance(workspace, Workspace):
        workspace = Workspace(workspace)
    tools = {}
    for name in names:
        if name not in TOOL_CLASSES:
            raise ValueError(f"unknown tool {name!r}; available: {', '.join(TOOL_NAMES)}")
        if name == "bash":
            tools[name] = BashTool(workspace, sandbox.within(workspace.root) if sandbox is not None else None)
        else:
            tools[name] = TOOL_CLASSES[name](workspace)
    return tools


__all__ = [
    "KNOWN_TOOLS",
    "MEMORY_TOOLS",
    "READ_ONLY_TOOLS",
    "REGISTRY",
    "Sandbox",
    "TOOL_CLASSES",
    "TOOL_NAMES",
    "Tool",
    "ToolRegistry",
    "ToolResult",
    "WRITER_TOOLS",
    "Workspace",
    "kill_all_processes",
    "make_tools",
]
