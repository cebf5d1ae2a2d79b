"""`subagent run`, `parallel`, `chain`, `workflow` and `workflows`: tasks run now, on the server when
one runs, else here; `run_one` and `read_schema` serve `resume` too."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from ...errors import RequestError
from ...render import EventLines
from ...runs.jobs import Job
from ...runs.tasks import TaskSpec, label_tasks, load_tasks_file
from ..attach import run_job
from ..flags import (
    CwdOpt,
    Display,
    JsonOpt,
    SchemaOpt,
    Shared,
    StepAgents,
    StepTexts,
    TaskAgents,
    TaskTexts,
    VerboseOpt,
    display_options,
    shared_options,
)
from ..output import err, event_sinks, finish_multi, finish_single, out, run_multi, run_single

app = typer.Typer()


def _pair(agents: list[str] | None, texts: list[str] | None, flag: str) -> list[TaskSpec]:
    agents, texts = agents or [], texts or []
    if len(agents) != len(texts):
        raise RequestError(
            f"each {flag} AGENT needs its task text right after it (got {len(agents)} agents and {len(texts)} texts); "
            f'quote a task that has spaces: {flag} scout "map the auth code"'
        )
    return [TaskSpec(agent=a, task=t) for a, t in zip(agents, texts)]


def read_schema(path: Path | None) -> dict[str, Any] | None:
    """Reads the JSON schema a task's answer must satisfy (`--schema FILE`), or None without one."""
    from ...agents.schema_output import load_schema

    return load_schema(path) if path else None


def run_one(shared: Shared, job: Job, display: Display, *, verbose: bool = False, cwd: Path | None = None) -> None:
    """A one-task command: its job (on the server, or a runner here in `cwd`), a line per event, the
    live status, the result, the exit."""
    sinks = event_sinks(display.events)
    sinks.targets.append(EventLines(err, "task", verbose=verbose).handle)
    go = lambda: run_job(shared, job, sinks, cwd=cwd)  # noqa: E731
    finish_single(run_single(sinks, display.quiet, display.events, go), display.as_json, display.events)


def _run_many(shared: Shared, rows: list[tuple[str, str]], job: Job, display: Display) -> None:
    """A multi-task command: its job, the progress table of `rows` (label, agent), the result, the exit."""
    sinks = event_sinks(display.events)
    finished = run_multi(sinks, rows, display.quiet, display.events, lambda: run_job(shared, job, sinks))
    finish_multi(finished, display.as_json, display.events)


@app.command()
@shared_options()
@display_options()
def run(
    agent: Annotated[str, typer.Argument(help="Agent name (see `subagent agents`).")],
    task: Annotated[str, typer.Argument(help="What the agent should do.")],
    schema: SchemaOpt = None,
    verbose: VerboseOpt = False,
    *,
    shared: Shared,
    display: Display,
) -> None:
    """Run one agent on a task in a workspace.

    Example: subagent run scout "where is auth handled?"
    """
    spec = TaskSpec(agent=agent, task=task, schema=read_schema(schema))
    run_one(shared, Job(command="run", tasks=[spec]), display, verbose=verbose)


@app.command()
@shared_options()
@display_options()
def parallel(
    texts: TaskTexts = None,
    agent: TaskAgents = None,
    file: Annotated[
        Optional[Path],
        typer.Option(
            "--file",
            "-f",
            dir_okay=False,
            help="YAML/JSON list of tasks: {agent, task, label?, model?, max_turns?, max_tokens?, timeout?}.",
        ),
    ] = None,
    schema: SchemaOpt = None,
    *,
    shared: Shared,
    display: Display,
) -> None:
    """Run several independent tasks at once; results in input order.

    Example: subagent parallel -t scout "map the auth code" -t reviewer "review src/db.py"
    """
    tasks = (load_tasks_file(file) if file else []) + _pair(agent, texts, "-t")
    answer_schema = read_schema(schema)
    tasks = label_tasks([replace(t, schema=answer_schema or t.schema) for t in tasks])
    rows = [(t.label, t.agent) for t in tasks]
    job = Job(command="parallel", tasks=tasks, concurrency=shared.concurrency)
    _run_many(shared, rows, job, display)


@app.command()
@shared_options()
@display_options()
def chain(
    texts: StepTexts = None,
    agent: StepAgents = None,
    schema: Annotated[
        Optional[Path],
        typer.Option("--schema", dir_okay=False, help="JSON schema file the last step's answer must satisfy."),
    ] = None,
    *,
    shared: Shared,
    display: Display,
) -> None:
    """Run steps one after another, each getting the previous answer as {previous}.

    Example: subagent chain -s scout "find the parser" -s planner "plan a fix for: {previous}"
    """
    steps = _pair(agent, texts, "-s")
    if steps and schema:
        steps[-1] = replace(steps[-1], schema=read_schema(schema))
    steps = label_tasks(steps)
    _run_many(shared, [(t.label, t.agent) for t in steps], Job(command="chain", tasks=steps), display)


@app.command()
@shared_options()
@display_options()
def workflow(
    name: Annotated[str, typer.Argument(help="A workflow name (.mlx-subagents/workflows/NAME.toml) or a TOML file.")],
    input: Annotated[str, typer.Option("--input", "-i", help="The workflow input every step receives ({input}).")] = "",
    *,
    shared: Shared,
    display: Display,
) -> None:
    """Run a workflow: steps start as soon as the steps they need are done.

    Example: subagent workflow fix-bug --input "dates lose their time zone"
    """
    from ...runs.workflow import find_workflow, load_workflow

    path = find_workflow(name, Path(shared.cwd).resolve())
    rows = [(s.id, s.agent) for s in load_workflow(path).steps]
    job = Job(command="workflow", workflow=str(Path(path).resolve()), input=input, concurrency=shared.concurrency)
    _run_many(shared, rows, job, display)


@app.command()
def workflows(cwd: CwdOpt = Path("."), as_json: JsonOpt = False) -> None:
    """List the named workflows visible from the workspace.

    Example: subagent workflows
    """
    from ...runs.workflow import discover_workflows

    found = discover_workflows(Path(cwd).resolve())
    if as_json:
        out.print_json(json.dumps({name: str(path) for name, path in found.items()}))
        return
    for name, path in sorted(found.items()):
        out.print(f"{escape(name):<20} [dim]{escape(str(path))}[/]")
    if not found:
        err.print("no workflows found; put NAME.toml files in .mlx-subagents/workflows/")
