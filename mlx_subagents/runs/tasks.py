"""What a person asks for: tasks, a tasks file, their labels, a chain's steps, and which model.

`TaskSpec` is one task as a caller gives it; a tasks file is validated into the same class. Labels
are filled in here (`label_tasks`), a chain's `{previous}` is planned here (`plan_chain`), and a
task's model is a `ModelRef`: a local model, or a model id on an OpenAI-compatible engine.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import AliasChoices, ConfigDict, Field, TypeAdapter, ValidationError

from ..caps import MAX_TASK_CHARS
from ..errors import RequestError
from ..home import long_name_problem
from ..render import CHILD
from ..results import RunResult
from ..userfiles import first_error, load_file

DEFAULT_MODEL = "mlx-community/Qwen3-4B-Instruct-2507-4bit"
MODEL_ENV = "MLX_SUBAGENTS_MODEL"
SCRIPTED = "scripted:"  # a replay's model id: `scripted:FILE` (host/scripted.py's SCRIPTED_PREFIX)
PREVIOUS = "{previous}"
# Builds a task's text from the results before it (a chain's `{previous}`, a workflow's needs).
Render = Callable[[Sequence[RunResult]], str]
PositiveInt = Annotated[Optional[int], Field(gt=0)]


@dataclass(frozen=True)
class Steps:
    """The order of a chain's or a workflow's steps: which earlier steps each needs (by index in its
    plan), and how each step's task is rendered from the plan's results; empty: independent tasks."""

    needs: Sequence[tuple[int, ...]] = ()
    renders: Sequence[Render | None] = ()

    def of(self, index: int) -> tuple[tuple[int, ...], Render | None]:
        """Step `index`'s needs and render."""
        return (self.needs[index] if self.needs else ()), (self.renders[index] if self.renders else None)


def default_model() -> str:
    return os.environ.get(MODEL_ENV) or DEFAULT_MODEL


def absolute_model(model: str, here: Path) -> str:
    """`model` with the path it names made absolute against `here`, so that it names the same model in
    another process (`subagent serve` reads paths in its own folder): `scripted:FILE`, a path (`./folder`,
    `~/models/x`, `/abs`), and a name that is a folder here (which `resolve_model_path` takes first); a hub
    id, an imported model's name and an engine's model id stay as they are. `mlx/` stays in front."""
    prefix = next((p for p in (SCRIPTED, "mlx/") if model.startswith(p)), "")
    name = model[len(prefix) :]
    if not name:
        return model
    path = Path(os.path.expanduser(name))
    try:
        is_path = prefix == SCRIPTED or name.startswith((".", "~", os.sep)) or (here / path).exists()
    except OSError:  # a name the OS cannot look up (too long): not a folder here
        is_path = False
    return prefix + os.path.abspath(here / path) if is_path else model


@dataclass(frozen=True)
class ModelRef:
    """Which model a task runs on: `model` (a local folder, hub id, imported name or `scripted:FILE`),
    or, with `engine` (an OpenAI-compatible base URL), the engine's id of a model it serves."""

    model: str
    engine: str | None = None

    def __str__(self) -> str:
        return f"{self.model} on {self.engine}" if self.engine else self.model


@dataclass(frozen=True)
class TaskSpec:
    """One task to run: which agent, what to do, and optional per-task overrides.

    Built directly by callers; a tasks file is validated into the same class (`load_tasks_file`),
    where `max_tokens` is accepted for `max_output_tokens`, as on the command line.

    Args:
        max_output_tokens: generated tokens over the whole task.
        timeout: wall-clock seconds for the whole task.
        schema: a JSON schema the final answer must satisfy (else the agent's `output_schema`).
        isolation: `worktree` runs it in a git worktree of its own (`runs/worktrees.py`), `none` in the
            shared tree; None: as its agent file says.
        fork: it continues its parent's conversation as its parent's agent (`agent` is the parent's).
        allowed_tools: only these of its agent's tools (None: all of them); naming one it lacks is refused.
        system_prompt: text added to the end of its agent's system prompt.
        thinking: its thinking budget per reply, in tokens (0: off); a delegated task's only narrows.
        single_shot: one reply, no tools (its agent's tools and skills are not offered; one turn).
    """

    __pydantic_config__ = ConfigDict(extra="forbid")

    agent: Annotated[str, Field(min_length=1)]
    task: Annotated[str, Field(min_length=1)]
    label: str = ""
    model: Optional[str] = None
    max_turns: PositiveInt = None
    max_output_tokens: Annotated[
        Optional[int], Field(gt=0, validation_alias=AliasChoices("max_output_tokens", "max_tokens"))
    ] = None
    timeout: Annotated[Optional[float], Field(gt=0)] = None
    schema: Optional[dict[str, Any]] = None
    step_id: Optional[str] = None
    isolation: Optional[Literal["none", "worktree"]] = None  # the call site's: wins over the agent file's
    fork: bool = False
    allowed_tools: Optional[tuple[str, ...]] = None
    system_prompt: str = ""
    thinking: Annotated[Optional[int], Field(ge=0)] = None
    single_shot: bool = False


