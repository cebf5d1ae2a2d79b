"""`subagent`: the command line. Thin commands over the runner; one error boundary in `main()`.

Results go to stdout, progress and errors to stderr. Exit codes: 0 every task completed, 1 a task
failed, 2 bad usage or input (nothing ran), 130 interrupted (Ctrl-C). The flags are declared in
`flags.py`, what a command prints in `output.py`.

What only some commands use is imported in them: a command attached to `subagent serve` (`run`,
`parallel`, ...) loads no runner, host, tools or agent files (tests/cli/test_light_client.py).
"""

from __future__ import annotations

import asyncio
import io
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import click
import typer
from rich.markup import escape

from ..errors import RequestError, SubagentError
from ..mcp_server.budget import DEFAULT_CALL_BUDGET, parse_call_budget
from ..render import EventLines
from ..runs.jobs import Job
from ..runs.tasks import TaskSpec, default_model, label_tasks, load_tasks_file
from .attach import run_job, serve_mcp
from .flags import (
    CwdOpt,
    EventsOpt,
    JsonListOpt,
    JsonOpt,
    KvBitsOpt,
    KvBudgetOpt,
    ModelOpt,
    PrefillSliceOpt,
    QuietOpt,
    SchemaOpt,
    Scope,
    ScopeOpt,
    Shared,
    StepAgents,
    StepTexts,
    TaskAgents,
    TaskKeyOpt,
    TaskTexts,
    VerboseOpt,
    WindowOpt,
    shared_options,
)
from .interrupts import EXIT_INTERRUPTED
from .output import err, event_sinks, finish_multi, finish_single, out, print_warnings, run_multi, run_single
from .serve import serve

if TYPE_CHECKING:
    from ..agents.spec import AgentSpec

