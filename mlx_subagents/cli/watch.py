"""`subagent watch`: every running task of this state folder, live, from the snapshots the running
processes publish (`runs/published.py`).

Per process: its command and workspace, each resident model's KV pool against its budget, the writer
leases (who holds each, who waits), then its tasks as a tree (sub-agents under their parent) with
what each does now, its turn, tokens, tokens/s, KV bytes and time. On a terminal it refreshes a few
times a second until Ctrl-C; elsewhere, and with `--json`, it prints one snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.text import Text

from ..render import make_table
from ..runs.published import Snapshot, TaskRow
from ..text import clip
from .live import elapsed, is_tty

REFRESH_PER_SECOND = 4
MAX_DOING_CHARS = 48
NOTHING = "nothing is running (no process of this state folder has a task)"


def _mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.1f} MiB"


def _style(task: TaskRow) -> str:
    ended = {"done": "green", "failed": "red", "skipped": "dim", "aborted": "yellow"}
    return ended.get(task.activity) or {"queued": "dim", "waiting": "yellow"}.get(task.activity, "cyan")


def process_view(snapshot: Snapshot) -> RenderableType:
    """One process: a header, its pools and leases, its tasks as a tree."""
    lines: list[RenderableType] = [
        Text.from_markup(
            f"[bold]pid {snapshot.pid}[/]  subagent {escape(snapshot.command)}  [dim]{escape(snapshot.cwd)}[/]"
        )
    ]
    for pool in snapshot.pools:
        budget = "unbounded" if pool.budget is None else _mib(pool.budget)
        lines.append(Text(f"  KV pool of {pool.model}: {_mib(pool.kv_bytes)} of {budget}"))
    for lease in snapshot.leases:
        waiting = f"; waiting: {', '.join(lease.waiting)}" if lease.waiting else ""
        lines.append(Text(f"  writer lease of {lease.workspace}: {lease.holder or 'free'}{waiting}"))
    numbers = ("turn", "in", "out", "tok/s", "kv", "time")
    table = make_table("task", "agent", "status", *numbers, right=numbers)
    for task in snapshot.tasks:
        depth = task.label.count(" > ")
        table.add_row(
            "  " * (depth + 1) + escape(task.label.rpartition(" > ")[2]),
            escape(task.agent),
            f"[{_style(task)}]{escape(clip(task.doing, MAX_DOING_CHARS))}[/]",
            str(task.turn or ""),
            f"{task.input_tokens:,}" if task.input_tokens else "",
            f"{task.output_tokens:,}" if task.output_tokens else "",
            f"{task.tps:.1f}" if task.tps else "",
            _mib(task.kv_bytes) if task.kv_bytes else "",
            elapsed(task.elapsed_s) if task.elapsed_s else "",
        )
    if snapshot.tasks:
        lines.append(table)
    return Group(*lines)


def watch_view(snapshots: list[Snapshot]) -> RenderableType:
    running = [s for s in snapshots if s.tasks]
    if not running:
        return Text(NOTHING, style="dim")
    return Group(*(process_view(s) for s in running))


def run_watch(out: Console, err: Console, *, as_json: bool, once: bool, read: Callable[[], list[Snapshot]]) -> None:
    """Print the processes' snapshots once (`--json`, `--once`, not a terminal), or live until Ctrl-C."""
    if as_json:
        snapshots = [s for s in read() if s.tasks]
        out.print_json(data={"processes": [s.model_dump(mode="json") for s in snapshots]})
        return
    if once or not is_tty(out):
        out.print(watch_view(read()))
        return
    with Live(watch_view(read()), console=out, refresh_per_second=REFRESH_PER_SECOND, transient=False) as live:
        try:
            while True:
                time.sleep(1 / REFRESH_PER_SECOND)
                live.update(watch_view(read()))
        except KeyboardInterrupt:
            pass
