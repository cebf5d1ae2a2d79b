"""`subagent`: the command line. Thin commands over the runner; one error boundary in `main()`.

Results go to stdout, progress and errors to stderr. Exit codes: 0 every task completed, 1 a task
failed, 2 bad usage or input (nothing ran), 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import io
import json
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.rule import Rule

from ..agents.discovery import AgentCatalog
from ..agents.schema_output import load_schema
from ..agents.spec import WRITER_TOOLS, AgentSpec
from ..caps import MAX_CONCURRENCY, MAX_ENGINE_CONCURRENCY
from ..errors import RequestError, SubagentError
from ..events import Event, EventSink, Fanout
from ..host import parse_bytes
from ..render import EventLines
from ..results import MultiRunResult, RunResult
from ..runs.options import DEFAULT_MAX_DEPTH, RunOptions
from ..runs.runner import Runner
from ..runs.tasks import TaskSpec, default_model, label_tasks, load_tasks_file
from .doctor import run_doctor
from .interrupts import EXIT_INTERRUPTED, two_press_sigint
from .progress import ProgressView, usage_table

T = TypeVar("T")
# Agent-file warnings a running command shows before it starts (`subagent agents` shows all).
MAX_WARNINGS = 5

app = typer.Typer(
    name="subagent",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Coding sub-agents on a local MLX model, in one process.",
)
err = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)


class Scope(str, Enum):
    user = "user"
    project = "project"
    both = "both"


ModelOpt = Annotated[
    Optional[str],
    typer.Option(
        "--model", "-m", help="Local folder, hub id or scripted:FILE (default: $MLX_SUBAGENTS_MODEL or a Qwen3 4B)."
    ),
]
CwdOpt = Annotated[
    Path, typer.Option("--cwd", "-C", help="Workspace folder the agent works in.", exists=True, file_okay=False)
]
ScopeOpt = Annotated[Scope, typer.Option("--scope", help="Agent layers besides the built-ins.")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Allow project agents without asking.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]
WindowOpt = Annotated[
    Optional[int], typer.Option("--context-window", help="Override the model's context window (tokens).", min=256)
]


class Batching(str, Enum):
    on = "on"
    off = "off"


BatchingOpt = Annotated[
    Batching, typer.Option("--batching", help="Decode concurrent sessions in one batch (off: one turn at a time).")
]
KvBudgetOpt = Annotated[
    Optional[str],
    typer.Option(
        "--kv-budget",
        help="KV cache budget for all sessions: 4GB, 512MiB, 0.25 (of RAM) or 0 (unbounded). Default: half of RAM minus the weights.",
    ),
]
MaxTurnsOpt = Annotated[
    Optional[int], typer.Option("--max-turns", min=1, help="Stop a task after this many model turns.")
]
MaxTokensOpt = Annotated[
    Optional[int], typer.Option("--max-tokens", min=1, help="Stop a task after this many generated tokens.")
]
ThinkingOpt = Annotated[
    Optional[str],
    typer.Option(
        "--thinking",
        help="A thinking model's budget per reply: on, off or a number of tokens (then the thought is closed). "
        "Default: the agent's `thinking`, else on.",
    ),
]
TimeoutOpt = Annotated[
    Optional[float], typer.Option("--timeout", min=0.001, help="Stop a task after this many seconds (wall clock).")
]
SchemaOpt = Annotated[
    Optional[Path], typer.Option("--schema", help="JSON schema file the final answer must satisfy.", dir_okay=False)
]
EventsOpt = Annotated[
    bool, typer.Option("--events", help="Print one JSON object per event on stdout, as things happen.")
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress display.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Also say the model and its tool mode first.")]
ConcurrencyOpt = Annotated[
    int,
    typer.Option(
        "--concurrency",
        "-j",
        min=1,
        max=MAX_ENGINE_CONCURRENCY,
        help=(
            "Agent loops running at once in the whole run, sub-agents included (a parent waiting on them does not "
            f"count); up to {MAX_CONCURRENCY}, or {MAX_ENGINE_CONCURRENCY} with --engine."
        ),
    ),
]
EngineOpt = Annotated[
    Optional[str],
    typer.Option(
        "--engine",
        help="Run the model calls on this OpenAI-compatible engine (e.g. http://gpu-box:8000/v1); --model is its model id.",
    ),
]
ApiKeyOpt = Annotated[
    Optional[str], typer.Option("--api-key", help="The engine's API key (default: $MLX_SUBAGENTS_API_KEY).")
]
TaskKeyOpt = Annotated[
    Optional[str], typer.Option("--task", "-t", help="Which task of the run: label, step id or position.")
]
MaxDepthOpt = Annotated[
    int,
    typer.Option(
        "--max-depth", min=0, help="Levels of sub-agents an agent with the subagent tool may start (0: no delegation)."
    ),
]

_JSON_FIELDS = {
    "agent",
    "task",
    "status",
    "output",
    "reasoning",
    "error",
    "usage",
    "model",
    "tool_mode",
    "stop_reason",
    "duration_s",
    "label",
    "step_id",
    "run_id",
    "transcript",
    "parsed",
}


# --- running -----------------------------------------------------------------------------------------


# The flags every running command shares: name -> (its `Annotated` alias, its default).
_SHARED: dict[str, tuple[Any, Any]] = {
    "model": (ModelOpt, None),
    "cwd": (CwdOpt, Path(".")),
    "scope": (ScopeOpt, Scope.both),
    "yes": (YesOpt, False),
    "max_turns": (MaxTurnsOpt, None),
    "max_tokens": (MaxTokensOpt, None),
    "timeout": (TimeoutOpt, None),
    "context_window": (WindowOpt, None),
    "batching": (BatchingOpt, Batching.on),
    "kv_budget": (KvBudgetOpt, None),
    "max_depth": (MaxDepthOpt, DEFAULT_MAX_DEPTH),
    "concurrency": (ConcurrencyOpt, MAX_CONCURRENCY),
    "thinking": (ThinkingOpt, None),
    "engine": (EngineOpt, None),
    "api_key": (ApiKeyOpt, None),
}


@dataclass(frozen=True)
class Shared:
    """The shared flags of one command, as typed; `options()` is what the core sees."""

    model: str | None
    cwd: Path
    scope: Scope
    yes: bool
    max_turns: int | None
    max_tokens: int | None
    timeout: float | None
    context_window: int | None
    batching: Batching
    kv_budget: str | None
    max_depth: int
    concurrency: int
    thinking: str | None
    engine: str | None
    api_key: str | None

    def options(self) -> RunOptions:
        return RunOptions(
            model=self.model,
            scope=self.scope.value,
            assume_yes=self.yes,
            max_turns=self.max_turns,
            max_output_tokens=self.max_tokens,
            timeout=self.timeout,
            max_depth=self.max_depth,
            batching=self.batching == Batching.on,
            kv_budget=parse_bytes(self.kv_budget) if self.kv_budget is not None else None,
            context_window=self.context_window,
            concurrency=self.concurrency,
            thinking=self.thinking,
            engine=self.engine,
            api_key=self.api_key,
        )

    def runner(self, on_event: EventSink, cwd: Path | None = None) -> Runner:
        """The command's runner, asking on the terminal before a project agent runs; the agent files'
        warnings are shown first (the first few)."""
        runner = Runner(
            cwd=cwd or self.cwd,
            options=self.options(),
            interactive=sys.stdin.isatty(),
            confirm=lambda q: typer.confirm(q, default=False, err=True),
            on_event=on_event,
        )
        _print_warnings(runner.catalog, limit=MAX_WARNINGS)
        return runner


def shared_options(**overrides: Any) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command the shared flags; it receives them as one keyword argument, `shared: Shared`.

    Args:
        overrides: a flag's own `Annotated` alias for this command (other help), or None to leave
            the flag out (its default is used).
    """

    def wrap(command: Callable[..., None]) -> Callable[..., None]:
        own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "shared"]
        flags = {name: overrides.get(name, alias) for name, (alias, _default) in _SHARED.items()}
        added = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=_SHARED[name][1], annotation=alias)
            for name, alias in flags.items()
            if alias is not None
        ]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> None:
            values = {name: kwargs.pop(name, default) for name, (_alias, default) in _SHARED.items()}
            command(**kwargs, shared=Shared(**values))

        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + added
        wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return wrap


