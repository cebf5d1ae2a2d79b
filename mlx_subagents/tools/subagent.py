"""`subagent`: the tool a parent agent delegates with (one task, parallel tasks or a chain).

The tool validates the call and formats the children's answers; running them is the caller's
`delegate` function (the runner's), so this module never reaches up a layer. Every problem - no
mode, two modes, an empty task, an unknown agent, a cap, the depth limit - comes back to the model
as an error result naming the forms and the agents, and the parent carries on.

The recursion cut lives in two places: a session gets this tool only when its agent file names
`subagent`, and a session at `max_depth` gets an error result instead of children.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..caps import MAX_ANSWER_BYTES, MAX_CONCURRENCY, MAX_TASKS, MAX_WARNINGS, cap_answer
from ..errors import SubagentError, ToolError
from ..host.protocol import Message
from ..results import MultiRunResult, RunResult
from ..text import NO_ANSWER, one_line
from ..userfiles import error_message, error_path
from .base import Tool, ToolResult, _strip_titles, error_result, tool_failure
from .workspace import Workspace

DelegationMode = Literal["single", "parallel", "chain", "workflow"]
READ_MORE = 'read the rest with subagent_output {{"id": "{id}", "offset": {{offset}}}}'

FORMS = (
    "use exactly one of these forms: "
    '{"agent": "NAME", "task": "TEXT"} for one task; '
    f'{{"tasks": [{{"agent": "NAME", "task": "TEXT"}}, ...]}} for up to {MAX_TASKS} independent tasks in parallel; '
    '{"chain": [{"agent": "NAME", "task": "TEXT"}, ...]} for steps in order, where {previous} in a task is '
    "the previous step's answer; "
    '{"workflow": "NAME", "input": "TEXT"} for a named workflow on an input'
)


MAX_LABEL_CHARS = 60
# Short descriptions: every item of `tasks` and `chain` repeats them in the schema the model reads.
Label = Annotated[str, Field(default="", max_length=MAX_LABEL_CHARS, description="Its name in the result.")]


Isolation = Annotated[
    Literal["", "none", "worktree"],
    Field(default="", description="worktree: its own git worktree and branch, to run beside other writers."),
]


# No docstrings on the parameter models: pydantic would put them in the schema the model reads.
class ChildTask(BaseModel):  # one task of a parallel call or a chain step (a single call takes the same fields)
    model_config = ConfigDict(extra="forbid")

    agent: str = Field(default="", description="The agent's name.")
    task: str = Field(description="What it should do, with every path and detail it needs.")
    label: Label
    fork: bool = False  # described once, at the top (every item repeats its schema)
    cwd: str = Field(default="", description="Its folder in the workspace.")
    model: str = Field(default="", description="A local model for it.")
    max_turns: Optional[int] = Field(default=None, gt=0, description="Fewer turns than its limit.")
    timeout: Optional[float] = Field(default=None, gt=0, description="Fewer seconds than its limit.")
    isolation: Isolation


class SubagentParams(BaseModel):  # flat: a small model fills in optional fields more reliably than a union
    model_config = ConfigDict(extra="forbid")

    agent: str = Field(default="", description="One task: the agent to run.")
    task: str = Field(default="", description="One task: what it should do, with every detail it needs.")
    label: Label
    fork: bool = Field(default=False, description="You, with this conversation so far, do it (no agent; any form).")
    tasks: list[ChildTask] = Field(default_factory=list, description=f"Parallel: up to {MAX_TASKS} independent tasks.")
    chain: list[ChildTask] = Field(
        default_factory=list, description="Chain: steps run in order; {previous} in a task is the previous answer."
    )
    workflow: str = Field(default="", description="Workflow: a named workflow to run.")
    input: str = Field(default="", description="Workflow: its input.")
    cwd: str = Field(
        default="", description="A folder inside the workspace for the sub-agents (default: the workspace)."
    )
    background: bool = Field(
        default=False,
        description="Return task ids at once; a notice comes at each end (default: as the agent's file says).",
    )
    isolation: Isolation

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, value: Any) -> Any:
        # Models often write `"tasks": null` for a mode they do not use.
        return {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value


@dataclass(frozen=True)
class ForkPoint:
    """Where a call's forks start: the caller's host session (whose KV cache they start from) and its
    messages, each call of its last reply closed with a placeholder (`fork_point`)."""

    session: str
    messages: tuple[Message, ...]


@dataclass(frozen=True)
class Delegation:
    """One valid call, for the runner: the mode, its tasks in order and the children's workspace.

    Args:
        workspaces: per task, its own folder (its `cwd`, else the call's); empty: `workspace` for all.
        workflow, input: a workflow call's workflow name and input (its steps are the runner's to plan).
        isolation: the call's `isolation` (a task's own wins): `worktree`, `none`, or "" for the agent's.
        fork_point: for a call with forks, where they start: the caller's host session and messages.
    """

    mode: DelegationMode
    tasks: tuple[ChildTask, ...]
    workspace: Workspace
    background: bool = False
    workspaces: tuple[Workspace, ...] = ()
    workflow: str = ""
    input: str = ""
    isolation: str = ""
    fork_point: ForkPoint | None = None

    @property
    def forks(self) -> bool:
        """Whether any of its tasks is a fork (it then carries the caller's `fork_point`)."""
        return any(t.fork for t in self.tasks)

    def workspace_of(self, index: int) -> Workspace:
        """The folder task `index` works in."""
        return self.workspaces[index] if self.workspaces else self.workspace


Delegate = Callable[[Delegation], Awaitable[MultiRunResult]]
# Starts a `"background": true` call's tasks and returns their ids at once.
Start = Callable[[Delegation], Awaitable[list[str]]]


class SubagentTool(Tool):
    """Runs other agents as children of this session.

    Args:
        delegate: runs a `Delegation` (the runner binds the caller's label and depth).
        agents: the agents the caller may start (its `agents:` grant), name -> description: the
            list the model reads, so that a small model never picks one it would be refused.
        caller: the calling agent's name; left out of the list the model sees.
        depth: how many parents the calling session has (0: started by a person).
        max_depth: children may run at depth `max_depth` at most; a call from there is refused.
        start: starts `"background": true` calls on the parent's board; None: refused.
        known: every agent the runner knows at the time of a call (default: `agents`); a name
            outside it is unknown, one inside it but not granted is refused by the runner.
        warnings: the agent-file warnings, the first `MAX_WARNINGS` of them in the description.
        concurrency: how many of a call's tasks run at once (`--concurrency`).
        workflows: the names of the workflows a call may run, for the description.
        isolation: whether `isolation` is offered (the workspace is in a git repository).
        background_agents: agents whose files say `background: true` (see `parse_delegation`).
        forked: the calling session is itself a fork: every call gets an error result, while the
            tool stays listed so that the fork's prompt keeps its parent's prefix.
    """

    name = "subagent"
    description = "Delegate a task to a sub-agent."
    Params = SubagentParams
    read_only = False
    writes = False
    # Claude Code grants it as `Task(scout, worker)` (newer: `Agent(...)`), naming the agents it may start.
    claude_names = ("Task", "Agent")
    # Several subagent calls in one reply run at once, like the tasks of one call.
    concurrent = True

    def __init__(
        self,
        workspace: Workspace,
        *,
        delegate: Delegate,
        agents: Mapping[str, str],
        caller: str = "",
        depth: int = 0,
        max_depth: int = 2,
        start: Start | None = None,
        known: Callable[[], Collection[str]] | None = None,
        warnings: Sequence[str] = (),
        concurrency: int = MAX_CONCURRENCY,
        workflows: Sequence[str] = (),
        background_agents: Collection[str] = (),
        isolation: bool = False,
        forked: bool = False,
    ) -> None:
        super().__init__(workspace)
        self.forked = forked
        # The calling session's messages and host session, bound by the session (`AgentSession`):
        # what a fork starts from.
        self.conversation: Callable[[], Sequence[Message]] | None = None
        self.host_session = ""
        # Without `start` nothing runs in the background: such an agent's calls wait instead.
        self.background_agents = frozenset(background_agents) if start is not None else frozenset()
        self.delegate = delegate
        self.agents = dict(sorted(agents.items()))
        self.caller = caller
        self.depth = depth
        self.max_depth = max_depth
        self.start = start
        self.known = known or (lambda: self.agents)
        self.workflows = tuple(workflows)
        self.isolation = isolation
        listed = {n: d for n, d in self.agents.items() if n != caller}
        self.description = describe_delegation(  # type: ignore[misc]
            listed, background=start is not None, warnings=warnings, concurrency=concurrency, workflows=workflows
        )

    def schema(self) -> dict[str, Any]:  # type: ignore[override]
        """Per instance: the description lists this runner's agents; `background` only where it works."""
        parameters = delegation_schema(
            background=self.start is not None, workflows=bool(self.workflows), isolation=self.isolation
        )
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": parameters},
        }

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        try:
            return await self._call(arguments)
        except Exception as exc:  # the boundary, as in `Tool.call`: never a crash of the parent
            return tool_failure(self.name, exc, self.workspace)

    async def _call(self, arguments: dict[str, Any]) -> ToolResult:
        if self.forked:
            return error_result(f"{self.name}: a fork does its task itself; use your other tools and answer")
        if self.depth >= self.max_depth:
            return error_result(
                f"delegation refused: this agent already runs at depth {self.depth} and the limit is "
                f"{self.max_depth} (max_depth); do the task yourself with your other tools"
            )
        try:
            delegation = parse_delegation(
                arguments,
                self.workspace,
                self.known(),
                tool=self.name,
                listed=self.agents,
                background_agents=self.background_agents,
            )
        except ToolError as exc:
            return error_result(str(exc))
        if delegation.forks:
            if self.conversation is None:
                return error_result(f"{self.name}: forks are not available here; name an agent instead")
            point = ForkPoint(self.host_session, fork_point(self.conversation()))
            delegation = replace(delegation, fork_point=point)
        if delegation.background:
            return await self._start(delegation)
        try:
            outcome = await self.delegate(delegation)
        except SubagentError as exc:  # a cap, a label clash, a project agent not allowed
            return error_result(f"{self.name} call refused: {exc}")
        return format_outcome(delegation, outcome)

    async def _start(self, delegation: Delegation) -> ToolResult:
        """A background call: the new tasks' ids at once, and what the parent can do with them."""
        if self.start is None:
            return error_result(
                f'{self.name}: "background": true is not available here; call it without background and wait'
            )
        try:
            ids = await self.start(delegation)
        except SubagentError as exc:  # a cap, a label clash, an agent not granted
            return error_result(f"{self.name} call refused: {exc}")
        return ToolResult(
            f"Started in the background: {', '.join(ids)}. Carry on with other work; a notice comes when each "
            "ends. subagent_status shows how they are doing, subagent_output reads an answer (wait to block until "
            "it ends), subagent_send steers one, subagent_cancel stops one."
        )

    def describe(self, arguments: dict[str, Any]) -> str:
        """`subagent scout: <task>`, `subagent parallel: scout, reviewer`, `subagent chain: scout -> planner`."""

        def names(items: Any) -> list[str]:
            named = [str(i.get("agent") or ("fork" if i.get("fork") else "?")) for i in items if isinstance(i, dict)]
            return named if isinstance(items, list) else []

        name = "subagent (background)" if arguments.get("background") is True else "subagent"
        if arguments.get("tasks"):
            return f"{name} parallel: {', '.join(names(arguments['tasks']))}"
        if arguments.get("chain"):
            return f"{name} chain: {' -> '.join(names(arguments['chain']))}"
        if arguments.get("agent") or arguments.get("fork") is True:
            return f"{name} {arguments.get('agent') or 'fork'}: {one_line(str(arguments.get('task', '')), 80)}"
        if arguments.get("workflow"):
            return f"{name} workflow {arguments['workflow']}: {one_line(str(arguments.get('input', '')), 80)}"
        return f"{name} (no task)"