app = typer.Typer(
    name="subagent",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Coding sub-agents on a local MLX model, in one process.",
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        from .. import __version__

        out.print(f"subagent {__version__} (mlx {version('mlx')}, mlx-lm {version('mlx-lm')})", markup=False)
        raise typer.Exit()


@app.callback()
def _everywhere(
    show_version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Coding sub-agents on a local MLX model, in one process."""
    from .config import apply_model_default, load_config

    apply_model_default(load_config())  # config.toml's `model`, below $MLX_SUBAGENTS_MODEL, for every command


# --- running -----------------------------------------------------------------------------------------


def _pair(agents: list[str] | None, texts: list[str] | None, flag: str) -> list[TaskSpec]:
    agents, texts = agents or [], texts or []
    if len(agents) != len(texts):
        raise RequestError(
            f"each {flag} AGENT needs its task text right after it (got {len(agents)} agents and {len(texts)} texts); "
            f'quote a task that has spaces: {flag} scout "map the auth code"'
        )
    return [TaskSpec(agent=a, task=t) for a, t in zip(agents, texts)]


def _schema(path: Path | None) -> dict[str, Any] | None:
    from ..agents.schema_output import load_schema

    return load_schema(path) if path else None


def _run_one(
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
    quiet: QuietOpt = False,
    *,
    shared: Shared,
) -> None:
    """Run one agent on a task in a workspace.

    Example: subagent run scout "where is auth handled?"
    """
    spec = TaskSpec(agent=agent, task=task, schema=_schema(schema))
    _run_one(shared, Job(command="run", tasks=[spec]), as_json, events, verbose=verbose, quiet=quiet)


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
    answer_schema = _schema(schema)
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
        steps[-1] = replace(steps[-1], schema=_schema(schema))
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
    from ..runs.workflow import find_workflow, load_workflow

    path = find_workflow(name, Path(shared.cwd).resolve())
    rows = [(s.id, s.agent) for s in load_workflow(path).steps]
    job = Job(command="workflow", workflow=str(Path(path).resolve()), input=input, concurrency=shared.concurrency)
    _run_many(shared, rows, job, as_json, events, quiet)


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
        out.print(f"{escape(name):<20} [dim]{escape(str(path))}[/]")
    if not found:
        err.print("no workflows found; put NAME.toml files in .mlx-subagents/workflows/")


@app.command()
def runs(
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="How many runs to list.")] = 20,
    as_json: JsonListOpt = False,
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
    does (prefilling, decoding, a tool, waiting for the writer lease), turns, tokens, tokens/s, KV bytes
    against each pool's budget; refreshed until Ctrl-C (`--json`: one snapshot).

    Example: subagent watch
    """
    from ..runs.published import read_snapshots
    from .watch import run_watch

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
    from ..runs.transcripts import load_run
    from .show import run_json, show_run

    record = load_run(run_id)
    if timeline is not None:
        from .timeline import write_timeline

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
def resume(
    run_id: Annotated[str, typer.Argument(help="A run id (or a unique prefix, or `last`).")],
    message: Annotated[str, typer.Argument(help="The follow-up message.")],
    task: TaskKeyOpt = None,
    schema: SchemaOpt = None,
    as_json: JsonOpt = False,
    events: EventsOpt = False,
    quiet: QuietOpt = False,
    *,
    shared: Shared,
) -> None:
    """Continue a saved task's conversation with a new message (its transcript is extended).

    Example: subagent resume last "now list the tests that cover it"
    """
    from ..runs.transcripts import load_run

    record = load_run(run_id)
    job = Job(command="resume", run_id=record.run_id, message=message, task=task, schema=_schema(schema))
    _run_one(shared, job, as_json, events, cwd=Path(record.cwd), quiet=quiet)


@app.command()
@shared_options(
    isolation=None,  # a chat's tasks run in the workspace
    timeout=Annotated[
        Optional[float],
        typer.Option("--timeout", min=0.001, help="Stop a sub-agent after this many seconds (wall clock)."),
    ],
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
    plan: Annotated[
        bool, typer.Option("--plan", help="Plan mode: the parent and its sub-agents only look (no edit, write, bash).")
    ] = False,
    wake: Annotated[
        bool,
        typer.Option("--wake/--no-wake", help="A background sub-agent's end starts the parent's next turn (/wake)."),
    ] = True,
    *,
    shared: Shared,
) -> None:
    """Talk with a parent agent that hands jobs to sub-agents; /help inside lists the commands.

    Example: subagent chat   (or: subagent chat --once "where is auth handled, and is it tested?")
    """
    from ..runs.transcripts import load_run
    from .attach_chat import chat_on_server
    from .terminal import run_chat

    cwd = Path(load_run(resume).cwd) if resume is not None else None
    code = chat_on_server(shared, agent=agent, once=once, resume=resume, cwd=cwd, plan=plan, out=out, err=err)
    if code is None:
        make = lambda sink: shared.runner(sink, cwd=cwd, plan=plan)  # noqa: E731
        code = run_chat(make, agent=agent, once=once, resume=resume, wake=wake, out=out, err=err)
    raise typer.Exit(code)


@app.command()
def agents(
    cwd: CwdOpt = Path("."),
    scope: ScopeOpt = Scope.both,
    as_json: JsonListOpt = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="Also show whether each agent takes writer turns, its skills and MCP tools, and the project instructions.",
        ),
    ] = False,
) -> None:
    """List the agents: built-in, user and project.

    Example: subagent agents --json
    """
    from ..agents.discovery import discover_agents
    from ..agents.spec import sandbox_default
    from .mcp_servers import agent_mcp_line, mcp_entries

    root = Path(cwd).resolve()
    catalog = discover_agents(root, scope=scope.value)  # type: ignore[arg-type]
    print_warnings(catalog)
    entries = mcp_entries(catalog, root)[0] if verbose else []
    rows = [
        {
            "name": s.name,
            "description": s.description,
            "tools": list(s.tools),
            "source": s.source,
            "file": str(s.path),
            "writer": s.is_writer(),
            "sandbox": sandbox_default(s),
            "permission": s.permission,
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
            out.print(f"  {_sandbox_line(catalog.agents[row['name']])}", markup=False)
            out.print(f"  {_skills_line(catalog.agents[row['name']], catalog.skills)}", markup=False)
            if (line := agent_mcp_line(catalog.agents[row["name"]], entries)) is not None:
                out.print(f"  {line}", markup=False)
    if verbose:
        _show_project_context(root, [name for name in catalog.names() if catalog.agents[name].context == "none"])


def _skills_line(spec: AgentSpec, found: dict[str, Any]) -> str:
    """Which skills the agent is offered (project ones once allowed), and those its `skills:` names in vain."""
    from ..agents.skills import choose_skills

    choice = choose_skills(spec.skills, found)
    line = f"skills: {', '.join(choice.names()) or 'none'}"
    if choice.preloaded:
        line += f" (preloaded: {', '.join(choice.preloaded)})"
    if choice.missing:
        line += f"; not found: {', '.join(choice.missing)}"
    return line


@app.command()
def skills(cwd: CwdOpt = Path("."), scope: ScopeOpt = Scope.both, as_json: JsonListOpt = False) -> None:
    """List the skills: user and project (project ones are offered to agents only with --yes).

    Example: subagent skills --json
    """
    from ..agents.discovery import discover_agents

    catalog = discover_agents(Path(cwd).resolve(), scope=scope.value)  # type: ignore[arg-type]
    print_warnings(catalog)
    rows = [
        {
            "name": s.name,
            "description": s.description,
            "source": s.source,
            "path": str(s.path),
            "bytes": s.n_bytes,
        }
        for s in catalog.skills.values()
    ]
    if as_json:
        out.print_json(json.dumps(rows))
        return
    if not rows:
        out.print("no skills found (see docs/agents.md#skills for where they go)", markup=False)
    for row in rows:
        out.print(f"{row['name']:<12} {row['source']:<8} {row['bytes']:,} bytes\n  {row['description']}", markup=False)
        out.print(f"  [dim]{row['path']}[/]")


def _writer_line(spec: AgentSpec) -> str:
    """How the agent shares its workspace: the writer rule, and why it applies."""
    from ..tools import WRITER_TOOLS

    if spec.is_writer():
        why = "writer: true" if spec.writer else f"it has {', '.join(t for t in spec.tools if t in WRITER_TOOLS)}"
        return f"writer: takes turns with other writers in its workspace ({why})"
    why = "writer: false" if spec.writer is False else "no edit, write or bash"
    return f"reader: runs alongside the others ({why})"


def _sandbox_line(spec: AgentSpec) -> str:
    """Whether its bash runs sandboxed by default, and why (`--sandbox on|off` decides for a whole run)."""
    from ..agents.spec import sandbox_default

    if not sandbox_default(spec):
        why = "sandbox: off" if spec.sandbox is False else f"a {spec.source} agent"
        line = f"sandbox: off ({why}); its bash has all your rights"
    else:
        why = "a project agent" if spec.source == "project" else "sandbox: on"
        net = "with network (network: allow)" if spec.network else "no network"
        if spec.network and spec.source == "project":
            net = "no network (its network: allow takes --network allow)"
        line = f"sandbox: on ({why}); its bash writes only in the workspace and a private /tmp, {net}"
    return line + ("; plan mode: read-only tools" if spec.permission == "plan" else "")


def _show_project_context(root: Path, opted_out: list[str]) -> None:
    """Which AGENTS.md / CLAUDE.md files load into the agents' system prompts."""
    from ..agents.context import CONTEXT_FILES, MAX_CONTEXT_CHARS, load_project_context

    context = load_project_context(root)
    if not context.files:
        out.print(f"project instructions: none ({' or '.join(CONTEXT_FILES)} up to the repository root)")
    else:
        cut = f", cut at {MAX_CONTEXT_CHARS:,}" if context.n_chars > MAX_CONTEXT_CHARS or context.more else ""
        more = "more than " if context.more else ""
        out.print(f"project instructions ({more}{context.n_chars:,} characters{cut}), in this order:", markup=False)
        for path in context.files:
            out.print(f"  {path}", markup=False)
    for line in context.skipped:
        out.print(f"  left out {line}", markup=False)
    if opted_out:
        out.print(f"  not for: {', '.join(opted_out)} (context: none)", markup=False)


mcp_servers_app = typer.Typer(help="The MCP servers agents can use; sign in to those that want OAuth.")
app.add_typer(mcp_servers_app, name="mcp-servers")


@mcp_servers_app.callback(invoke_without_command=True)
def mcp_servers(
    ctx: typer.Context, cwd: CwdOpt = Path("."), scope: ScopeOpt = Scope.both, as_json: JsonOpt = False
) -> None:
    """List the MCP servers agents can use: where each is defined, whether it needs consent, and which
    agents get which of its tools (`subagent doctor` starts each and counts its tools).

    Example: subagent mcp-servers --json
    """
    if ctx.invoked_subcommand is not None:
        return
    from ..agents.discovery import discover_agents
    from .mcp_servers import entry_lines, mcp_entries

    root = Path(cwd).resolve()
    catalog = discover_agents(root, scope=scope.value)  # type: ignore[arg-type]
    print_warnings(catalog)
    entries, missing = mcp_entries(catalog, root)
    for line in missing:
        err.print(f"[yellow]warning:[/] {escape(line)}")
    if as_json:
        out.print_json(data={"servers": [e.as_json() for e in entries]})
        return
    if not entries:
        out.print(f"no MCP servers: define them in {root / '.mcp.json'}, the home's mcp.json or an agent's mcpServers:")
    for entry in entries:
        out.print("\n".join(entry_lines(entry)), markup=False)


@mcp_servers_app.command("login")
def mcp_servers_login(
    name: Annotated[str, typer.Argument(help="The server's name (see `subagent mcp-servers`).")],
    cwd: CwdOpt = Path("."),
    client_id: Annotated[
        Optional[str],
        typer.Option("--client-id", help="A client registered with the server beforehand (else it registers itself)."),
    ] = None,
    client_secret: Annotated[
        Optional[str],
        typer.Option(
            "--client-secret", envvar="MCP_CLIENT_SECRET", help="That client's secret (or $MCP_CLIENT_SECRET)."
        ),
    ] = None,
    callback_port: Annotated[
        Optional[int],
        typer.Option(
            "--callback-port",
            min=1,
            max=65535,
            help="The loopback port the browser comes back to (default: any free one, then the same).",
        ),
    ] = None,
) -> None:
    """Sign in to an MCP server over HTTP that wants OAuth: prints the address to open in a browser, waits
    for it to come back, and keeps the tokens in the state folder (owner-only), refreshed by every run.

    Example: subagent mcp-servers login github
    """
    from ..agents.discovery import discover_agents
    from ..tools.mcp_auth import login
    from .mcp_servers import mcp_entries, server_to_sign_in

    root = Path(cwd).resolve()
    config = server_to_sign_in(mcp_entries(discover_agents(root), root)[0], name)
    say = lambda line: err.print(line, markup=False, highlight=False, soft_wrap=True)  # noqa: E731
    secret = {"client_id": client_id, "client_secret": client_secret, "callback_port": callback_port}
    done = asyncio.run(login(config.name, config.url, dict(config.headers), say, **secret))
    out.print(done, markup=False, highlight=False, soft_wrap=True)


@app.command()
@shared_options(
    isolation=None,  # each call says its own "isolation"
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
    start_server: Annotated[
        bool,
        typer.Option(
            "--serve",
            help="Start `subagent serve` in the background when none runs (also: MLX_SUBAGENTS_SERVE=1), then relay to it.",
        ),
    ] = False,
    call_budget: Annotated[
        str,
        typer.Option(
            "--call-budget",
            help="Seconds a run_agents call may take before it answers with what finished and the ids of what still "
            "runs (read with agent_output); 'off' for clients that wait. Clients often give a call 60 s.",
        ),
    ] = f"{DEFAULT_CALL_BUDGET:g}",
    *,
    shared: Shared,
) -> None:
    """Serve the agents over MCP on stdio (for Claude Code, Codex, Cursor, ...); the model stays loaded.
    When `subagent serve` runs, relay to it instead: every client shares its one model.

    Example: claude mcp add subagents -- subagent mcp --model mlx-community/Qwen3-4B-Instruct-2507-4bit
    """
    budget = parse_call_budget(call_budget)
    # stdin is the protocol channel, not a terminal: project agents need --yes, as in any script.
    raise typer.Exit(serve_mcp(shared, workspace, start=start_server, call_budget=budget))


@app.command("acp")
@shared_options(
    isolation=None,  # a chat's task works in the shared tree
    cwd=None,  # each session's workspace is the folder the editor gives it (session/new's cwd)
    yes=Annotated[
        bool, typer.Option("--yes", "-y", help="Allow project agents and servers without asking the editor.")
    ],
)
def acp_command(*, shared: Shared) -> None:
    """Serve the agents to an editor over the Agent Client Protocol on stdio (Zed, JetBrains IDEs, Neovim):
    a session is a chat with the orchestrator (or the agent chosen in the editor) in the editor's folder.

    Example: subagent acp --model mlx-community/Qwen3-4B-Instruct-2507-4bit   (in the editor's agent settings)
    """
    from .attach import serve_acp

    raise typer.Exit(serve_acp(shared))


app.command()(serve)


@app.command()
def doctor(
    model: ModelOpt = None,
    context_window: WindowOpt = None,
    kv_budget: KvBudgetOpt = None,
    prefill_slice: PrefillSliceOpt = None,
    kv_bits: KvBitsOpt = None,
    cwd: CwdOpt = Path("."),
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Also start the MCP servers of the project's files.")
    ] = False,
) -> None:
    """Check each configured MCP server answers (one line each), then mlx, the device and memory, and
    that the model loads and answers.

    Example: subagent doctor --model mlx-community/Qwen3-4B-Instruct-2507-4bit
    """
    from ..agents.discovery import discover_agents
    from ..host import DEFAULT_KV_BITS
    from .config import load_config
    from .doctor import run_doctor
    from .mcp_servers import check_servers, mcp_entries

    config = load_config()
    for line in config.lines():
        out.print(line, markup=False)
    root = Path(cwd).resolve()
    entries, _ = mcp_entries(discover_agents(root), root)
    servers_ok = asyncio.run(check_servers(entries, root, out.print, yes))
    kv_budget = kv_budget or config.values.get("kv_budget")
    prefill_slice = prefill_slice or config.values.get("prefill_slice")
    bits = int(kv_bits or config.values.get("kv_bits") or DEFAULT_KV_BITS)
    ok = asyncio.run(run_doctor(model or default_model(), context_window, out.print, kv_budget, prefill_slice, bits))
    raise typer.Exit(0 if ok and servers_ok else 1)


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

    default = default_model()
    found = list_models(default)
    if as_json:
        out.print_json(data={"models": [m.model_dump() for m in found]})
        return
    if found:
        out.print(models_table(found))
    if not any(m.default for m in found):
        none = "" if found else "no models found; "
        err.print(
            f"{none}the default model, {default}, is not on this machine: get it with `hf download {default}` "
            "(`pip install huggingface_hub` brings `hf`), pass --model, or import a GGUF file: subagent models "
            "import FILE.gguf (or ollama:NAME:TAG). On Linux or without a big model: docs/models.md#on-linux",
            markup=False,
        )


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
    for note in imported.notes:
        err.print(f"note: {note}")
    err.print(f"imported {imported.name} in {imported.seconds:.0f} s: {imported.path}")
    out.print(f"use it with: --model {imported.name}")


# --- isolated tasks' worktrees ---------------------------------------------------------------------------


@app.command()
def apply(
    ref: Annotated[str, typer.Argument(help="The worktree's name, branch, run id or task label (subagent worktrees).")],
) -> None:
    """Bring an isolated task's changes (its branch) into the workspace it started from.

    Refuses, naming the files, when they conflict or the workspace changed them since.

    Example: subagent apply subagent/20260131-142501-042-3fa9-worker
    """
    from ..runs.worktrees import apply_worktree, find_worktree

    worktree = find_worktree(ref)
    files = apply_worktree(worktree)
    err.print(f"applied {worktree.branch} to {worktree.repo}", markup=False)
    out.print("\n".join(files), markup=False)
    err.print("[dim]remove its worktree and branch with: subagent worktrees prune[/]")


worktrees_app = typer.Typer(help="The worktrees isolated tasks left; prune the merged or abandoned.")
app.add_typer(worktrees_app, name="worktrees")


@worktrees_app.callback(invoke_without_command=True)
def worktrees(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List the kept worktrees of isolated tasks (isolation: worktree), oldest first.

    Example: subagent worktrees --json
    """
    if ctx.invoked_subcommand is not None:
        return
    from ..runs.worktrees import list_worktrees
    from .show import worktree_json, worktree_line

    kept = list_worktrees(warn=_warning)
    if as_json:
        out.print_json(data={"worktrees": [worktree_json(w) for w in kept]})
        return
    for w in kept:
        out.print(worktree_line(w), markup=False)
    if not kept:
        err.print("no kept worktrees; tasks with isolation: worktree keep theirs when they change files")


@worktrees_app.command("prune")
def worktrees_prune(as_json: JsonOpt = False) -> None:
    """Remove the worktrees (and branches) that are merged, applied or abandoned; then git worktree prune.

    Example: subagent worktrees prune
    """
    from ..runs.worktrees import prune_worktrees
    from .show import worktree_json

    removed = prune_worktrees(warn=_warning)
    if as_json:
        out.print_json(data={"removed": [worktree_json(w) for w in removed]})
        return
    for w in removed:
        out.print(f"removed {w.name} ({w.branch})", markup=False)
    if not removed:
        err.print("nothing to prune: every kept worktree has changes not yet applied or merged")


def _warning(line: str) -> None:
    """One line about a state file skipped or a thing kept, on stderr."""
    err.print(f"[yellow]warning:[/] {escape(line)}")


cache_app = typer.Typer(help="The prompt prefixes kept on disk for warm starts.", no_args_is_help=False)
app.add_typer(cache_app, name="cache")


@cache_app.callback(invoke_without_command=True)
def cache(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List the stored prefixes (model, tokens, size, last used), most recently used first.

    Example: subagent cache --json
    """
    if ctx.invoked_subcommand is not None:
        return
    from ..host.kv.prefix_store import list_prefixes, prefix_cache_dir

    found = list_prefixes(warn=_warning)
    if as_json:
        rows = [
            {"model": p.model, "tokens": p.n_tokens, "bytes": p.nbytes, "last_used": p.last_used, "file": str(p.path)}
            for p in found
        ]
        out.print_json(data={"folder": str(prefix_cache_dir()), "prefixes": rows})
        return
    for p in found:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(p.last_used))
        out.print(f"{p.model}  {p.n_tokens} tokens  {p.nbytes / 2**20:.1f} MiB  last used {used}", highlight=False)
    total = sum(p.nbytes for p in found)
    err.print(f"{len(found)} prefixes, {total / 2**20:.1f} MiB in {prefix_cache_dir()}")


@cache_app.command("clear")
def cache_clear() -> None:
    """Delete every stored prefix; the next run of each agent prefills its prompt again.

    Example: subagent cache clear
    """
    from ..host.kv.prefix_store import clear_prefixes, prefix_cache_dir

    n, freed = clear_prefixes(warn=_warning)
    err.print(f"deleted {n} prefixes ({freed / 2**20:.1f} MiB) from {prefix_cache_dir()}")


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
        code = app(prog_name="subagent", standalone_mode=False)  # its name in help and completion scripts
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
