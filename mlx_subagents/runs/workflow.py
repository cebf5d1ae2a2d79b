"""Workflows: a TOML file of steps that depend on each other.

    name = "fix-bug"                      # optional
    description = "Find, plan, review"    # optional

    [[steps]]
    id = "find"
    agent = "scout"
    prompt = "Find the code behind: {input}"

    [[steps]]
    id = "plan"
    agent = "planner"
    prompt = "Plan a fix."
    needs = ["find"]                      # optional: ids of steps whose answers this one gets
    model = "mlx-community/..."           # optional (a path: relative to this file); also max_turns, max_tokens, timeout, schema

Every step receives the workflow input and the answers of the steps it needs: `{input}` and
`{<step id>}` in its prompt are replaced by them, and whatever the prompt does not place itself is
appended after it. A step starts as soon as its needs are done. Unknown agents, unknown or circular
needs and duplicate ids are rejected before anything runs. Named workflows live in
`.mlx-subagents/workflows/NAME.toml` (walking up from the working folder), then
`$MLX_SUBAGENTS_HOME/workflows/NAME.toml`.
"""

from __future__ import annotations

import contextlib
import graphlib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..agents.schema_output import load_schema
from ..caps import MAX_TASK_CHARS, MAX_TASKS
from ..errors import AgentNotFoundError, WorkflowError
from ..home import state_home
from ..userfiles import error_message, error_path, load_file
from .tasks import Render, Steps, TaskSpec, absolute_model, label_tasks

if TYPE_CHECKING:
    from ..agents.discovery import AgentCatalog

PROJECT_WORKFLOWS_DIR = ".mlx-subagents/workflows"
INLINE = "steps"  # what an inline workflow's errors name
STEP_ID_PATTERN = r"[A-Za-z_][A-Za-z0-9_-]*"
INPUT_KEY = "input"
PLACEHOLDER = re.compile(r"\{(" + STEP_ID_PATTERN + r")\}")


class WorkflowStep(BaseModel):
    """One step: an agent, its prompt template and the steps it needs."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    id: str = Field(pattern=f"^{STEP_ID_PATTERN}$")
    agent: str = Field(min_length=1)
    prompt: str = Field(min_length=1)
    needs: tuple[str, ...] = ()
    model: str | None = None
    max_turns: int | None = Field(default=None, gt=0)
    max_tokens: int | None = Field(default=None, gt=0)
    timeout: float | None = Field(default=None, gt=0)
    schema_file: str | None = Field(default=None, alias="schema")
    isolation: Literal["none", "worktree"] | None = None  # `worktree`: the step in a worktree of its own


class Workflow(BaseModel):
    """A validated workflow; `path` is the file it came from, if any."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = ""
    description: str = ""
    steps: tuple[WorkflowStep, ...] = Field(min_length=1)
    path: Path | None = None

    def step(self, step_id: str) -> WorkflowStep:
        return next(s for s in self.steps if s.id == step_id)

    def model_of(self, step: WorkflowStep) -> str | None:
        """The step's model; a path in it (`./models/x`, `scripted:FILE`) is relative to the workflow file,
        as its schema is, so that the workflow means the same wherever it is run from (`subagent serve`)."""
        if step.model is None or self.path is None:
            return step.model
        return absolute_model(step.model, self.path.parent)

    def schema_path(self, step: WorkflowStep) -> Path | None:
        """The step's schema file, relative to the workflow file; one `WorkflowError` line when it lies
        (through a link too) outside the folder the workflow belongs to (`home_of`): the schema goes into
        the model's prompt, and a cloned repository's workflow must not put a file from elsewhere there."""
        if step.schema_file is None:
            return None
        base = self.path.parent if self.path else Path.cwd()
        path = (base / step.schema_file).expanduser()
        home = home_of(self.path) if self.path else Path.cwd().resolve()
        if home is not None and not path.resolve().is_relative_to(home):
            raise WorkflowError(
                f"{self.path or 'workflow'}: step '{step.id}': schema '{step.schema_file}' lies outside {home}; a "
                "workflow's schema stays inside its project (copy the file there)"
            )
        return path