def delegation_schema(
    *, background: bool, workflows: bool = False, isolation: bool = False, forks: bool = True
) -> dict[str, Any]:
    """The call's parameters as JSON schema: the forms and `cwd`; `background` where it works, the
    workflow form where named workflows exist, `isolation` inside a git repository and `fork` where a
    calling agent's conversation exists to continue (every field costs a small model's context).

    The `subagent` tool and the MCP server's `run_agents` and `start_agents` take these forms."""
    parameters = _inline_refs(_strip_titles(SubagentParams.model_json_schema()))
    absent = ([] if background else ["background"]) + ([] if workflows else ["workflow", "input"])
    for name in absent:
        del parameters["properties"][name]
    every = (parameters, parameters["properties"]["tasks"]["items"], parameters["properties"]["chain"]["items"])
    for name, offered in (("isolation", isolation), ("fork", forks)):
        if not offered:
            for fields in every:
                fields["properties"].pop(name, None)
    return parameters


def parse_delegation(
    arguments: dict[str, Any],
    workspace: Workspace,
    agents: Collection[str],
    *,
    tool: str = "subagent",
    listed: Collection[str] | None = None,
    background_agents: Collection[str] = (),
) -> Delegation:
    """A call's `Delegation`, or `ToolError` with what the caller reads: what is wrong, the forms
    and the agents (`invalid TOOL call: ...`), or the `cwd` that is not a folder of the workspace.

    Args:
        agents: the agents a call may name (a parallel task's unknown agent fails alone, later).
        tool: the name the caller knows the call by, for its messages.
        listed: the agents the messages name (default: `agents`): those the caller may start.
        background_agents: agents whose files say `background: true`: a call without `background`
            whose every task starts one runs in the background (the call site wins when it says).
    """
    names = agents if listed is None else listed
    try:
        params = SubagentParams.model_validate(arguments)
        mode, items = _mode(params, agents)
    except ValidationError as exc:
        raise ToolError(_usage(tool, _validation_problem(exc), names)) from None
    except ToolError as exc:
        raise ToolError(_usage(tool, str(exc), names)) from None
    where = "" if mode == "single" else ("tasks" if mode == "parallel" else "chain")
    call_root = _folder(workspace, params.cwd, "cwd", workspace.root)
    roots = [_folder(workspace, t.cwd, f"{where}[{i}].cwd", call_root) for i, t in enumerate(items)]
    background = params.background
    if "background" not in params.model_fields_set:
        background = bool(items) and all(t.agent.strip() in background_agents for t in items)
    return Delegation(
        mode,
        tuple(items),
        Workspace(call_root),
        background=background,
        workspaces=tuple(Workspace(r) for r in roots),
        workflow=params.workflow.strip(),
        input=params.input,
        isolation=params.isolation,
    )


