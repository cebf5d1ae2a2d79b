"""The tools a session offers, by name: what its agent file grants, made for its workspace, with the
tools its runner makes for it (MCP, `subagent`, the task tools) and `skill` where skills are offered.
"""

from __future__ import annotations

from ..tools import TOOL_CLASSES, Sandbox, Tool, Workspace, make_tools
from ..tools.skill import SkillTool
from .skills import SkillChoice
from .spec import AgentSpec


def session_tools(
    spec: AgentSpec, workspace: Workspace, sandbox: Sandbox | None, extra_tools: dict[str, Tool], skills: SkillChoice
) -> dict[str, Tool]:
    """The tools a session of `spec` offers, by name: its granted tools made for the workspace, then
    `extra_tools` (MCP tools, `subagent`), each only if its file grants it, and `skill` when it is
    offered skills. The prompt-fit check counts their schemas before anything starts."""
    # A granted tool with no implementation here (`subagent`, unless the caller passes one in
    # `extra_tools`) is not offered rather than crashing the session.
    granted = [t for t in spec.tools if t in TOOL_CLASSES and t not in extra_tools]
    made = make_tools(granted, workspace, sandbox)
    # In the file's order, a tool the caller made (`bash` on the task board) in its place.
    mine = [t for t in spec.tools if t in made or (t in TOOL_CLASSES and t in extra_tools)]
    listed = {t: extra_tools.get(t) or made[t] for t in mine}
    tools: dict[str, Tool] = {**listed, **extra_tools}
    tools = {n: t for n, t in tools.items() if t.by_delegation or spec.grants(t.grant)}
    if skills.offered:  # offered skills come with the tool that loads them, whatever `tools:` says
        tools["skill"] = SkillTool(workspace, skills.offered)
    return tools
