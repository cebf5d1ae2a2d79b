"""What a session tells the model before its work: the system prompt (byte-identical for every session
of an agent with the same instructions, so that sessions share its KV), the task message that names
the workspace, and a fork's task.
"""

from __future__ import annotations

from ..tools import Workspace
from .skills import SkillChoice, skills_block
from .spec import AgentSpec

FORK_TASK = (
    "You are a fork: a copy of the agent above, with its conversation so far, started by its subagent call. "
    "Do this task yourself with your tools (you cannot delegate), then give your answer.\nTask: {task}"
)


def system_prompt(
    spec: AgentSpec, context: str = "", skills: SkillChoice | None = None, context_window: int = 0
) -> str:
    """Agent body + project instructions + the workspace's rules + its skills; byte-identical for every
    session of this agent and workspace (the skills catalog ends it, in a fixed order), and for every
    workspace with the same instructions, memory and skills: it takes no workspace, whose folder is in
    the task message (`task_message`). An agent's memory block names its memory file (`memory_block`).

    No call format: the host presents the tools in the model's own way (see `ModelHost.tool_mode`).

    Args:
        context: the project's instructions (`project_context`), read once per workspace by the runner.
        skills, context_window: the skills it is offered and the window the catalog's budget scales to.
    """
    # No workspace path here: its folder is in the task message (`task_message`), so that the prompt
    # and the tools after it are one prefix for every workspace (clients of one server share its cache).
    prompt = (
        f"{spec.system_prompt.strip()}\n\n" + (f"{context}\n\n" if context else "") + "All paths are relative to "
        "the workspace (its folder is named with your task); you cannot read or write outside it.\n"
        "Call one tool at a time. Reply without a tool call when you are done."
    )
    if skills is not None and skills.offered:
        prompt += "\n\n" + skills_block(skills.offered, skills.preloaded, context_window)
    return prompt


def task_message(task: str, workspace: Workspace) -> str:
    """A new session's first user message: the task, then the workspace's folder. The folder is here
    and not in the system prompt, so that sessions in different workspaces share that prompt's KV."""
    return f"Task: {task}\n\nWorkspace: {workspace.root}"