def _run_async(runner: Runner, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work` with Ctrl-C wired to the runner: the first press aborts every task, the second quits."""

    async def main() -> T:
        main_task = asyncio.current_task()

        def stop() -> None:
            if not runner.cancel() and main_task is not None:
                main_task.cancel()  # nothing started yet: stop loading

        message = "interrupted: stopping every task (Ctrl-C again to quit at once)"
        with two_press_sigint(asyncio.get_running_loop(), err, message, stop):
            async with runner:
                return await work()

    return asyncio.run(main())


def _sinks(events: bool) -> Fanout:
    """The command's event sink: with `--events`, first one JSON object per event on stdout."""
    return Fanout([_json_line] if events else [])


def _json_line(event: Event) -> None:
    sys.stdout.write(json.dumps({"time": round(time.time(), 3), **event.to_json()}, default=str) + "\n")
    sys.stdout.flush()


def _result_json(result: RunResult) -> dict[str, Any]:
    return result.model_dump(mode="json", include=_JSON_FIELDS)


def _usage_line(result: RunResult) -> str:
    u = result.usage
    return (
        f"{result.agent}: {result.status} ({result.stop_reason}) in {result.duration_s:.1f}s, {u.turns} turns, "
        f"{u.input_tokens} in ({u.cached_tokens} cached), {u.output_tokens} out, context {u.context_tokens}"
        + (f", KV {u.kv_bytes / 2**20:.1f} MiB" if u.kv_bytes else "")
    )


def _finish_single(result: RunResult, as_json: bool, events: bool) -> None:
    """Print one task's result like `subagent run` always has, and exit with its code."""
    if as_json:
        text = json.dumps(_result_json(result))
        sys.stdout.write(text + "\n") if events else out.print_json(text)
    else:
        if result.output:
            (err if events else out).print(result.output, markup=False)
        if result.error:
            err.print(f"[red]error:[/] {escape(result.error)}")
        err.print(f"[dim]{escape(_usage_line(result))}[/]")
        if result.run_id:
            err.print(f'[dim]saved as run {result.run_id}; continue with: subagent resume {result.run_id} "..."[/]')
    if result.status == "aborted":
        err.print(f"[yellow]aborted: {escape(result.label)}[/]")
        raise typer.Exit(EXIT_INTERRUPTED)
    raise typer.Exit(0 if result.ok else 1)


def _finish_multi(outcome: MultiRunResult, as_json: bool, events: bool) -> None:
    """Answers, then the usage table and the summary; exit 0, 1 (a task failed) or 130 (interrupted)."""
    if as_json:
        data = outcome.model_dump(mode="json", include={"mode", "succeeded", "total", "run_id", "interrupted", "error"})
        data["results"] = [_result_json(r) for r in outcome.results]
        text = json.dumps(data)
        sys.stdout.write(text + "\n") if events else out.print_json(text)
    else:
        answers = err if events else out
        for r in outcome.results:
            step = f"step {r.step_id}: " if outcome.mode == "chain" else ""
            answers.print(Rule(f"{step}{escape(r.label)} ({r.agent}) · {r.status}", align="left", style="dim"))
            if r.output:
                answers.print(r.output, markup=False)
            if r.error:
                answers.print(f"[red]error:[/] {escape(r.error)}")
        err.print(usage_table(outcome.results))
    style = "green" if outcome.ok else "red"
    err.print(f"[{style}]{outcome.succeeded}/{outcome.total} succeeded[/]")
    if outcome.error:
        err.print(f"[red]{escape(outcome.error)}[/]")
    if outcome.run_id:
        err.print(f"[dim]saved as run {outcome.run_id} (subagent show {outcome.run_id})[/]")
    if outcome.interrupted:
        err.print(f"[yellow]aborted: {escape(', '.join(r.label for r in outcome.aborted) or 'none')}[/]")
        raise typer.Exit(EXIT_INTERRUPTED)
    raise typer.Exit(0 if outcome.ok else 1)


def _run_multi(
    runner: Runner,
    sinks: Fanout,
    tasks: list[tuple[str, str]],
    quiet: bool,
    work: Callable[[], Awaitable[MultiRunResult]],
) -> MultiRunResult:
    if quiet:
        return _run_async(runner, work)
    with ProgressView(err, tasks) as view:
        sinks.targets.append(view.handle)
        return _run_async(runner, work)


def _pair(agents: list[str] | None, texts: list[str] | None, flag: str) -> list[TaskSpec]:
    agents, texts = agents or [], texts or []
    if len(agents) != len(texts):
        raise RequestError(
            f"each {flag} AGENT needs its task text right after it (got {len(agents)} agents and {len(texts)} texts); "
            f'quote a task that has spaces: {flag} scout "map the auth code"'
        )
    return [TaskSpec(agent=a, task=t) for a, t in zip(agents, texts)]


def _schema(path: Path | None) -> dict[str, Any] | None:
    return load_schema(path) if path else None


# --- commands -------------------------------------------------------------------------------------------


@app.command()
@shared_options()
def run(
    agent: Annotated[str, typer.Argument(help="Agent name (see `subagent agents`).")],
    task: Annotated[str, typer.Argument(help="What the agent should do.")],
    schema: SchemaOpt = None,
    as_json: JsonOpt = False,
    events: EventsOpt = False,
    verbose: VerboseOpt = False,
    *,
    shared: Shared,
) -> None:
    """Run one agent on a task in a workspace.

    Example: subagent run scout "where is auth handled?"
    """
    sinks = _sinks(events)
    sinks.targets.append(EventLines(err, "task", verbose=verbose).handle)
    runner = shared.runner(sinks)
    spec = TaskSpec(agent=agent, task=task, schema=_schema(schema))
    result = _run_async(runner, lambda: runner.run(spec))
    _finish_single(result, as_json, events)


@app.command()
@shared_options()
def parallel(
    texts: Annotated[
        Optional[list[str]],
        typer.Argument(metavar="TEXT", help="The task text after each -t AGENT.", show_default=False),
    ] = None,
    agent: Annotated[
        Optional[list[str]],
        typer.Option(
            "--task",
            "-t",
            metavar="AGENT",
            help='An agent, then its task text: -t scout "map the auth code". Repeat (8 at most).',
        ),
    ] = None,
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
    answer_schema = _schema(schema)
    tasks = label_tasks([replace(t, schema=answer_schema or t.schema) for t in tasks])
    sinks = _sinks(events)
    runner = shared.runner(sinks)
    rows = [(t.label, t.agent) for t in tasks]
    outcome = _run_multi(runner, sinks, rows, quiet, lambda: runner.parallel(tasks, concurrency=shared.concurrency))
    _finish_multi(outcome, as_json, events)


@app.command()
@shared_options()
def chain(
    texts: Annotated[
        Optional[list[str]],
        typer.Argument(metavar="TEXT", help="The task text after each -s AGENT.", show_default=False),
    ] = None,
    agent: Annotated[
        Optional[list[str]],
        typer.Option(
            "--step",
            "-s",
            metavar="AGENT",
            help="An agent, then its task text; {previous} is the previous step's answer. Repeat (8 at most).",
        ),
    ] = None,
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
        steps[-1] = replace(steps[-1], schema=_schema(schema))
    steps = label_tasks(steps)
    sinks = _sinks(events)
    runner = shared.runner(sinks)
    rows = [(t.label, t.agent) for t in steps]
    outcome = _run_multi(runner, sinks, rows, quiet, lambda: runner.chain(steps))
    _finish_multi(outcome, as_json, events)


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
    from ..runs.workflow import find_workflow, load_workflow

    flow = load_workflow(find_workflow(name, Path(shared.cwd).resolve()))
    sinks = _sinks(events)
    runner = shared.runner(sinks)
    rows = [(s.id, s.agent) for s in flow.steps]
    outcome = _run_multi(
        runner, sinks, rows, quiet, lambda: runner.workflow(flow, input, concurrency=shared.concurrency)
    )
    _finish_multi(outcome, as_json, events)


@app.command()
def workflows(cwd: CwdOpt = Path("."), as_json: JsonOpt = False) -> None:
    """List the named workflows visible from the workspace.

    Example: subagent workflows
    """
    from ..runs.workflow import discover_workflows

    found = discover_workflows(Path(cwd).resolve())
    if as_json:
        out.print_json(json.dumps({name: str(path) for name, path in found.items()}))
        return
    for name, path in sorted(found.items()):
        out.print(f"{name:<20} [dim]{path}[/]")
    if not found:
        err.print("no workflows found; put NAME.toml files in .mlx-subagents/workflows/")


@app.command()
def runs(
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="How many runs to list.")] = 20,
    as_json: JsonOpt = False,
) -> None:
    """List recent runs, newest first.

    Example: subagent runs -n 5
    """
    from ..runs.transcripts import list_runs, runs_dir

    records = list_runs(limit)
    if as_json:
        out.print_json(json.dumps([r.model_dump(mode="json", exclude={"folder"}) for r in records]))
        return
    if not records:
        err.print(f"no saved runs in {runs_dir()}")
    for r in records:
        score = f"{r.succeeded}/{r.total}" if r.succeeded is not None else f"?/{r.total}"
        labels = ", ".join(t.label for t in r.tasks)
        out.print(f"{r.run_id}  {r.mode:<8} {r.status:<11} {score:>5}  {escape(labels)}  [dim]{escape(r.cwd)}[/]")


@app.command()
def show(
    run_id: Annotated[str, typer.Argument(help="A run id (or a unique prefix, or `last`).")],
    task: TaskKeyOpt = None,
    full: Annotated[bool, typer.Option("--full", help="Show tool results and the system prompt in full.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Print a saved run: each task's conversation, tool calls, results and usage.

    Example: subagent show last
    """
    from ..runs.transcripts import load_run
    from .show import run_json, show_run

    record = load_run(run_id)
    if as_json:
        out.print_json(json.dumps(run_json(record, task), default=str))
        return
    show_run(out, record, task, full=full)


@app.command()
@shared_options(
    cwd=None,  # the task's own workspace
    model=Annotated[
        Optional[str], typer.Option("--model", "-m", help="Model to continue with (default: the one the task used).")
    ],
)
def resume(
    run_id: Annotated[str, typer.Argument(help="A run id (or a unique prefix, or `last`).")],
    message: Annotated[str, typer.Argument(help="The follow-up message.")],
    task: TaskKeyOpt = None,
    schema: SchemaOpt = None,
    as_json: JsonOpt = False,
    events: EventsOpt = False,
    *,
    shared: Shared,
) -> None:
    """Continue a saved task's conversation with a new message (its transcript is extended).

    Example: subagent resume last "now list the tests that cover it"
    """
    from ..runs.transcripts import load_run

    record = load_run(run_id)
    sinks = _sinks(events)
    sinks.targets.append(EventLines(err, "task").handle)
    runner = shared.runner(sinks, cwd=Path(record.cwd))
    answer_schema = _schema(schema)
    result = _run_async(runner, lambda: runner.resume(record.run_id, message, task=task, schema=answer_schema))
    _finish_single(result, as_json, events)


@app.command()
@shared_options(
    timeout=Annotated[
        Optional[float],
        typer.Option("--timeout", min=0.001, help="Stop a sub-agent after this many seconds (wall clock)."),
    ]
)
def chat(
    agent: Annotated[
        str, typer.Option("--agent", "-a", help="The parent agent; it delegates if its file grants `subagent`.")
    ] = "orchestrator",
    once: Annotated[
        Optional[str],
        typer.Option("--once", help="Send this one message, print the answer and exit (no terminal needed)."),
    ] = None,
    resume: Annotated[
        Optional[str],
        typer.Option("--resume", "-r", help="Continue a saved chat: a run id, a prefix of one, or `last`."),
    ] = None,
    *,
    shared: Shared,
) -> None:
    """Talk with a parent agent that hands jobs to sub-agents; /help inside lists the commands.

    Example: subagent chat   (or: subagent chat --once "where is auth handled, and is it tested?")
    """
    from ..runs.transcripts import load_run
    from .terminal import run_chat

    cwd = Path(load_run(resume).cwd) if resume is not None else None
    code = run_chat(lambda sink: shared.runner(sink, cwd=cwd), agent=agent, once=once, resume=resume, out=out, err=err)
    raise typer.Exit(code)


@app.command()
def agents(
    cwd: CwdOpt = Path("."),
    scope: ScopeOpt = Scope.both,
    as_json: JsonOpt = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose", "-v", help="Also show whether each agent takes writer turns, and the project instructions."
        ),
    ] = False,
) -> None:
    """List the agents: built-in, user and project.

    Example: subagent agents --json
    """
    from ..agents.discovery import discover_agents

    root = Path(cwd).resolve()
    catalog = discover_agents(root, scope=scope.value)  # type: ignore[arg-type]
    _print_warnings(catalog)
    rows = [
        {
            "name": s.name,
            "description": s.description,
            "tools": list(s.tools),
            "source": s.source,
            "file": str(s.path),
            "writer": s.is_writer(),
        }
        for s in sorted(catalog.agents.values(), key=lambda s: s.name)
    ]
    if as_json:
        out.print_json(json.dumps(rows))
        return
    for row in rows:
        out.print(
            f"{row['name']:<12} {row['source']:<8} {', '.join(row['tools'])}\n  {row['description']}\n  [dim]{row['file']}[/]"
        )
        if verbose:
            out.print(f"  {_writer_line(catalog.agents[row['name']])}", markup=False)
    if verbose:
        _show_project_context(root, [name for name in catalog.names() if catalog.agents[name].context == "none"])


def _writer_line(spec: AgentSpec) -> str:
    """How the agent shares its workspace: the writer rule, and why it applies."""
    if spec.is_writer():
        why = "writer: true" if spec.writer else f"it has {', '.join(t for t in spec.tools if t in WRITER_TOOLS)}"
        return f"writer: takes turns with other writers in its workspace ({why})"
    why = "writer: false" if spec.writer is False else "no edit, write or bash"
    return f"reader: runs alongside the others ({why})"


def _print_warnings(catalog: AgentCatalog, limit: int | None = None) -> None:
    """Skipped agent files, then what each agent that loaded had dropped or read leniently; past
    `limit`, one line says how many more `subagent agents` shows."""
    warnings = [*catalog.warnings, *(w for name in catalog.names() for w in catalog.agents[name].warnings)]
    for warning in warnings[:limit]:
        err.print(f"[yellow]warning:[/] {escape(warning)}")
    if limit is not None and len(warnings) > limit:
        err.print(f"[yellow]warning:[/] ({len(warnings) - limit} more; subagent agents shows them all)")


def _show_project_context(root: Path, opted_out: list[str]) -> None:
    """Which AGENTS.md / CLAUDE.md files load into the agents' system prompts."""
    from ..agents.context import CONTEXT_FILES, MAX_CONTEXT_CHARS, load_project_context

    context = load_project_context(root)
    if not context.files:
        out.print(f"project instructions: none ({' or '.join(CONTEXT_FILES)} up to the repository root)")
    else:
        cut = f", cut at {MAX_CONTEXT_CHARS:,}" if context.n_chars > MAX_CONTEXT_CHARS else ""
        out.print(f"project instructions ({context.n_chars:,} characters{cut}), in this order:", markup=False)
        for path in context.files:
            out.print(f"  {path}", markup=False)
    if opted_out:
        out.print(f"  not for: {', '.join(opted_out)} (context: none)", markup=False)


@app.command()
@shared_options(
    cwd=None,  # its own --cwd below: no default, so that the client's root can be the workspace
    yes=Annotated[bool, typer.Option("--yes", "-y", help="Allow project agents (a client cannot be asked).")],
)
def mcp(
    workspace: Annotated[
        Optional[Path],
        typer.Option(
            "--cwd",
            "-C",
            help="Workspace (default: the client's first root, else the folder the client starts the server in).",
            exists=True,
            file_okay=False,
        ),
    ] = None,
    *,
    shared: Shared,
) -> None:
    """Serve the agents over MCP on stdio (for Claude Code, Codex, Cursor, ...); the model stays loaded.

    Example: claude mcp add subagents -- subagent mcp --model mlx-community/Qwen3-4B-Instruct-2507-4bit
    """
    from ..mcp_server.server import serve_stdio

    # stdin is the protocol channel, not a terminal: project agents need --yes, as in any script.
    asyncio.run(serve_stdio(lambda root, on_event: shared.runner(on_event, root), workspace))


@app.command()
def doctor(model: ModelOpt = None, context_window: WindowOpt = None, kv_budget: KvBudgetOpt = None) -> None:
    """Check mlx, the device and memory, and that the model loads and answers.

    Example: subagent doctor --model mlx-community/Qwen3-4B-Instruct-2507-4bit
    """
    ok = asyncio.run(run_doctor(model or default_model(), context_window, out.print, kv_budget))
    raise typer.Exit(0 if ok else 1)


models_app = typer.Typer(help="The models this machine can run; import GGUF files.", no_args_is_help=False)
app.add_typer(models_app, name="models")


@models_app.callback(invoke_without_command=True)
def models(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List runnable models (imported and in the Hugging Face cache); * marks the default.

    Example: subagent models --json
    """
    if ctx.invoked_subcommand is not None:
        return
    from ..models.catalog import list_models
    from ..models.display import models_table

    found = list_models(default_model())
    if as_json:
        out.print_json(data={"models": [m.model_dump() for m in found]})
    elif found:
        out.print(models_table(found))
    else:
        err.print("no models found; import one: subagent models import FILE.gguf (or ollama:NAME:TAG)")


@models_app.command("import")
def models_import(
    source: Annotated[str, typer.Argument(help="A .gguf file, or ollama:NAME[:TAG] from Ollama's store.")],
    name: Annotated[Optional[str], typer.Option("--name", help="Name for --model (default: from the file).")] = None,
    bits: Annotated[int, typer.Option("--bits", help="4 or 8: quantize with mlx-lm; 16: keep float16.")] = 4,
) -> None:
    """Convert a GGUF model into $MLX_SUBAGENTS_HOME/models/NAME; then `--model NAME` runs it.

    Example: subagent models import ollama:qwen2.5-coder:7b
    """
    from ..models.display import ImportProgress
    from ..models.importer import import_gguf

    with ImportProgress(err) as progress:
        imported = import_gguf(source, name=name, bits=bits, progress=progress)
    err.print(f"imported {imported.name} in {imported.seconds:.0f} s: {imported.path}")
    out.print(f"use it with: --model {imported.name}")


# typer >= 0.22 vendors click: its exceptions are not click's. Catch both families.
_EXIT = tuple({typer.Exit, click.exceptions.Exit})
_USAGE = tuple({click.ClickException, *(c for c in (getattr(typer, "TyperException", None),) if c)})
_ABORT = tuple({typer.Abort, click.exceptions.Abort, KeyboardInterrupt, asyncio.CancelledError})


def main() -> None:
    """Entry point: maps library errors to one line and an exit code, never a traceback."""
    for stream in (sys.stdout, sys.stderr):  # a lone surrogate in a model's text prints escaped, never raises
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    try:
        # Without standalone mode, typer returns the code of a `typer.Exit` instead of raising it.
        code = app(standalone_mode=False)
    except SubagentError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        sys.exit(2)
    except _EXIT as exc:
        sys.exit(exc.exit_code)
    except _USAGE as exc:
        show = getattr(exc, "show", None)
        show() if show else err.print(f"Error: {escape(str(exc))}")
        sys.exit(getattr(exc, "exit_code", 2))
    except _ABORT:
        err.print("[yellow]interrupted[/]")
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
