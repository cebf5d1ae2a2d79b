"""`subagent runs`, `watch`, `show` and `resume`: the runs saved, what runs now, one run, a task continued."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from ...runs.jobs import Job
from ..flags import Display, JsonListOpt, JsonOpt, SchemaOpt, Shared, TaskKeyOpt, display_options, shared_options
from ..output import err, out
from .run import read_schema, run_one

app = typer.Typer()


@app.command()
def runs(
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="How many runs to list.")] = 20,
    as_json: JsonListOpt = False,
) -> None:
    """List recent runs, newest first.

    Example: subagent runs -n 5
    """
    from ...runs.transcripts import list_runs, runs_dir

    records = list_runs(limit)
    if as_json:
        out.print_json(json.dumps([r.model_dump(mode="json", exclude={"folder"}) for r in records]))
        return
    if not records:
        err.print(f"no saved runs in {runs_dir()}", markup=False)
    for r in records:
        score = f"{r.succeeded}/{r.total}" if r.succeeded is not None else f"?/{r.total}"
        labels = ", ".join(t.label for t in r.tasks)
        out.print(f"{r.run_id}  {r.mode:<8} {r.status:<11} {score:>5}  {escape(labels)}  [dim]{escape(r.cwd)}[/]")


@app.command()
def watch(
    as_json: JsonOpt = False,
    once: Annotated[bool, typer.Option("--once", help="Print what runs now once, then exit.")] = False,
) -> None:
    """Watch every running task of this state folder: the tree of parents and sub-agents, what each
    does (prefilling, decoding, a tool, waiting for a slot or the writer lease), turns, tokens, tokens/s, KV bytes
    against each pool's budget; refreshed until Ctrl-C (`--json`: one snapshot).

    Example: subagent watch
    """
    from ...runs.published import read_snapshots
    from ..watch import run_watch

    run_watch(out, err, as_json=as_json, once=once, read=read_snapshots)


@app.command()
def show(
    run_id: Annotated[str, typer.Argument(help="A run id (or a unique prefix, or `last`).")],
    task: TaskKeyOpt = None,
    full: Annotated[bool, typer.Option("--full", help="Show tool results and the system prompt in full.")] = False,
    as_json: JsonOpt = False,
    timeline: Annotated[
        Optional[Path],
        typer.Option(
            "--timeline",
            dir_okay=False,
            help="Write the run as a picture to FILE.html (a page, nothing loaded) or FILE.svg: a lane per task, "
            "a bar per turn (queued, prefill, decode), tool calls and waits.",
        ),
    ] = None,
) -> None:
    """Print a saved run: each task's conversation, tool calls, results and usage.

    Example: subagent show last   (or: subagent show last --timeline run.html)
    """
    from ...runs.transcripts import load_run
    from ..show import run_json, show_run

    record = load_run(run_id)
    if timeline is not None:
        from ..timeline import write_timeline

        n_lanes = write_timeline(record, timeline)
        err.print(f"wrote the timeline of run {record.run_id} ({n_lanes} tasks) to {timeline}", markup=False)
        return
    if as_json:
        out.print_json(json.dumps(run_json(record, task), default=str))
        return
    show_run(out, record, task, full=full)


@app.command()
@shared_options(
    isolation=None,  # a saved task continues where it ran
    cwd=None,  # the task's own workspace
    model=Annotated[
        Optional[str], typer.Option("--model", "-m", help="Model to continue with (default: the one the task used).")
    ],
)
@display_options()
def resume(
    run_id: Annotated[str, typer.Argument(help="A run id (or a unique prefix, or `last`).")],
    message: Annotated[str, typer.Argument(help="The follow-up message.")],
    task: TaskKeyOpt = None,
    schema: SchemaOpt = None,
    *,
    shared: Shared,
    display: Display,
) -> None:
    """Continue a saved task's conversation with a new message (its transcript is extended).

    Example: subagent resume last "now list the tests that cover it"
    """
    from ...runs.transcripts import load_run

    record = load_run(run_id)
    job = Job(command="resume", run_id=record.run_id, message=message, task=task, schema=read_schema(schema))
    run_one(shared, job, display, cwd=Path(record.cwd))
