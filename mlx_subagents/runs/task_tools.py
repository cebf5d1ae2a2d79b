"""The tools a runner makes for a task, on its board (its task registry): `subagent` and the task
tools where its file grants `subagent` and it runs above the depth limit, a `bash` that starts
background commands on the board, and `parent_send` for a child; the `subagent` tool's children run
through the runner that made it.
"""

from __future__ import annotations

from typing import Protocol

from ..agents.context import repository_root
from ..agents.discovery import AgentCatalog
from ..events import EventSink
from ..results import MultiRunResult
from ..tools import Tool, Workspace
from ..tools.background import make_background_tools
from ..tools.bash import BashTool
from ..tools.delegation import Delegation
from ..tools.parent_send import ParentSendTool, Send
from ..tools.subagent import SubagentTool
from .board import TaskBoard
from .model_grants import describe_models
from .options import RunOptions
from .prepare import Preparer
from .prepared import Parent
from .slots import lend
from .task import TaskHandle


class Delegator(Protocol):
    """What a task's tools need of the runner that made them: its agents, options and preparer, and
    how it runs a call's children."""

    options: RunOptions
    catalog: AgentCatalog
    preparer: Preparer
    on_event: EventSink

    async def delegate(
        self, call: Delegation, parent: Parent | None, board: TaskBoard | None = None
    ) -> MultiRunResult: ...

    async def start_background(self, call: Delegation, board: TaskBoard) -> list[TaskHandle]: ...

    def refresh_agents(self) -> AgentCatalog: ...

    def workflow_names(self) -> list[str]: ...


def board_tools(
    runner: Delegator,
    parent: Parent,
    workspace: Workspace,
    board: TaskBoard | None = None,
    *,
    forked: bool = False,
    speak_up: Send | None = None,
) -> dict[str, Tool]:
    """The tools on an agent's `board` (its task registry): for an agent whose file grants `subagent`
    and that runs above the depth limit, `subagent` and the four task tools (`task_status`,
    `task_output`, `task_send`, `task_cancel`); for one with `bash`, a `bash` that starts background
    commands on the board, and the task tools that apply to commands. A fork's (`forked`) are
    listed as its parent's, so its prompt keeps its parent's prefix, but refuse to delegate.
    A child with tools also gets `parent_send`, its messages going through `speak_up` (a fork has it
    where its caller does, the caller being a child too).

    While its children run in the foreground, the parent lends its process slot (and writer lease) to them.
    """
    granted = parent.spec.tools
    board = board or TaskBoard(workspace, on_event=runner.on_event, parent=parent)
    tools: dict[str, Tool] = {}
    if "bash" in granted:
        # In the sandbox `make_tools` gives a foreground `bash`: writing in this workspace (a worktree's, say).
        sandbox = parent.sandbox.within(workspace.root) if parent.sandbox is not None else None
        tools["bash"] = BashTool(workspace, sandbox, tasks=board)
    # The recursion cut: no `subagent` at the depth limit (nor with --max-depth 0), rather than a
    # tool every call of which is refused.
    delegates = "subagent" in granted and (forked or parent.depth < runner.options.max_depth)
    if delegates:
        tools["subagent"] = subagent_tool(runner, parent, workspace, board, forked=forked)
    if delegates or "bash" in granted:
        tools.update(make_background_tools(workspace, board, sub_agents=delegates))
    if granted and parent.depth >= (2 if forked else 1):
        tools["parent_send"] = ParentSendTool(workspace, speak_up)
    return tools


def subagent_tool(
    runner: Delegator, parent: Parent, workspace: Workspace, board: TaskBoard, *, forked: bool
) -> SubagentTool:
    """The `subagent` tool of `parent`: its children run through `runner` (waited for, or on `board`)."""

    async def delegate(call: Delegation) -> MultiRunResult:
        async with lend():
            return await runner.delegate(call, parent, board)

    async def start(call: Delegation) -> list[str]:
        return [h.id for h in await runner.start_background(call, board)]

    granted = parent.spec.agents
    agents = {n: a.description for n, a in runner.catalog.agents.items() if granted is None or n in granted}
    models = runner.preparer.offered_models(parent)

    def list_models() -> str:
        listed = [n for n in agents if n != parent.spec.name]
        runs_on = runner.preparer.runs_on(parent, listed)
        return describe_models(runner.preparer.granted_models(parent), runner.preparer.hosts, runs_on)

    return SubagentTool(
        workspace,
        delegate=delegate,
        agents=agents,
        caller=parent.spec.name,
        depth=parent.depth,
        max_depth=runner.options.max_depth,
        start=start,
        known=lambda: runner.refresh_agents().agents,
        warnings=runner.catalog.all_warnings(),
        concurrency=runner.options.concurrency,
        workflows=runner.workflow_names(),
        background_agents=[n for n, a in runner.catalog.agents.items() if a.background],
        # `isolation` is offered inside a git repository only (every field costs a small model's context)
        isolation=repository_root(workspace.root) is not None,
        forked=forked,
        models=models,
        list_models=list_models,  # the run's own models are granted even where the schema names none
        # `thinking` is offered where the caller's model thinks (its children run on it unless named)
        thinking=parent.task is not None and parent.task.host.thinks,
    )
