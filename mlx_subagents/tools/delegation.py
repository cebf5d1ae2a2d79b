"""What a `subagent` call says: its forms and fields (the JSON schema the model reads), and the one
parser of them, `parse_delegation`, shared by the `subagent` tool, MCP's `run_agents` and `start_agents`
and the chat's `/workflow`.

The forms: one task, parallel `tasks`, a `chain`, an inline workflow's `steps`, a named `workflow`,
and `models` (what the caller may name). A `Delegation` is a valid call for the runner; a bad one is a
`ToolError` whose one line names the problem, the forms (the named-workflow form only where named
workflows exist) and the agents.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..caps import MAX_TASK_CHARS, MAX_TASKS
from ..errors import ToolError
from ..host.protocol import Message
from ..userfiles import error_message, error_path, read_text
from .base import _strip_titles
from .workspace import Workspace

DelegationMode = Literal["single", "parallel", "chain", "workflow", "models"]
# A task file's text is a task: capped at the task cap later; no more than this is read.
MAX_TASK_FILE_BYTES = 4 * MAX_TASK_CHARS
READ_MORE = 'read the rest with task_output {{"id": "{id}", "offset": {{offset}}}}'


def forms(*, workflows: bool = True) -> str:
    """The forms a call takes, for its error lines: the named-workflow form only where `workflows` exist."""
    named = '; {"workflow": "NAME", "input": "TEXT"} for a named workflow on an input' if workflows else ""
    return (
        "use exactly one of these forms: "
        '{"agent": "NAME", "task": "TEXT"} for one task; '
        f'{{"tasks": [{{"agent": "NAME", "task": "TEXT"}}, ...]}} for up to {MAX_TASKS} independent tasks in parallel; '
        '{"chain": [{"agent": "NAME", "task": "TEXT"}, ...]} for steps in order, where {previous} in a task is '
        "the previous step's answer; "
        '{"steps": [{"name": "N", "agent": "NAME", "task": "TEXT", "needs": ["M"]}, ...]} for steps that start '
        "when the steps they need are done, where {M} in a task is step M's answer" + named
    )


FORMS = forms()


MAX_LABEL_CHARS = 60
# Short descriptions: every item of `tasks` and `chain` repeats them in the schema the model reads.
Label = Annotated[str, Field(default="", max_length=MAX_LABEL_CHARS, description="Its name in the result.")]


Isolation = Annotated[
    Literal["", "none", "worktree"],
    Field(default="", description="worktree: its own git worktree and branch, to run beside other writers."),
]


# No docstrings on the parameter models: pydantic would put them in the schema the model reads.
class Choices(BaseModel):  # what any task or step may choose for itself (`CHOICES`), described at the top
    task_file: str = ""
    output_schema: Optional[dict[str, Any]] = None
    allowed_tools: Optional[list[str]] = None
    system_prompt: str = ""
    thinking: Optional[int] = Field(default=None, ge=0)
    single_shot: bool = False


class ChildTask(Choices):  # one task of a parallel call or a chain step (a single call takes the same fields)
    model_config = ConfigDict(extra="forbid")

    agent: str = Field(default="", description="The agent's name.")
    task: str = Field(default="", description="What it should do, with every path and detail it needs.")
    label: Label
    fork: bool = False  # described once, at the top (every item repeats its schema), as are the rest
    cwd: str = Field(default="", description="Its folder in the workspace.")
    model: str = Field(default="", description="A local model for it.")
    max_turns: Optional[int] = Field(default=None, gt=0, description="Fewer turns than its limit.")
    timeout: Optional[float] = Field(default=None, gt=0, description="Fewer seconds than its limit.")
    isolation: Isolation


class StepTask(Choices):  # one step of an inline workflow (`steps`); the top's `steps` says what they are
    model_config = ConfigDict(extra="forbid")

    name: str
    agent: str
    task: str = ""
    needs: list[str] = Field(default_factory=list, description="Names of the steps it waits for.")
    model: str = ""
    max_turns: Optional[int] = Field(default=None, gt=0)
    timeout: Optional[float] = Field(default=None, gt=0)
    isolation: Literal["", "none", "worktree"] = ""


# What a task may choose for itself beyond its agent, model and limits: offered in every form (the
# top's descriptions say what each is), refused for a fork where it would change the caller's prefix.
CHOICES = ("task_file", "output_schema", "allowed_tools", "system_prompt", "thinking", "single_shot")

FORK_KEEPS = ("allowed_tools", "system_prompt", "thinking", "single_shot")


class SubagentParams(BaseModel):  # flat: a small model fills in optional fields more reliably than a union
    model_config = ConfigDict(extra="forbid")

    agent: str = Field(default="", description="One task: the agent to run.")
    task: str = Field(default="", description="One task: what it should do, with every detail it needs.")
    label: Label
    fork: bool = Field(default=False, description="You, with this conversation so far, do it (no agent; any form).")
    model: str = Field(default="", description="A local model for it.")
    max_turns: Optional[int] = Field(default=None, gt=0, description="Fewer turns than its limit.")
    timeout: Optional[float] = Field(default=None, gt=0, description="Fewer seconds than its limit.")
    task_file: str = Field(default="", description="A file whose text is the task.")
    output_schema: Optional[dict[str, Any]] = Field(default=None, description="A JSON schema its answer must match.")
    allowed_tools: Optional[list[str]] = Field(default=None, description="Only these of its tools ([]: none).")
    system_prompt: str = Field(default="", description="Added to its system prompt.")
    thinking: Optional[int] = Field(default=None, ge=0, description="Fewer thinking tokens (0: off).")
    single_shot: bool = Field(default=False, description="One reply, no tools.")
    tasks: list[ChildTask] = Field(default_factory=list, description=f"Parallel: up to {MAX_TASKS} independent tasks.")
    chain: list[ChildTask] = Field(
        default_factory=list, description="Chain: steps run in order; {previous} in a task is the previous answer."
    )
    steps: list[StepTask] = Field(
        default_factory=list, description="Workflow: a step starts once its needs are done; {name} is its answer."
    )
    workflow: str = Field(default="", description="Workflow: a named workflow to run.")
    input: str = Field(default="", description="Workflow: its input.")
    models: bool = Field(default=False, description="List the models you may name.")
    cwd: str = Field(
        default="", description="A folder inside the workspace for the sub-agents (default: the workspace)."
    )
    background: bool = Field(
        default=False,
        description="Return task ids at once; their answers come as a notice (default: as the agent's file says).",
    )
    notify: Literal["", "all", "each"] = Field(default="", description="Background: one notice (all) or one per end.")
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
        steps: an inline workflow's steps (`tasks` holds each step's task too, for who reads agents).
        isolation: the call's `isolation` (a task's own wins): `worktree`, `none`, or "" for the agent's.
        fork_point: for a call with forks, where they start: the caller's host session and messages.
        notify: a background call's notices: `each` task's end is one, else one when all have ended.
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
    steps: tuple[StepTask, ...] = ()
    notify: str = ""

    @property
    def forks(self) -> bool:
        """Whether any of its tasks is a fork (it then carries the caller's `fork_point`)."""
        return any(t.fork for t in self.tasks)

    def workspace_of(self, index: int) -> Workspace:
        """The folder task `index` works in."""
        return self.workspaces[index] if self.workspaces else self.workspace


def delegation_schema(
    *,
    background: bool,
    workflows: bool = False,
    isolation: bool = False,
    forks: bool = True,
    models: Sequence[str] = (),
    thinking: bool = True,
) -> dict[str, Any]:
    """The call's parameters as JSON schema: the forms and `cwd`; `background` where it works, the
    named-workflow form where named workflows exist, `isolation` inside a git repository, `fork` where
    a calling agent's conversation exists to continue, `model` (and the `models` form) where models
    are granted, as an enum of their names, and `thinking` where a child's model thinks (every field
    costs a small model's context).

    The `subagent` tool and the MCP server's `run_agents` and `start_agents` take these forms."""
    parameters = _plain(_inline_refs(_strip_titles(SubagentParams.model_json_schema())))
    absent = ([] if background else ["background", "notify"]) + ([] if workflows else ["workflow"])
    absent += [] if models else ["models"]
    for name in absent:
        del parameters["properties"][name]
    properties = parameters["properties"]
    every = (parameters, properties["tasks"]["items"], properties["chain"]["items"], properties["steps"]["items"])
    for fields in every[1:]:  # an item's own fields first, then its choices (pydantic puts a base's first)
        fields["properties"] = {
            **{k: v for k, v in fields["properties"].items() if k not in CHOICES},
            **{k: v for k, v in fields["properties"].items() if k in CHOICES},
        }
    for name, offered in (("isolation", isolation), ("fork", forks), ("model", bool(models)), ("thinking", thinking)):
        if not offered:
            for fields in every:
                fields["properties"].pop(name, None)
    for fields in every if models else ():
        fields["properties"]["model"]["enum"] = ["", *models]
    return parameters


def parse_delegation(
    arguments: dict[str, Any],
    workspace: Workspace,
    agents: Collection[str],
    *,
    tool: str = "subagent",
    listed: Collection[str] | None = None,
    background_agents: Collection[str] = (),
    workflows: bool = True,
) -> Delegation:
    """A call's `Delegation`, or `ToolError` with what the caller reads: what is wrong, the forms
    and the agents (`invalid TOOL call: ...`), or the `cwd` that is not a folder of the workspace.

    Args:
        agents: the agents a call may name (a parallel task's unknown agent fails alone, later).
        tool: the name the caller knows the call by, for its messages.
        listed: the agents the messages name (default: `agents`): those the caller may start.
        background_agents: agents whose files say `background: true`: a call without `background`
            whose every task starts one runs in the background (the call site wins when it says).
        workflows: whether named workflows exist here (the error lines name that form only then).
    """
    names = agents if listed is None else listed
    try:
        params = _read_task_files(SubagentParams.model_validate(arguments), workspace)
        mode, items = _mode(params, agents)
    except ValidationError as exc:
        raise ToolError(_usage(tool, _validation_problem(exc), names, workflows)) from None
    except ToolError as exc:
        raise ToolError(_usage(tool, str(exc), names, workflows)) from None
    where = {"single": "", "parallel": "tasks", "chain": "chain"}.get(mode, "steps")
    call_root = _folder(workspace, params.cwd, "cwd", workspace.root)
    roots = [_folder(workspace, t.cwd, f"{where}[{i}].cwd", call_root) for i, t in enumerate(items)]
    background = params.background
    if "background" not in params.model_fields_set:
        background = bool(items) and all(t.agent.strip() in background_agents for t in items)
    if params.notify and not background:
        raise ToolError(_usage(tool, "'notify' goes with \"background\": true", names, workflows))
    return Delegation(
        mode,
        tuple(items),
        Workspace(call_root),
        background=background,
        workspaces=tuple(Workspace(r) for r in roots),
        workflow=params.workflow.strip(),
        input=params.input,
        isolation=params.isolation,
        steps=tuple(params.steps),
        notify=params.notify,
    )


def _folder(workspace: Workspace, cwd: str, field: str, default: Path) -> Path:
    """A `cwd` of the call or of one task: a folder inside the workspace, else `default`."""
    try:
        return workspace.existing(cwd, "directory") if cwd.strip() else default
    except ToolError as exc:
        raise ToolError(f"{field}: {exc}") from None


def _mode(params: SubagentParams, agents: Collection[str]) -> tuple[DelegationMode, list[ChildTask]]:
    single = bool(params.agent.strip() or params.task.strip() or params.fork)
    if params.fork and (params.tasks or params.chain or params.steps or params.workflow.strip()):
        raise ToolError("'fork' at the top goes with 'task' only; in 'tasks' or 'chain', set it in the item")
    forms = (
        ("single", single),
        ("parallel", bool(params.tasks)),
        ("chain", bool(params.chain)),
        ("steps", bool(params.steps)),
        ("workflow", bool(params.workflow.strip())),
        ("models", params.models),
    )
    given = [mode for mode, present in forms if present]
    if not given:
        raise ToolError("'input' is given without 'workflow'" if params.input.strip() else "no task given")
    fields = {"single": "agent/task", "parallel": "tasks", "chain": "chain", "steps": "steps"}
    if len(given) > 1:
        raise ToolError(f"{' and '.join(fields.get(m, m) for m in given)} given together")
    form = given[0]
    if params.input.strip() and form not in ("workflow", "steps"):
        raise ToolError("'input' goes with 'workflow' or 'steps' only")
    if form in ("workflow", "models"):
        return form, []  # type: ignore[return-value]
    if form == "single":
        fields = ("agent", "task", "label", "fork", "model", "max_turns", "timeout", *CHOICES)
        items = [ChildTask(**{k: getattr(params, k) for k in fields}, isolation=params.isolation)]
    elif form == "steps":
        items = [_step_task(step, i, agents) for i, step in enumerate(params.steps)]
        return "workflow", items
    else:
        items = list(params.tasks if form == "parallel" else params.chain)
    for i, item in enumerate(items):
        where = "" if form == "single" else f"{form if form == 'chain' else 'tasks'}[{i}]."
        if item.fork:
            _check_fork(item, where, chain_step=i if form == "chain" else 0, isolation=params.isolation)
            continue
        if not item.agent.strip():
            raise ToolError(f"'{where}agent' is empty")
        # In parallel, a child that cannot start fails alone (the runner says why); its siblings run.
        if form != "parallel" and item.agent.strip().lower() not in agents:
            raise ToolError(f"unknown agent '{item.agent}'")
        if not item.task.strip():
            raise ToolError(f"'{where}task' is empty: say what {item.agent} should do")
    return form, items  # type: ignore[return-value]


def _step_task(step: StepTask, index: int, agents: Collection[str]) -> ChildTask:
    """An inline workflow step as the task it runs (its graph is checked as a workflow file's, by the runner)."""
    where = f"steps[{index}]."
    for field in ("name", "agent", "task"):
        if not getattr(step, field).strip():
            raise ToolError(f"'{where}{field}' is empty")
    if step.agent.strip().lower() not in agents:
        raise ToolError(f"unknown agent '{step.agent}'")
    fields = ("agent", "task", "model", "max_turns", "timeout", "isolation", *CHOICES)
    return ChildTask(**{k: getattr(step, k) for k in fields}, label=step.name.strip()[:MAX_LABEL_CHARS])


Item = TypeVar("Item", SubagentParams, ChildTask, StepTask)  # what has a task and may have a task file


def _read_task_files(params: SubagentParams, workspace: Workspace) -> SubagentParams:
    """The call with each `task_file` read into its task: a file inside the workspace, whose text is
    the task (capped as any task is, later); one with both `task` and `task_file` is refused."""
    top = _task_from_file(params, workspace, "")
    lists = {
        name: [_task_from_file(item, workspace, f"{name}[{i}].") for i, item in enumerate(getattr(params, name))]
        for name in ("tasks", "chain", "steps")
    }
    return top.model_copy(update=lists)


def _task_from_file(item: Item, workspace: Workspace, where: str) -> Item:
    if not item.task_file.strip():
        return item
    if item.task.strip():
        raise ToolError(f"'{where}task' and '{where}task_file' given together; give one of them")
    try:
        path = workspace.existing(item.task_file, "file")
        text = read_text(path, "task file", ToolError, max_bytes=MAX_TASK_FILE_BYTES)
    except ToolError as exc:
        raise ToolError(f"{where}task_file: {exc}") from None
    if not text.strip():
        raise ToolError(f"{where}task_file: {item.task_file} is empty; write the task in it, or give task")
    return item.model_copy(update={"task": text, "task_file": ""})


FORK_PLACEHOLDER = "(forked: a copy of this conversation does this call's task)"


def _check_fork(item: ChildTask, where: str, chain_step: int, isolation: str = "") -> None:
    """A fork continues its caller: its prompt and model are the caller's, so that the caller's KV
    cache serves it; naming others would start it cold, which a named agent does better. It works in
    its caller's tree, so `isolation: worktree` (its own, or the call's) is refused, never ignored."""
    if kept := [k for k in FORK_KEEPS if _given(getattr(item, k))]:
        raise ToolError(
            f"'{where}fork' with {', '.join(kept)}: a fork keeps its caller's prompt, tools and thinking, so that it "
            "reuses this conversation's cache; leave them out, or start a named agent with them"
        )
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


def _given(value: Any) -> bool:
    """Whether a choice was made (`thinking: 0` was: it is not left out)."""
    return value is not None and value is not False and value != ""


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


def _usage(tool: str, problem: str, agents: Collection[str], workflows: bool = True) -> str:
    listing = ", ".join(sorted(agents)) or "none"
    return f"invalid {tool} call: {problem}; {forms(workflows=workflows)}. Available agents: {listing}"


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


def _plain(schema: Any) -> Any:
    """The schema without what only costs a small model's context: an optional field's `anyOf` with
    null is its type (leaving it out is how it says none), and defaults that mean "not given" go."""
    if isinstance(schema, list):
        return [_plain(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    node = dict(schema)
    options = node.get("anyOf")
    if isinstance(options, list) and len(options) == 2 and {"type": "null"} in options:
        del node["anyOf"]
        node = {**next(o for o in options if o != {"type": "null"}), **node}
    if "default" in node and node["default"] in (None, "", False, []):
        del node["default"]
    if node.get("additionalProperties") is True:  # the default
        del node["additionalProperties"]
    return {key: _plain(value) for key, value in node.items()}


def _validation_problem(exc: ValidationError) -> str:
    problems = []
    for err in exc.errors():
        field = error_path(err["loc"]) or "arguments"
        if err["type"] == "extra_forbidden":
            problems.append(f"unknown field '{field}'")
        else:
            problems.append(f"'{field}': {error_message(err)}")
    return "; ".join(problems)