def home_of(path: Path) -> Path | None:
    """The folder a workflow file's schemas must stay in: the project that holds its
    `.mlx-subagents/workflows/` folder, else the file's own folder; None for the user's own workflows
    (`$MLX_SUBAGENTS_HOME/workflows`), which may name any file of theirs."""
    folder = path.resolve().parent
    if folder == (state_home() / "workflows").resolve():
        return None
    if folder.parts[-2:] == tuple(Path(PROJECT_WORKFLOWS_DIR).parts[-2:]):
        return folder.parent.parent
    return folder


# --- loading and checking ---------------------------------------------------------------------------


def load_workflow(path: Path) -> Workflow:
    """Read a TOML workflow and check its graph; every problem is one `WorkflowError` naming the file."""
    path = Path(path)
    data = load_file(path, "toml", "workflow file", WorkflowError)
    return parse_workflow(data, path)


def parse_workflow(data: dict[str, Any], path: Path | None = None) -> Workflow:
    """Validate a workflow mapping (as read from TOML) and its graph."""
    where = str(path) if path else "workflow"
    try:
        workflow = Workflow.model_validate({**data, "path": path})
    except ValidationError as exc:
        raise WorkflowError(f"{where}: {_first_error(exc, data)}") from None
    check_graph(workflow, where)
    return workflow


def check_graph(workflow: Workflow, where: str = "workflow", key: str = "id") -> None:
    """Duplicate ids, unknown or self needs, placeholders of steps not needed, cycles, too many steps.

    Args:
        key: what the caller calls a step's id (`name` in an inline workflow's `steps`)."""
    if len(workflow.steps) > MAX_TASKS:
        raise WorkflowError(
            f"{where}: {len(workflow.steps)} steps is more than the limit of {MAX_TASKS}; split the workflow"
        )
    ids: list[str] = []
    for step in workflow.steps:
        if step.id == INPUT_KEY:
            raise WorkflowError(
                f"{where}: step {key} '{INPUT_KEY}' is reserved for the workflow input; rename the step"
            )
        if step.id in ids:
            raise WorkflowError(f"{where}: duplicate step {key} '{step.id}'; give every step its own {key}")
        ids.append(step.id)
    for step in workflow.steps:
        for need in step.needs:
            if need == step.id:
                raise WorkflowError(f"{where}: step '{step.id}' needs itself; remove '{need}' from its needs")
            if need not in ids:
                raise WorkflowError(
                    f"{where}: step '{step.id}' needs unknown step '{need}'; known steps: {', '.join(ids)}"
                )
        for name in PLACEHOLDER.findall(step.prompt):
            if name == step.id:
                raise WorkflowError(
                    f"{where}: step '{step.id}' uses {{{name}}}, its own answer, in its prompt; remove it"
                )
            if name in ids and name not in step.needs:
                raise WorkflowError(
                    f"{where}: step '{step.id}' uses {{{name}}} in its prompt but does not need '{name}'; "
                    f"add it to needs"
                )
    cycle = find_cycle({s.id: s.needs for s in workflow.steps})
    if cycle:
        raise WorkflowError(f"{where}: the needs form a cycle: {' -> '.join(cycle)}; remove one of these needs")


def inline_workflow(steps: Sequence[Mapping[str, Any]]) -> Workflow:
    """A workflow given inline (`{"steps": [{"name", "agent", "task", "needs"}, ...]}` on the `subagent`
    tool, MCP's `run_agents` and `start_agents`, a chat's `/workflow`), checked as a workflow file is:
    its names, a cycle, an unknown need, a duplicate name, more than 8 steps; one `WorkflowError` line."""
    built = []
    for i, step in enumerate(steps):
        name = str(step.get("name", "")).strip()
        if not re.fullmatch(STEP_ID_PATTERN, name):
            raise WorkflowError(
                f"{INLINE}: steps[{i}].name {name!r} is not a valid step name; use letters, digits, '_' and '-', "
                "starting with a letter"
            )
        choices = {k: step.get(k) or None for k in ("model", "max_turns", "timeout", "isolation")}
        needs = tuple(str(n).strip() for n in step.get("needs") or ())
        built.append(WorkflowStep(id=name, agent=step["agent"], prompt=step["task"], needs=needs, **choices))
    workflow = Workflow(steps=tuple(built))
    check_graph(workflow, INLINE, key="name")
    return workflow


