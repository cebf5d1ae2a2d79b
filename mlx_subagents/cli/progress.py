"""Progress for many tasks: a live table on a terminal, one line per notable event elsewhere.

Both are fed the runner's events (the lines are `render.EventLines`'s). The table has one row per
task: label, agent, status (queued, waiting for its writer lease, running, done, failed, skipped,
aborted), turn, tokens in/out, cached tokens, tokens/s of the last reply and the tool call in
progress. `usage_table` is the summary printed at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from ..events import Event, TaskEndData, ToolCallData, UsageData
from ..render import MAX_TOOL_CHARS, EventLines, end_status, make_table, status_style
from ..results import RunResult, RunUsage
from ..text import clip


@dataclass
class _Row:
    label: str
    agent: str
    status: str = "queued"
    turn: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    tps: float = 0.0
    tool: str = ""


class ProgressView:
    """Use as a context manager around the run and pass `handle` as the event sink.

    Args:
        tasks: `(label, agent)` per task, in input order.
        live: a live table (default: when the console is a terminal); otherwise plain lines.
    """

    def __init__(self, console: Console, tasks: Sequence[tuple[str, str]], *, live: bool | None = None) -> None:
        self.console = console
        self.rows = {label: _Row(label, agent) for label, agent in tasks}
        self.live = console.is_terminal if live is None else live
        self._live: Live | None = None
        self._lines = EventLines(console, "tasks")

    def __enter__(self) -> ProgressView:
        if self.live:
            self._live = Live(self, console=self.console, refresh_per_second=8, transient=False)
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def handle(self, event: Event) -> None:
        row = self.rows.get(event.label)
        if row is None:
            row = self.rows[event.label] = _Row(event.label, event.agent)
        self._update(row, event)
        if not self.live:
            self._lines.handle(event)

    def _update(self, row: _Row, event: Event) -> None:
        if event.kind == "waiting":
            row.status = "waiting"
        elif event.kind == "task_start":
            row.status = "running"
        elif event.kind == "turn_start":
            row.turn = event.turn
        elif event.kind == "usage":
            usage = cast(UsageData, event.data)
            row.input_tokens, row.output_tokens = usage["input_tokens"], usage["output_tokens"]
            row.cached_tokens, row.tps = usage["cached_tokens"], usage["tps"]
        elif event.kind == "tool_call":
            row.tool = cast(ToolCallData, event.data)["description"]
        elif event.kind == "tool_result":
            row.tool = ""
        elif event.kind == "task_end":
            row.status = end_status(cast(TaskEndData, event.data))
            row.tool = ""

    def __rich__(self) -> Table:
        numbers = ("turn", "in", "out", "cached", "tok/s")
        table = make_table("task", "agent", "status", *numbers, "tool", right=numbers)
        for row in self.rows.values():
            table.add_row(
                row.label,
                row.agent,
                f"[{status_style(row.status)}]{row.status}[/]",
                str(row.turn or ""),
                _n(row.input_tokens),
                _n(row.output_tokens),
                _n(row.cached_tokens),
                f"{row.tps:.1f}" if row.tps else "",
                escape(clip(row.tool, MAX_TOOL_CHARS)),
            )
        return table


def usage_table(results: Sequence[RunResult]) -> Table:
    """One row per task and a total: status, stop reason, turns, tokens, KV cache held and time."""
    numbers = ("turns", "in", "cached", "out", "kv", "time")
    table = make_table("task", "agent", "status", "stop", *numbers, right=numbers)
    total = RunUsage()
    for r in results:
        u = r.usage
        total = total.add(u)
        table.add_row(
            r.label,
            r.agent,
            f"[{status_style(r.status)}]{r.status}[/]",
            r.stop_reason,
            str(u.turns),
            _n(u.input_tokens),
            _n(u.cached_tokens),
            _n(u.output_tokens),
            _mib(u.kv_bytes),
            f"{r.duration_s:.1f}s",
        )
    table.add_row(
        "[bold]total[/]",
        "",
        "",
        "",
        str(total.turns),
        _n(total.input_tokens),
        _n(total.cached_tokens),
        _n(total.output_tokens),
        _mib(total.kv_bytes),
        "",
    )
    return table


def _mib(n_bytes: int) -> str:
    """KV bytes a task's session holds (0 for the scripted model, which has no cache)."""
    return f"{n_bytes / 2**20:.1f} MiB" if n_bytes else ""


def _n(value: int) -> str:
    return f"{value:,}" if value else ""
