"""Claude Code's dialect of agent files: its tool names, its `Task(...)` grants, its model aliases.

A file in a `.claude/agents` folder is read in this dialect: `Read` is our `read`, `Task(scout,
worker)` in `tools` grants `subagent` and names the agents it may start, `sonnet` is a remote
model (the default local model is used instead, with a warning), and Claude Code's own fields are
honoured where we have them and named in one warning where we do not.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..tools import REGISTRY
from ..tools.subagent import SubagentTool

# Claude Code's own fields that map to ours (`skills`, `memory`, `background`, `effort` are ours too;
# so is `isolation`, in `spec.FIELDS`).
CLAUDE_HONOURED = (
    "disallowedTools",
    "maxTurns",
    "skills",
    "memory",
    "background",
    "effort",
    "permissionMode",
    "hooks",
    "mcpServers",
)
# Claude Code's fields this version does not honour: a file using one gets one warning naming them.
# A branch that implements one removes it from here.
CLAUDE_UNSUPPORTED = ("initialPrompt", "disabled")
CLAUDE_FIELDS = CLAUDE_HONOURED + CLAUDE_UNSUPPORTED
# Claude Code grants sub-agents in `tools` as `Task(scout, reviewer)` (newer: `Agent(...)`): the subagent
# tool's Claude names, with the agents it may start in brackets.
CLAUDE_TASK_TOOL = re.compile(rf"(?:{'|'.join(map(re.escape, SubagentTool.claude_names))})\((.*)\)")
CLAUDE_MODEL_ALIASES = ("sonnet", "opus", "haiku")
# Our name for each of Claude Code's tools a `tools` list may name bare (`Read` is `read`), from the tools' classes.
CLAUDE_TOOL_MAP: dict[str, str] = REGISTRY.claude_map


def is_claude_file(path: Path) -> bool:
    """Whether an agent file sits in a `.claude/agents` folder (and so speaks this dialect)."""
    return path.parent.name == "agents" and path.parent.parent.name == ".claude"


def claude_tool(name: str, claude: bool) -> str | None:
    """Our name for a Claude Code tool (`Read` -> `read`; `Task(...)` -> `subagent` in any file), else None."""
    if CLAUDE_TASK_TOOL.fullmatch(name):
        return SubagentTool.name  # the agents it names are read by `task_grants`
    if claude:
        return CLAUDE_TOOL_MAP.get(name)
    return None


def task_grants(items: list[object]) -> list[str] | None:
    """The agents named by `Task(a, b)` items of a `tools` list (None: no such item)."""
    names: list[str] | None = None
    for item in items:
        if isinstance(item, str) and (task := CLAUDE_TASK_TOOL.fullmatch(item.strip())):
            names = names if names is not None else []
            names.extend(task.group(1).split(","))
    return names


def unsupported_note(path: Path, meta: dict[str, object]) -> str | None:
    """The one warning for a file's Claude Code fields that are not honoured here (None: it uses none)."""
    used = [field for field in CLAUDE_UNSUPPORTED if field in meta]
    if not used:
        return None
    return f"{path}: Claude Code field(s) {', '.join(used)} not supported here, ignored"


def is_claude_model(model: str) -> bool:
    """Whether a model name is one of Claude's (`sonnet`, `claude-...`): remote, never run here."""
    return model.lower() in CLAUDE_MODEL_ALIASES or model.lower().startswith("claude-")