def find_cycle(graph: dict[str, tuple[str, ...]]) -> list[str] | None:
    """One cycle as a path of needs that ends where it starts (`a -> b -> a`: a needs b needs a), or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        # graphlib lists the cycle from each node to the one that needs it: reverse it.
        return list(reversed(exc.args[1]))
    return None


def check_agents(workflow: Workflow, catalog: AgentCatalog, where: str | None = None) -> None:
    """Every step's agent exists."""
    where = where or (str(workflow.path) if workflow.path else "workflow")
    for step in workflow.steps:
        try:
            catalog.get(step.agent)
        except AgentNotFoundError:
            available = ", ".join(catalog.names()) or "(none)"
            raise WorkflowError(
                f"{where}: step '{step.id}' uses unknown agent '{step.agent}'; available: {available}"
            ) from None


def _first_error(exc: ValidationError, data: dict[str, Any]) -> str:
    err = exc.errors()[0]
    loc = list(err["loc"])
    where = ""
    if len(loc) >= 2 and loc[0] == "steps" and isinstance(loc[1], int):
        steps = data.get("steps") or []
        step = steps[loc[1]] if loc[1] < len(steps) and isinstance(steps[loc[1]], dict) else {}
        name = f"'{step['id']}'" if isinstance(step.get("id"), str) else f"{loc[1] + 1}"
        where = f"step {name}: "
        loc = loc[2:]
    field = error_path(loc)
    msg = error_message(err)
    if field == "steps" and err["type"] in ("missing", "too_short"):
        return "no steps: add at least one [[steps]] table with id, agent and prompt"
    if err["type"] == "missing":
        return f"{where}missing field '{field}'; add it"
    if err["type"] == "extra_forbidden":
        return (
            f"{where}unknown field '{field}'; allowed: id, agent, prompt, needs, model, max_turns, max_tokens, timeout, schema"
            if where
            else f"unknown field '{field}'; allowed: name, description, steps"
        )
    if field == "id" and err["type"] == "string_pattern_mismatch":
        return f"{where}field 'id' {err['input']!r} is not a valid id; use letters, digits, '_' and '-', starting with a letter"
    return f"{where}field '{field}': {msg}" if field else f"{where}{msg}"


# --- discovery -----------------------------------------------------------------------------------------


def workflow_dirs(cwd: Path) -> list[Path]:
    """Where named workflows are looked up, first match wins: project folders upwards, then the user's."""
    cwd = Path(cwd).expanduser().resolve()
    found = [folder / PROJECT_WORKFLOWS_DIR for folder in (cwd, *cwd.parents)]
    found.append(state_home() / "workflows")
    return [d for d in found if d.is_dir()]


def discover_workflows(cwd: Path) -> dict[str, Path]:
    """Workflow name -> file, the nearest folder winning a clash."""
    found: dict[str, Path] = {}
    for folder in workflow_dirs(cwd):
        for path in sorted(folder.glob("*.toml")):
            found.setdefault(path.stem, path)
    return found


def find_workflow(name_or_path: str, cwd: Path, *, named: bool = False) -> Path:
    """A workflow file (as given, else relative to `cwd`), or a named workflow.

    Args:
        named: only a named workflow (a model's or an MCP client's call): a path, which could name any
            TOML file on the machine, is refused in one line.
    """
    if named:
        found = discover_workflows(cwd)
        if name_or_path in found:
            return found[name_or_path].resolve()
        available = ", ".join(sorted(found)) or "none"
        if name_or_path.endswith(".toml") or "/" in name_or_path or "\\" in name_or_path:
            raise WorkflowError(
                f"workflow '{name_or_path}' is a path: a call names a workflow, never a file; available: {available}"
            )
        raise WorkflowError(f"unknown workflow '{name_or_path}'; available: {available}")
    given = Path(name_or_path).expanduser()
    for candidate in (given, Path(cwd) / given):
        with contextlib.suppress(OSError):  # a name the OS cannot look up (`File name too long`) is none
            if candidate.exists() and not candidate.is_dir():  # a FIFO or device: refused by the reader
                return candidate.resolve()
    if name_or_path.endswith(".toml") or "/" in name_or_path:
        raise WorkflowError(f"workflow file not found: {given}")
    named = discover_workflows(cwd)
    if name_or_path in named:
        return named[name_or_path].resolve()
    available = ", ".join(sorted(named)) or f"none (put NAME.toml in {PROJECT_WORKFLOWS_DIR}/)"
    raise WorkflowError(f"unknown workflow '{name_or_path}'; available: {available}")


