"""A delegated call planned once: the tasks of a `subagent` call (or MCP's `run_agents` and
`start_agents`, or a chat's `/workflow`), their order, where each works, and the ids they hold on the
parent's board, for the foreground and the background alike.

`plan_call` turns a `Delegation` into a `CallPlan`: a workflow's steps (named or inline) or the call's
tasks with the choices each may make, a chain's `{previous}` planned, each task labelled
`parent > id` by the id it reserves on its parent's board (its label, else `agent#N`). The runner
then prepares the plan's tasks and runs them, waiting (`Runner.delegate`) or not
(`Runner.start_background`); `plan_tasks` plans a background start that comes with its own tasks
(`Runner.start`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..results import Mode
from ..tools import Workspace
from ..tools.delegation import ChildTask, Delegation, ForkPoint
from .tasks import Steps, TaskSpec, label_tasks, plan_chain
from .workflow import INLINE, Workflow, check_agents, find_workflow, inline_workflow, load_workflow, plan_workflow

if TYPE_CHECKING:
    from ..agents.discovery import AgentCatalog
    from .board import TaskBoard
    from .prepared import Parent


@dataclass(frozen=True)
class CallPlan:
    """A delegated request, planned: its tasks labelled and in order, where each works, and its ids.

    Args:
        workspaces: per task, the folder it works in.
        shared_input: text every task receives besides its own (a workflow's input).
        ids: the ids its tasks hold on the parent's board, reserved now (None: it has no board); whoever
            runs the plan gives back the unused ones (`TaskBoard.release`).
        fork_point: where its forks start (the caller's host session and messages).
    """

    mode: Mode
    tasks: list[TaskSpec]
    steps: Steps
    workspaces: list[Workspace]
    shared_input: str = ""
    ids: list[str] | None = None
    fork_point: ForkPoint | None = None


def plan_call(
    call: Delegation,
    catalog: AgentCatalog,
    cwd: Path,
    *,
    parent: Parent | None,
    board: TaskBoard | None,
    background: bool = False,
) -> CallPlan:
    """A call's plan; a workflow is checked as `subagent workflow` checks one (its file or inline steps,
    its graph, its agents), and a background call's tasks must fit the board's cap, before any id is held.

    Args:
        parent: the calling session (None: a call from outside the runner, an MCP client's).
        board: where the children are held under ids (None: nowhere, and they are labelled as any task).
    """
    if call.mode == "workflow":
        tasks, steps = plan_workflow(call_workflow(call, catalog, cwd), call.input)
        inline = [step_choices(t) for t in call.tasks] if call.steps else [{}] * len(tasks)
        tasks = [replace(t, isolation=call.isolation or t.isolation, **c) for t, c in zip(tasks, inline)]
        given = [""] * len(tasks)  # a step's name is its step id; its task id is `agent#N`
        places = [call.workspace] * len(tasks)
    else:
        asked = call_tasks(call)
        given = [t.label.strip() for t in asked]
        tasks, steps = label_tasks(asked), Steps()
        if call.mode == "chain":
            tasks, steps = plan_chain(tasks)
        places = [call.workspace_of(i) for i in range(len(tasks))]
    mode = "workflow" if call.mode == "workflow" else call.mode
    plan = CallPlan(mode, tasks, steps, places, call.input if mode == "workflow" else "", None, call.fork_point)  # type: ignore[arg-type]
    return hold_ids(plan, given, parent=parent, board=board, background=background)


def plan_tasks(tasks: Sequence[TaskSpec], board: TaskBoard) -> CallPlan:
    """A background start of tasks a caller gives (`Runner.start`), on `board`."""
    asked = [replace(t, agent=t.agent.strip().lower(), label=t.label.strip()) for t in tasks]
    plan = CallPlan("parallel", asked, Steps(), [board.workspace] * len(asked))
    return hold_ids(plan, [t.label for t in asked], parent=board.parent, board=board, background=True)


def hold_ids(
    plan: CallPlan, given: list[str], *, parent: Parent | None, board: TaskBoard | None, background: bool
) -> CallPlan:
    """The plan with ids reserved on `board` (background tasks within its cap) and each task labelled by
    its id: `parent > id` (a top-level background task: its id)."""
    if board is None:
        if parent is None:
            return plan
        return replace(plan, tasks=[replace(t, label=f"{parent.label} > {t.label}") for t in plan.tasks])
    if background:
        board.check_room(len(plan.tasks))
    ids = board.reserve_ids(["fork" if t.fork else t.agent for t in plan.tasks], given)
    tasks = [replace(t, label=f"{parent.label} > {i}" if parent else i) for t, i in zip(plan.tasks, ids)]
    return replace(plan, tasks=tasks, ids=ids)


def call_workflow(call: Delegation, catalog: AgentCatalog, cwd: Path) -> Workflow:
    """The workflow a call runs, checked as `subagent workflow` checks one: an inline one's steps
    (`steps`: names, graph, agents), or a named one's file, graph and agents."""
    if call.steps:
        workflow = inline_workflow([s.model_dump() for s in call.steps])
        check_agents(workflow, catalog, where=INLINE)
        return workflow
    workflow = load_workflow(find_workflow(call.workflow, cwd, named=True))  # by name: never a path
    check_agents(workflow, catalog)
    return workflow


def call_tasks(call: Delegation) -> list[TaskSpec]:
    """A call's tasks with the choices each may make (`task_choices`)."""
    return [TaskSpec(agent=t.agent, task=t.task, label=t.label, **task_choices(call, t)) for t in call.tasks]


def task_choices(call: Delegation, task: ChildTask) -> dict[str, Any]:
    """What a call's task chooses for itself: model, turns, time, isolation (its own, else the call's),
    fork, and its `step_choices`."""
    return {
        "model": task.model.strip() or None,
        "max_turns": task.max_turns,
        "timeout": task.timeout,
        "isolation": None if task.fork else task.isolation or call.isolation or None,
        "fork": task.fork,
        **step_choices(task),
    }


def step_choices(task: ChildTask) -> dict[str, Any]:
    """What any task or step of a call (an inline workflow's too) chooses beyond its workflow step's
    fields: its answer's schema, its tools, an addition to its system prompt, its thinking, one reply."""
    return {
        "schema": task.output_schema,
        "allowed_tools": tuple(t.strip() for t in task.allowed_tools) if task.allowed_tools is not None else None,
        "system_prompt": task.system_prompt.strip(),
        "thinking": task.thinking,
        "single_shot": task.single_shot,
    }