def _folder(workspace: Workspace, cwd: str, field: str, default: Path) -> Path:
    """A `cwd` of the call or of one task: a folder inside the workspace, else `default`."""
    try:
        return workspace.existing(cwd, "directory") if cwd.strip() else default
    except ToolError as exc:
        raise ToolError(f"{field}: {exc}") from None


def _mode(params: SubagentParams, agents: Collection[str]) -> tuple[DelegationMode, list[ChildTask]]:
    single = bool(params.agent.strip() or params.task.strip() or params.fork)
    if params.fork and (params.tasks or params.chain or params.workflow.strip()):
        raise ToolError("'fork' at the top goes with 'task' only; in 'tasks' or 'chain', set it in the item")
    forms = (
        ("single", single),
        ("parallel", bool(params.tasks)),
        ("chain", bool(params.chain)),
        ("workflow", bool(params.workflow.strip())),
    )
    given = [mode for mode, present in forms if present]
    if not given:
        raise ToolError("'input' is given without 'workflow'" if params.input.strip() else "no task given")
    if len(given) > 1:
        fields = {"single": "agent/task", "parallel": "tasks", "chain": "chain", "workflow": "workflow"}
        raise ToolError(f"{' and '.join(fields[m] for m in given)} given together")
    mode: DelegationMode = given[0]  # type: ignore[assignment]
    if params.input.strip() and mode != "workflow":
        raise ToolError("'input' goes with 'workflow' only")
    if mode == "workflow":
        return mode, []
    if mode == "single":
        items = [ChildTask(agent=params.agent, task=params.task, label=params.label, fork=params.fork)]
    elif mode == "parallel":
        items = list(params.tasks)
    else:
        items = list(params.chain)
    for i, item in enumerate(items):
        where = "" if mode == "single" else f"{mode if mode == 'chain' else 'tasks'}[{i}]."
        if item.fork:
            _check_fork(item, where, chain_step=i if mode == "chain" else 0, isolation=params.isolation)
            continue
        if not item.agent.strip():
            raise ToolError(f"'{where}agent' is empty")
        # In parallel, a child that cannot start fails alone (the runner says why); its siblings run.
        if mode != "parallel" and item.agent.strip().lower() not in agents:
            raise ToolError(f"unknown agent '{item.agent}'")
        if not item.task.strip():
            raise ToolError(f"'{where}task' is empty: say what {item.agent} should do")
    return mode, items


