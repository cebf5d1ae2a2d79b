"""What preparation yields: a `PreparedTask` (a task checked, resolved and its model loaded), the
`Parent` a prepared task is to the children it delegates to, a `SetUpFailure` in a failed task's place,
and what a saved task keeps of how it ran when it is continued (`keep_sandbox`, `withhold`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..agents.hooks import Hooks
from ..agents.limits import Limits
from ..agents.skills import SkillChoice
from ..agents.spec import AgentSpec
from ..host.protocol import ModelHost
from ..tools import Sandbox, Tool, Workspace
from .tasks import ModelRef, TaskSpec


@dataclass(frozen=True)
class Parent:
    """A session that may start sub-agents: who it is, its depth and model, where its children are saved.

    Args:
        depth: how many parents it has (0: started by a person).
        run_folder: its run's folder (children are saved under `run_folder/runs/`); None when nothing is saved.
        thinking: its thinking budget, which its children without a `thinking:` of their own take.
    """

    spec: AgentSpec
    label: str
    depth: int
    model: ModelRef
    run_folder: Path | None
    thinking: int | None = None
    sandbox: Sandbox | None = None
    plan: bool = False
    # The skills it is offered: its children are offered no others.
    skills: tuple[str, ...] = ()
    # Its own prepared task, which a fork of it continues (None: a parent outside the runner's plans).
    task: PreparedTask | None = None


@dataclass(frozen=True)
class PreparedTask:
    """A task checked and resolved, its model loaded: what a plan, a handle or a child runs.

    Args:
        task: the task as asked (its label final: `parent > scout` for a child).
        spec: the agent as its parent may run it (tools capped at the parent's).
        denied: tools its file grants that its parent may not pass on, with the error a call gets.
        depth: how many parents it has (0: started by a person).
        context: the project's instructions for its system prompt.
        sandbox: where its `bash` may write and whether it has network (None: unsandboxed).
        plan: it runs in plan mode (read-only tools), and so do its children.
        hooks: the hooks that fire for it (the settings files', then its own file's).
        parent: its parent's label (None: started by a person).
        skills: the skills it is offered (and preloads).
        isolation: `worktree`: it runs in a worktree of its own, made when it starts (`runs/worktrees.py`).
    """

    task: TaskSpec
    spec: AgentSpec
    model: ModelRef
    host: ModelHost
    workspace: Workspace
    limits: Limits
    depth: int = 0
    timeout: float | None = None
    schema: dict[str, Any] | None = None
    denied: dict[str, str] = field(default_factory=dict)
    context: str = ""
    sandbox: Sandbox | None = None
    plan: bool = False
    hooks: Hooks = field(default_factory=Hooks)
    parent: str | None = None
    skills: SkillChoice = field(default_factory=SkillChoice)
    # The MCP tools it may call (`mcp__<server>__<tool>`), on the runner's running servers.
    mcp_tools: dict[str, Tool] = field(default_factory=dict)
    isolation: str = "none"

    @property
    def label(self) -> str:
        return self.task.label

    def as_parent(self, run_folder: Path | None) -> Parent:
        """This task as the parent of the children it delegates to."""
        return Parent(
            self.spec,
            self.label,
            self.depth,
            self.model,
            run_folder,
            self.limits.thinking,
            sandbox=self.sandbox,
            plan=self.plan,
            skills=self.skills.names(),
            task=self,
        )


@dataclass(frozen=True)
class SetUpFailure:
    """A task of a request whose children fail alone (a parallel delegation) that could not be prepared."""

    task: TaskSpec
    model: str
    error: BaseException


def keep_sandbox(task: PreparedTask, saved: Any) -> PreparedTask:
    """A saved task continued in the sandbox it ran with (its transcript's `sandbox` record): a child
    sandboxed by its parent stays sandboxed when resumed alone, and it keeps the network only if it
    had it then and would have it now. A continuation never widens a task's rights."""
    ran = Sandbox.from_record(saved)
    if ran is None:
        return task
    network = ran.network and (task.sandbox is None or task.sandbox.network)
    return replace(task, sandbox=Sandbox(network=network))


def withhold(task: PreparedTask, denied: Mapping[str, str]) -> PreparedTask:
    """A saved child continued as its parent ran it: the tools its parent withheld stay withheld (each
    call gets the error it got then), since a continuation prepares the agent again from its file."""
    if not denied:
        return task
    spec = task.spec.model_copy(update={"tools": tuple(t for t in task.spec.tools if t not in denied)})
    return replace(task, spec=spec, denied={**task.denied, **denied})