_TASK = TypeAdapter(TaskSpec)


def load_tasks_file(path: Path) -> list[TaskSpec]:
    """Tasks from YAML or JSON: a list of `{agent, task, label?, model?, max_turns?, max_tokens?, timeout?}`,
    or a mapping with that list under `tasks`."""
    data = load_file(Path(path), "yaml", "tasks file", RequestError)
    if isinstance(data, dict) and set(data) == {"tasks"}:
        data = data["tasks"]
    if not isinstance(data, list):
        raise RequestError(
            f"{path}: expected a list of tasks (each with 'agent' and 'task'), or 'tasks:' with that list"
        )
    tasks = []
    for i, item in enumerate(data):
        try:
            tasks.append(_TASK.validate_python(item))
        except ValidationError as exc:
            raise RequestError(f"{path}: {first_error(exc, ('tasks', i))}") from None
    return tasks


def check_label(label: str) -> None:
    """Refuse a given label over `MAX_NAME_CHARS` (a label names the task's transcript file), or one
    holding `CHILD`, which joins a parent's label to its child's: `a > api` read as a child `api` of `a`
    (two result sections both titled `[api]`)."""
    if problem := long_name_problem(label.strip(), "task label"):
        raise RequestError(problem)
    if CHILD in label:
        raise RequestError(
            f"task label '{label}' holds '{CHILD}', which joins a parent's label to its child's; "
            "choose a label without it"
        )


def label_tasks(tasks: Sequence[TaskSpec]) -> list[TaskSpec]:
    """Fill in labels: the agent's name (`fork` for a fork), or `agent-N` when several unlabelled tasks share one."""
    for t in tasks:
        check_label(t.label)
    tasks = [replace(t, agent=t.agent.strip().lower()) for t in tasks]
    shared = Counter(_base(t) for t in tasks if not t.label)
    seen: Counter[str] = Counter()
    labelled = []
    for t in tasks:
        if not t.label:
            base = _base(t)
            seen[base] += 1
            t = replace(t, label=f"{base}-{seen[base]}" if shared[base] > 1 else base)
        labelled.append(t)
    duplicates = sorted(label for label, n in Counter(t.label for t in labelled).items() if n > 1)
    if duplicates:
        raise RequestError(f"duplicate task label(s): {', '.join(duplicates)}; give each task its own label")
    return labelled


def _base(task: TaskSpec) -> str:
    return "fork" if task.fork else task.agent


def plan_chain(tasks: list[TaskSpec]) -> tuple[list[TaskSpec], Steps]:
    """Step ids, needs and `{previous}` renders for labelled chain steps."""
    if tasks and PREVIOUS in tasks[0].task:
        raise RequestError("step 1 uses {previous}, but there is no previous step; remove it from the first task")
    tasks = [replace(t, step_id=t.step_id or str(i + 1)) for i, t in enumerate(tasks)]

    def render(i: int) -> Callable[[Sequence[RunResult]], str]:
        return lambda results: fill_previous(tasks[i].task, results[i - 1].output)

    needs = [(i - 1,) if i else () for i in range(len(tasks))]
    return tasks, Steps(needs, [render(i) if i else None for i in range(len(tasks))])


PREVIOUS_CUT = (
    "\n[the previous step's answer is cut here, to keep this task within {limit:,} characters: it has {total:,}]"
)


def fill_previous(task: str, answer: str, limit: int = MAX_TASK_CHARS) -> str:
    """A chain step's task with `{previous}` as the previous step's answer, that answer cut (and the cut
    said) where the whole would pass the task cap: a step's task never goes over it."""
    whole = task.replace(PREVIOUS, answer)
    if len(whole) <= limit:
        return whole
    n = task.count(PREVIOUS)
    note = PREVIOUS_CUT.format(limit=limit, total=len(answer))
    room = max(0, (limit - (len(task) - n * len(PREVIOUS))) // n - len(note))
    return task.replace(PREVIOUS, answer[:room] + note)
