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
    EventsOpt,
    JsonOpt,
    QuietOpt,
    SchemaOpt,
    Shared,
    StepAgents,
    StepTexts,
    TaskAgents,
    TaskTexts,
    VerboseOpt,
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


def run_one(
    shared: Shared,
    job: Job,
    as_json: bool,
    events: bool,
    *,
    verbose: bool = False,
    cwd: Path | None = None,
    quiet: bool = False,
) -> None:
    """A one-task command: its job (on the server, or a runner here in `cwd`), a line per event, the
    live status, the result, the exit."""
    sinks = event_sinks(events)
    sinks.targets.append(EventLines(err, "task", verbose=verbose).handle)
    finish_single(run_single(sinks, quiet, events, lambda: run_job(shared, job, sinks, cwd=cwd)), as_json, events)


def _run_many(shared: Shared, rows: list[tuple[str, str]], job: Job, as_json: bool, events: bool, quiet: bool) -> None:
    """A multi-task command: its job, the progress table of `rows` (label, agent), the result, the exit."""
    sinks = event_sinks(events)
    finish_multi(run_multi(sinks, rows, quiet, events, lambda: run_job(shared, job, sinks)), as_json, events)


@app.command()
@shared_options()
def run(
    agent: Annotated[str, typer.Argument(help="Agent name (see `subagent agents`).")],
    task: Annotated[str, typer.Argument(help="What the agent should do.")],
    schema: SchemaOpt = None,
    as_json: JsonOpt = False,
    events: EventsOpt = False,
    verbose: VerboseOpt = False,
    quiet: QuietOpt = False,
    *,
    shared: Shared,
) -> None:
    """Run one agent on a task in a workspace.

    Example: subagent run scout "where is auth handled?"
    """
    spec = TaskSpec(agent=agent, task=task, schema=read_schema(schema))
    run_one(shared, Job(command="run", tasks=[spec]), as_json, events, verbose=verbose, quiet=quiet)


@app.command()
@shared_options()
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
    as_json: JsonOpt = False,
    events: EventsOpt = False,
    quiet: QuietOpt = False,
    *,
    shared: Shared,
) -> None:
    """Run several independent tasks at once; results in input order.

    Example: subagent parallel -t scout "map the auth code" -t reviewer "review src/db.py"
    """
    tasks = (load_tasks_file(file) if file else []) + _pair(agent, texts, "-t")
    answer_schema = read_schema(schema)
    tasks = label_tasks([replace(t, schema=answer_schema or t.schema) for t in tasks])
    rows = [(t.label, t.agent) for t in tasks]
    job = Job(command="parallel", tasks=tasks, concurrency=shared.concurrency)
    _run_many(shared, rows, job, as_json, events, quiet)


@app.command()
@shared_options()
def chain(
    texts: StepTexts = None,
    agent: StepAgents = None,
    schema: Annotated[
        Optional[Path],
        typer.Option("--schema", dir_okay=False, help="JSON schema file the last step's answer must satisfy."),
    ] = None,
    as_json: JsonOpt = False,
    events: EventsOpt = False,
    quiet: QuietOpt = False,
    *,
    shared: Shared,
) -> None:
    """Run steps one after another, each getting the previous answer as {previous}.

    Example: subagent chain -s scout "find the parser" -s planner "plan a fix for: {previous}"
    """
    steps = _pair(agent, texts, "-s")
    if steps and schema:
        steps[-1] = replace(steps[-1], schema=read_schema(schema))
    steps = label_tasks(steps)
    _run_many(shared, [(t.label, t.agent) for t in steps], Job(command="chain", tasks=steps), as_json, events, quiet)


@app.command()
@shared_options()
def workflow(
    name: Annotated[str, typer.Argument(help="A workflow name (.mlx-subagents/workflows/NAME.toml) or a TOML file.")],
    input: Annotated[str, typer.Option("--input", "-i", help="The workflow input every step receives ({input}).")] = "",
    as_json: JsonOpt = False,
    events: EventsOpt = False,
    quiet: QuietOpt = False,
    *,
    shared: Shared,
) -> None:
    """Run a workflow: steps start as soon as the steps they need are done.

    Example: subagent workflow fix-bug --input "dates lose their time zone"
    """
    from ...runs.workflow import find_workflow, load_workflow

    path = find_workflow(name, Path(shared.cwd).resolve())
    rows = [(s.id, s.agent) for s in load_workflow(path).steps]
    job = Job(command="workflow", workflow=str(Path(path).resolve()), input=input, concurrency=shared.concurrency)
    _run_many(shared, rows, job, as_json, events, quiet)


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