# --- prompts ---------------------------------------------------------------------------------------------


def render_prompt(step: WorkflowStep, workflow_input: str, outputs: dict[str, str], limit: int = MAX_TASK_CHARS) -> str:
    """The step's task: placeholders filled; the input and needed answers it does not place, appended.
    Needed answers are cut (each cut said) where the whole would pass the task cap, as a chain's
    `{previous}` is: a 30,000-character answer made a 30,025-character task."""
    return _assemble(step, workflow_input, fit_answers(step, workflow_input, outputs, limit))


def _assemble(step: WorkflowStep, workflow_input: str, answers: dict[str, str]) -> str:
    values = {INPUT_KEY: workflow_input, **answers}
    placed = set(PLACEHOLDER.findall(step.prompt))
    text = PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), step.prompt)
    sections = [text]
    if workflow_input and INPUT_KEY not in placed:
        sections.append(f"Workflow input:\n{workflow_input}")
    for need in step.needs:
        if need not in placed:
            sections.append(f"Answer of step '{need}':\n{answers[need]}")
    return "\n\n".join(sections)


ANSWER_CUT = "\n[step '{need}''s answer is cut here, to keep this task within {limit:,} characters: it has {total:,}]"


def fit_answers(step: WorkflowStep, workflow_input: str, outputs: dict[str, str], limit: int) -> dict[str, str]:
    """The answers `step` needs, each whole where the task fits the cap, else the longest cut to an equal
    share of the room the rest of the task leaves (a shorter answer keeps its length; what it does not
    use goes to the others)."""
    answers = {need: outputs[need] for need in step.needs}
    empty = _assemble(step, workflow_input, {n: "" for n in step.needs})
    uses = {n: max(1, len(re.findall(r"\{" + re.escape(n) + r"\}", step.prompt))) for n in step.needs}
    if len(empty) + sum(len(a) * uses[n] for n, a in answers.items()) <= limit:
        return answers
    room, fitted = limit - len(empty), dict(answers)
    pending = sorted(answers, key=lambda n: len(answers[n]))
    while pending:
        need = pending.pop(0)
        share = max(0, room // (uses[need] + sum(uses[n] for n in pending)))
        if len(answers[need]) > share:
            note = ANSWER_CUT.format(need=need, limit=limit, total=len(answers[need]))
            fitted[need] = answers[need][: max(0, share - len(note))] + note
        room -= len(fitted[need]) * uses[need]
    return fitted


def plan_workflow(workflow: Workflow, workflow_input: str) -> tuple[list[TaskSpec], Steps]:
    """The workflow's steps as tasks (in step order), each one's needs by index, and how each
    renders its task from the finished results."""
    ids = {step.id: i for i, step in enumerate(workflow.steps)}
    tasks = [
        TaskSpec(
            agent=s.agent,
            task=s.prompt,
            label=s.id,
            model=workflow.model_of(s),
            max_turns=s.max_turns,
            max_output_tokens=s.max_tokens,
            timeout=s.timeout,
            step_id=s.id,
            isolation=s.isolation,
            schema=load_schema(path) if (path := workflow.schema_path(s)) else None,
        )
        for s in workflow.steps
    ]

    def render(step: WorkflowStep) -> Render:
        return lambda results: render_prompt(step, workflow_input, {n: results[ids[n]].output for n in step.needs})

    needs = [tuple(ids[n] for n in s.needs) for s in workflow.steps]
    return label_tasks(tasks), Steps(needs, [render(s) for s in workflow.steps])