FORK_PLACEHOLDER = "(forked: a copy of this conversation does this call's task)"


def _check_fork(item: ChildTask, where: str, chain_step: int, isolation: str = "") -> None:
    """A fork continues its caller: its prompt and model are the caller's, so that the caller's KV
    cache serves it; naming others would start it cold, which a named agent does better. It works in
    its caller's tree, so `isolation: worktree` (its own, or the call's) is refused, never ignored."""
    if item.agent.strip() or item.model.strip():
        named = "an agent" if item.agent.strip() else "a model"
        raise ToolError(
            f"'{where}fork' names {named}: a different prompt or model cannot reuse this conversation's cache; "
            "leave out agent and model, or start a named agent without fork"
        )
    if chain_step:
        raise ToolError(f"'{where}fork': only a chain's first step may be a fork")
    if "worktree" in (item.isolation, isolation):
        raise ToolError(
            f"'{where}fork': a fork works in its caller's workspace, so isolation: worktree cannot apply; leave out "
            "isolation, or start a named agent with it"
        )
    if not item.task.strip():
        raise ToolError(f"'{where}task' is empty: say what the fork should do")


def fork_point(messages: Sequence[Message]) -> tuple[Message, ...]:
    """The caller's conversation at a fork: its messages so far, each call of its last reply that has
    no result yet closed with a short placeholder, so that the fork's prompt extends them exactly."""
    out = [dict(m) for m in messages]
    answered = {m.get("tool_call_id") for m in out if m.get("role") == "tool"}
    last = next((m for m in reversed(out) if m.get("role") == "assistant"), None)
    for part in (last or {}).get("tool_calls") or []:
        call_id = part.get("id")
        if call_id not in answered:
            name = (part.get("function") or {}).get("name", "")
            out.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": FORK_PLACEHOLDER})
    return tuple(out)  # type: ignore[arg-type]


