"""`subagent`: the command line. Thin commands over the runner; one error boundary in `main()`."""

from __future__ import annotations

import asyncio
import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import click
import typer
from rich.console import Console

from .doctor import run_doctor
from .errors import SubagentError
from .events import Event
from .results import RunResult
from .runner import Runner, TaskSpec, default_model

app = typer.Typer(
    name="subagent", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="Coding sub-agents on a local MLX model, in one process.",
)
err = Console(stderr=True, highlight=False)
out = Console(highlight=False, soft_wrap=True)

ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Local folder, hub id or scripted:FILE (default: $MLX_SUBAGENTS_MODEL or a Qwen3 4B).")]
CwdOpt = Annotated[Path, typer.Option("--cwd", "-C", help="Workspace folder the agent works in.", file_okay=False)]
class Scope(str, Enum):
    user = "user"
    project = "project"
    both = "both"


ScopeOpt = Annotated[Scope, typer.Option("--scope", help="Agent layers besides the built-ins.")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Allow project agents without asking.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]
WindowOpt = Annotated[Optional[int], typer.Option("--context-window", help="Override the model's context window (tokens).", min=256)]


def _show_event(event: Event) -> None:
    """Tool calls and compactions as they happen, on stderr."""
    prefix = f"[dim]\\[{event.label}][/] " if event.label != event.agent else ""
    if event.kind == "tool_call":
        err.print(f"{prefix}[cyan]{event.data['description']}[/]", markup=True)
    elif event.kind == "tool_result" and event.data.get("is_error"):
        err.print(f"{prefix}[red]{event.data['output'].splitlines()[0][:200] if event.data['output'] else ''}[/]")
    elif event.kind == "compaction":
        err.print(f"{prefix}[yellow]compacted {event.data['tokens_before']} -> {event.data['tokens_after']} tokens[/]")


def _usage_line(result: RunResult) -> str:
    u = result.usage
    return (
        f"{result.agent}: {result.status} ({result.stop_reason}) in {result.duration_s:.1f}s, {u.turns} turns, "
        f"{u.input_tokens} in ({u.cached_tokens} cached), {u.output_tokens} out, context {u.context_tokens}"
    )


@app.command()
def run(
    agent: Annotated[str, typer.Argument(help="Agent name (see `subagent agents`).")],
    task: Annotated[str, typer.Argument(help="What the agent should do.")],
    model: ModelOpt = None,
    cwd: CwdOpt = Path("."),
    scope: ScopeOpt = Scope.both,
    yes: YesOpt = False,
    max_turns: Annotated[Optional[int], typer.Option("--max-turns", min=1, help="Stop after this many model turns.")] = None,
    context_window: WindowOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Run one agent on a task in a workspace.

    Example: subagent run scout "where is auth handled?"
    """
    runner = Runner(
        cwd=cwd, model=model, scope=scope.value, assume_yes=yes, interactive=sys.stdin.isatty(),
        confirm=lambda q: typer.confirm(q, default=False, err=True), max_turns=max_turns,
        host_options={"context_window": context_window} if context_window else {}, on_event=_show_event,
    )

    async def go() -> RunResult:
        async with runner:
            return await runner.run(TaskSpec(agent=agent, task=task))

    result = asyncio.run(go())
    if as_json:
        out.print_json(json.dumps(result.model_dump(include=_JSON_FIELDS)))
    else:
        if result.output:
            out.print(result.output, markup=False)
        if result.error:
            err.print(f"[red]error:[/] {result.error}")
        err.print(f"[dim]{_usage_line(result)}[/]")
    raise typer.Exit(0 if result.ok else 1)


_JSON_FIELDS = {"agent", "task", "status", "output", "error", "usage", "model", "stop_reason", "duration_s"}


@app.command()
def agents(
    cwd: CwdOpt = Path("."),
    scope: ScopeOpt = Scope.both,
    as_json: JsonOpt = False,
) -> None:
    """List the agents: built-in, user and project.

    Example: subagent agents --json
    """
    from .agents import discover_agents

    catalog = discover_agents(Path(cwd).resolve(), scope=scope.value)  # type: ignore[arg-type]
    for warning in catalog.warnings:
        err.print(f"[yellow]warning:[/] {warning}", markup=True)
    rows = [
        {"name": s.name, "description": s.description, "tools": list(s.tools), "source": s.source, "file": str(s.path)}
        for s in sorted(catalog.agents.values(), key=lambda s: s.name)
    ]
    if as_json:
        out.print_json(json.dumps(rows))
        return
    for row in rows:
        out.print(f"{row['name']:<12} {row['source']:<8} {', '.join(row['tools'])}\n  {row['description']}\n  [dim]{row['file']}[/]")


@app.command()
def doctor(model: ModelOpt = None, context_window: WindowOpt = None) -> None:
    """Check mlx, the device and memory, and that the model loads and answers.

    Example: subagent doctor --model mlx-community/Qwen3-4B-Instruct-2507-4bit
    """
    ok = asyncio.run(run_doctor(model or default_model(), context_window, out.print))
    raise typer.Exit(0 if ok else 1)


def main() -> None:
    """Entry point: maps library errors to one line and an exit code, never a traceback."""
    try:
        app(standalone_mode=False)
    except SubagentError as exc:
        err.print(f"[red]error:[/] {exc}", markup=True)
        sys.exit(2)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        err.print("[yellow]interrupted[/]")
        sys.exit(130)


if __name__ == "__main__":
    main()
