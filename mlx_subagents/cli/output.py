"""What the commands print: results to stdout, progress, warnings and errors to stderr.

`finish_single` and `finish_multi` print a result the way `run` and the multi-task commands do
(text or `--json`) and exit with its code: 0 every task completed, 1 a task failed, 130 interrupted
(143 after SIGTERM, 129 after SIGHUP: what was done is printed first).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.rule import Rule
from rich.segment import Segment

from ..events import Event, Fanout
from ..render import EventLines
from ..results import MultiRunResult, RunResult
from ..text import terminal_text, warning_line
from .interrupts import EXIT_INTERRUPTED, Finished
from .live import LiveView, wants_live
from .progress import usage_table

if TYPE_CHECKING:
    from ..agents.discovery import AgentCatalog


class TerminalConsole(Console):
    """A console that sends a terminal no control character it did not make: every text it prints (a
    model's answer, a command's output, an MCP server's message, a table cell, the live status lines,
    `watch`) goes through `terminal_text` on its way out; rich's own styles and cursor moves (control
    segments) pass. To a pipe or a file, text goes as it is."""

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        if self.is_terminal:
            buffer = [s if s.control else Segment(terminal_text(s.text), s.style) for s in buffer]
        return super()._render_buffer(buffer)


# No emoji codes: `:a:` in an error or an answer is text, never a picture.
err = TerminalConsole(stderr=True, highlight=False, soft_wrap=True, emoji=False)
out = TerminalConsole(highlight=False, soft_wrap=True, emoji=False)
JSON_FIELDS = {
    "agent",
    "children",
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
    "worktree",
}


def event_sinks(events: bool) -> Fanout:
    """The command's event sink: with `--events`, first one JSON object per event on stdout."""
    return Fanout([json_line] if events else [])


def json_line(event: Event) -> None:
    sys.stdout.write(json.dumps({"time": round(time.time(), 3), **event.to_json()}, default=str) + "\n")
    sys.stdout.flush()


def result_json(result: RunResult) -> dict[str, Any]:
    return result.model_dump(mode="json", include=JSON_FIELDS)


def usage_line(result: RunResult) -> str:
    u = result.usage
    return (
        f"{result.agent}: {result.status} ({result.stop_reason}) in {result.duration_s:.1f}s, {u.turns} turns, "
        f"{u.input_tokens} in ({u.cached_tokens} cached), {u.output_tokens} out, context {u.context_tokens}"
        + (f", KV {u.kv_bytes / 2**20:.1f} MiB" if u.kv_bytes else "")
    )


def finish_single(finished: Finished[RunResult], as_json: bool, events: bool) -> None:
    """Print one task's result like `subagent run` always has, and exit with its code."""
    result = finished.value
    with _signalled(finished):
        _print_single(result, as_json, events)
        if result.status == "aborted":
            err.print(f"[yellow]aborted: {escape(result.label)}[/]")
    if result.status == "aborted":
        raise typer.Exit(finished.exit_code or EXIT_INTERRUPTED)
    raise typer.Exit(finished.exit_code or (0 if result.ok else 1))


def _print_single(result: RunResult, as_json: bool, events: bool) -> None:
    if as_json:
        text = json.dumps(result_json(result))
        sys.stdout.write(text + "\n") if events else out.print_json(text)
    else:
        if result.output:
            (err if events else out).print(result.output, markup=False)
        if result.error:
            err.print(f"[red]error:[/] {escape(result.error)}")
        err.print(f"[dim]{escape(usage_line(result))}[/]")
        if result.worktree is not None:
            err.print(escape(result.worktree.describe(result.label)))
        if result.run_id:
            err.print(f'[dim]saved as run {result.run_id}; continue with: subagent resume {result.run_id} "..."[/]')


@contextmanager
def _signalled(finished: Finished[Any]) -> Iterator[None]:
    """After SIGHUP the terminal may be gone: what cannot be printed is in the transcripts."""
    try:
        yield
    except OSError:
        if finished.exit_code is None:
            raise


def finish_multi(finished: Finished[MultiRunResult], as_json: bool, events: bool) -> None:
    """Answers, then the usage table and the summary; exit 0, 1 (a task failed) or 130 (interrupted)."""
    outcome = finished.value
    with _signalled(finished):
        _print_multi(outcome, as_json, events)
    if outcome.interrupted:
        raise typer.Exit(finished.exit_code or EXIT_INTERRUPTED)
    raise typer.Exit(finished.exit_code or (0 if outcome.ok else 1))


def _print_multi(outcome: MultiRunResult, as_json: bool, events: bool) -> None:
    if as_json:
        data = outcome.model_dump(mode="json", include={"mode", "succeeded", "total", "run_id", "interrupted", "error"})
        data["results"] = [result_json(r) for r in outcome.results]
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
        for r in outcome.results:
            if r.worktree is not None:
                err.print(escape(r.worktree.describe(r.label)))
    style = "green" if outcome.ok else "red"
    err.print(f"[{style}]{outcome.succeeded}/{outcome.total} succeeded[/]")
    if outcome.error:
        err.print(f"[red]{escape(outcome.error)}[/]")
    if outcome.run_id:
        err.print(f"[dim]saved as run {outcome.run_id} (subagent show {outcome.run_id})[/]")
    if outcome.interrupted:
        err.print(f"[yellow]aborted: {escape(', '.join(r.label for r in outcome.aborted) or 'none')}[/]")


def run_multi(
    sinks: Fanout,
    tasks: list[tuple[str, str]],
    quiet: bool,
    events: bool,
    go: Callable[[], Finished[MultiRunResult]],
) -> Finished[MultiRunResult]:
    """A multi-task command's work (`go`: in this process or on the server) with its progress: the live
    table on a terminal, else a line per notable event (none with `-q`)."""
    if not wants_live(err, out, quiet=quiet, events=events):
        if not quiet:
            sinks.targets.append(EventLines(err, "tasks").handle)
        return go()
    with LiveView(err, "tasks", tasks) as view:
        sinks.targets.append(view.handle)
        return go()


def run_single(sinks: Fanout, quiet: bool, events: bool, go: Callable[[], Finished[RunResult]]) -> Finished[RunResult]:
    """A one-task command's work (`go`), with its live status on a terminal (its tool calls print either way)."""
    if not wants_live(err, out, quiet=quiet, events=events):
        return go()
    with LiveView(err, "task") as view:
        sinks.targets.append(view.handle)
        return go()


def print_warnings(catalog: AgentCatalog, limit: int | None = None) -> None:
    """Skipped agent files, then what each agent that loaded had dropped or read leniently; past
    `limit`, one line says how many more `subagent agents` shows."""
    print_warning_lines([warning_line(w) for w in catalog.all_warnings()], limit)


def print_warning_lines(lines: list[str], limit: int | None = None) -> None:
    """Warning lines, the first `limit` of them, then how many more `subagent agents` shows."""
    for line in lines[:limit]:
        warn(line)
    if limit is not None and len(lines) > limit:
        err.print(f"[yellow]warning:[/] ({len(lines) - limit} more; subagent agents shows them all)")


def warn(line: str) -> None:
    """Prints one warning line on stderr: a state file skipped, a thing kept, a server not found."""
    err.print(f"[yellow]warning:[/] {escape(line)}")
