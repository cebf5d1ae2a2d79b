"""The summary a multi-task command prints at the end: `usage_table`, one row per task and a total.

(While it runs, the live table is `live.LiveView`'s, and off a terminal the lines are
`render.EventLines`'s.)
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from ..render import make_table, status_style
from ..results import RunResult, RunUsage


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
