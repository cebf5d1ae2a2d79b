"""What a task's agent may call: its tools capped at its parent's (`granted_tools`) unless the parent's
`agents:` list grants it (`check_grant`, `worker!`), narrowed by its call (`narrowed`), and only the
read-only ones in plan mode (`plan_tools`). Each tool taken away keeps the error its calls get.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..agents.spec import AgentSpec
from ..errors import RequestError
from ..tools import READ_ONLY_TOOLS
from ..tools.mcp_config import matches
from .prepared import Parent
from .tasks import TaskSpec


def check_grant(parent: Parent, agents: Sequence[str]) -> None:
    """Refuse children the parent's `agents:` list does not name."""
    granted = parent.spec.agents
    if granted is not None and (refused := sorted({a.strip().lower() for a in agents} - set(granted))):
        raise RequestError(
            f"'{parent.spec.name}' may not start {', '.join(repr(n) for n in refused)}: the agents: list in "
            f"{parent.spec.path} names only {', '.join(granted) or 'none'}; add the agent there to grant it"
        )


def granted_tools(parent: AgentSpec, child: AgentSpec) -> tuple[AgentSpec, dict[str, str]]:
    """The child as its parent may run it: its tools capped at the parent's, unless the parent's
    `agents:` list grants it its full tools (`worker!`); and, per tool it lost, the error its calls get."""
    if child.name in parent.full_tools_for:
        return child, {}
    kept = tuple(_kept_mcp(child.tools, parent))
    # Whatever the parent may not call, the child may not either (its denials pass down).
    mcp_denied = tuple(dict.fromkeys(child.mcp_denied + parent.mcp_denied))
    if kept == child.tools and mcp_denied == child.mcp_denied:
        return child, {}
    why = (
        f"Error: {{tool}} is not available to '{child.name}' here: its parent '{parent.name}' lacks it, and a "
        f"sub-agent's tools never exceed its parent's without a grant (agents: [{child.name}!] in {parent.path})"
    )
    lost = {tool: why.format(tool=tool) for tool in child.tools if tool not in kept}
    return child.model_copy(update={"tools": kept, "mcp_denied": mcp_denied}), lost


def _kept_mcp(tools: tuple[str, ...], parent: AgentSpec) -> list[str]:
    """A child's tools within its parent's: a built-in one if the parent has it; an MCP name if the
    parent may call it; a child's `mcp__s__*` narrowed to the parent's names on `s` (never widened)."""
    kept: list[str] = []
    for tool in tools:
        if not tool.startswith("mcp__"):
            narrowed = [tool] if tool in parent.tools else []
        elif tool.endswith("__*") and not any(matches(tool, p) or p == tool for p in parent.tools):
            narrowed = [p for p in parent.tools if p.startswith("mcp__") and matches(p, tool)]
        else:
            narrowed = [tool] if tool in parent.tools or parent.grants(tool) else []
        kept.extend(t for t in narrowed if t not in kept)
    return kept


def narrowed(spec: AgentSpec, task: TaskSpec, denied: Mapping[str, str]) -> AgentSpec:
    """The agent as its task narrows it: its tools to the task's `allowed_tools` (none for a single-shot
    task), its system prompt with the task's addition at its end. A call narrows, never widens: naming a
    tool the agent lacks here (or one its parent withholds) is refused in one line."""
    update: dict[str, Any] = {}
    if task.single_shot:
        update = {"tools": (), "mcp_inline": ()}
    elif task.allowed_tools is not None:
        asked = task.allowed_tools
        if missing := [t for t in asked if t not in spec.tools and not spec.grants(t)]:
            withheld = [t for t in missing if t in denied]
            why = f" (withheld from it here: {', '.join(withheld)})" if withheld else ""
            raise RequestError(
                f"task '{task.label}': allowed_tools names {', '.join(repr(t) for t in missing)}, which "
                f"'{spec.name}' does not have here{why}; its tools are {', '.join(spec.tools) or 'none'}: name only "
                "those, or leave allowed_tools out"
            )
        kept = [t for t in spec.tools if t in asked] + [t for t in asked if t not in spec.tools]
        update = {"tools": tuple(dict.fromkeys(kept))}
        if not any(t.startswith("mcp__") for t in kept):
            update["mcp_inline"] = ()
    if task.system_prompt.strip():
        update["system_prompt"] = f"{spec.system_prompt.rstrip()}\n\n{task.system_prompt.strip()}"
    return spec.model_copy(update=update) if update else spec


def plan_tools(spec: AgentSpec, denied: dict[str, str]) -> tuple[AgentSpec, dict[str, str]]:
    """The agent in plan mode: only its read-only tools (and `subagent`, whose children plan too); a
    call of a tool taken away gets an error saying why."""
    kept = tuple(tool for tool in spec.tools if tool in READ_ONLY_TOOLS or tool == "subagent")
    if kept == spec.tools:
        return spec, denied
    why = (
        "Error: {tool} is not available to '" + spec.name + "' in plan mode, which only looks: no edit, write "
        "or bash; describe the change in your answer instead"
    )
    lost = {tool: why.format(tool=tool) for tool in spec.tools if tool not in kept}
    return spec.model_copy(update={"tools": kept}), {**denied, **lost}