def _usage(tool: str, problem: str, agents: Collection[str]) -> str:
    return f"invalid {tool} call: {problem}; {FORMS}. Available agents: {', '.join(sorted(agents)) or 'none'}"


def _inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """Replace `{"$ref": "#/$defs/X"}` by X itself: one self-contained object is easier to read."""
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, list):
            return [inline(item) for item in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
        return {key: inline(value) for key, value in node.items()}

    return inline(schema)


def _validation_problem(exc: ValidationError) -> str:
    problems = []
    for err in exc.errors():
        field = error_path(err["loc"]) or "arguments"
        if err["type"] == "extra_forbidden":
            problems.append(f"unknown field '{field}'")
        else:
            problems.append(f"'{field}': {error_message(err)}")
    return "; ".join(problems)


def describe_delegation(
    agents: Mapping[str, str],
    *,
    background: bool = False,
    warnings: Sequence[str] = (),
    concurrency: int = MAX_CONCURRENCY,
    workflows: Sequence[str] = (),
) -> str:
    """What the model reads about the tool: when to use it, its forms (the workflow form only where
    named workflows exist), the agents it may start, and the first agent-file warnings (a file the
    model expected and that did not load says why)."""
    listing = "\n".join(f"- {name}: {description}" for name, description in agents.items()) or "- (none)"
    notes = [f"- {w}" for w in warnings[:MAX_WARNINGS]]
    if len(warnings) > MAX_WARNINGS:
        notes.append(f"- ({len(warnings) - MAX_WARNINGS} more)")
    return (
        "Delegate work to a sub-agent. It starts with a fresh, empty context, works with its own tools, "
        "and returns only its final answer to you.\n"
        "Delegate when a job is bounded and self-contained (find where something is, review a file, plan a "
        "change, make one change), when doing it yourself would fill your context with file contents, or to "
        "run independent jobs in parallel. Do not delegate a step one tool call can do, and do not delegate "
        "what needs the conversation: the sub-agent sees only its task text, so put every path, name and goal "
        "in it.\n"
        "Use exactly one form:\n"
        '- {"agent": NAME, "task": TEXT}: one task.\n'
        f'- {{"tasks": [{{"agent": NAME, "task": TEXT}}, ...]}}: up to {MAX_TASKS} independent tasks, '
        f"{concurrency} at a time.\n"
        '- {"chain": [{"agent": NAME, "task": TEXT}, ...]}: steps in order; {previous} in a task is the '
        "previous step's answer.\n"
        + (
            f'- {{"workflow": NAME, "input": TEXT}}: a named workflow of steps on an input ({", ".join(workflows)}).\n'
            if workflows
            else ""
        )
        + (
            '"background": true (any form): carry on at once; use the ids with the subagent_* tools.\n'
            if background
            else ""
        )
        + f"Agents:\n{listing}"
        + ("\nAgent-file warnings:\n" + "\n".join(notes) if notes else "")
    )


# -- the result the parent reads ---------------------------------------------------------------------


def format_outcome(delegation: Delegation, outcome: MultiRunResult) -> ToolResult:
    """The children's answers (`_answers`), then the run they are saved as, to name to the user, and the
    ids that `subagent_send` continues them by."""
    # The ids of the children the parent may continue (on its board; an aborted one takes no more).
    ids = [i for i, r in zip(outcome.task_ids, outcome.results) if i and r.status != "aborted"]
    more = f"; subagent_send continues {', '.join(ids)}" if ids else ""
    footer = f"\n\n[sub-agent run {outcome.run_id}{more}]" if outcome.run_id else ""
    kept = [r.worktree.describe(r.label.rsplit(" > ", 1)[-1]) for r in outcome.results if r.worktree is not None]
    footer += "".join(f"\n{line}" for line in kept)
    result = _answers(delegation, outcome, len(footer))
    return ToolResult(result.output + footer, is_error=result.is_error)


def _answers(delegation: Delegation, outcome: MultiRunResult, reserve: int) -> ToolResult:
    """The child's answer; or one section per task; failed children marked, never hidden."""
    results = outcome.results
    if delegation.mode == "single":
        result = results[0]
        if result.ok:
            return ToolResult(result.output or NO_ANSWER)
        head = f"Error: agent '{result.agent}' {_status(result)}"
        return ToolResult(f"{head}\n\n{result.output}" if result.output else head, is_error=True)
    if delegation.mode == "parallel":
        labels = [r.label.rsplit(" > ", 1)[-1] for r in results]
        title = f"Parallel: {outcome.succeeded}/{outcome.total} tasks completed"
    elif delegation.mode == "workflow":
        labels = [f"{r.step_id}: {r.agent}" for r in results]
        title = f"Workflow {delegation.workflow}: {outcome.succeeded}/{outcome.total} steps completed"
    elif outcome.ok:
        return ToolResult(results[-1].output or NO_ANSWER)
    else:
        labels = [f"{i + 1}: {r.agent}" for i, r in enumerate(results)]
        title = f"Error: {outcome.error or 'the chain did not complete'}"
    heads = [f"### [{label}] {_status(r)}" for label, r in zip(labels, results)]
    bodies = [r.output or NO_ANSWER for r in results]
    ids = outcome.task_ids or [None] * len(results)
    notes = [READ_MORE.format(id=i) if i else None for i in ids]
    bodies = fit_answers(bodies, [r.transcript for r in results], title, heads, reserve, notes)
    sections = [f"{head}\n{body}" for head, body in zip(heads, bodies)]
    return ToolResult("\n\n".join([title, *sections]), is_error=not outcome.ok)


def _status(result: RunResult) -> str:
    if result.ok:
        return "completed"
    return f"{result.status} ({result.stop_reason}): {result.error or 'no reason given'}"


def fit_answers(
    bodies: list[str],
    transcripts: list[str | None],
    title: str,
    heads: list[str],
    reserve: int,
    read_more: list[str | None] | None = None,
) -> list[str]:
    """Cut the longest bodies so the whole result (and `reserve` bytes more) stays under `MAX_ANSWER_BYTES`.

    Short bodies are kept whole; the room left is shared equally by the long ones (water-filling).

    Args:
        read_more: per body, how the parent reads the rest of a cut one (see `caps.cap_answer`).
    """
    sizes = [len(b.encode("utf-8", "surrogatepass")) for b in bodies]
    fixed = (
        reserve
        + len(title.encode("utf-8", "surrogatepass"))
        + sum(len(h.encode("utf-8", "surrogatepass")) + 3 for h in heads)
    )
    if fixed + sum(sizes) <= MAX_ANSWER_BYTES:
        return bodies
    room = MAX_ANSWER_BYTES - fixed
    order = sorted(range(len(bodies)), key=sizes.__getitem__)
    limits: dict[int, int] = {}
    for k, i in enumerate(order):
        share = room // (len(order) - k)
        if sizes[i] <= share:
            room -= sizes[i]
            continue
        for j in order[k:]:
            limits[j] = share
        break
    notes = read_more or [None] * len(bodies)
    return [
        cap_answer(b, transcripts[i], limits[i], read_more=notes[i]) if i in limits else b for i, b in enumerate(bodies)
    ]
