"""One colour per status word, in every view that shows one (`render.STATUS_STYLES`)."""

from __future__ import annotations

import io

from rich.console import Console

from mlx_subagents.cli.live import LiveView
from mlx_subagents.cli.progress import usage_table
from mlx_subagents.events import Event, TaskEndData
from mlx_subagents.render import EventLines, tasks_table
from mlx_subagents.results import RunResult, TaskStatus

ABORTED = TaskEndData(status="aborted", stop_reason="cancelled", error="aborted by the user (Ctrl-C)")
YELLOW, GREEN, RED = "\x1b[33m", "\x1b[32m", "\x1b[31m"


def ansi(renderable: object) -> str:
    console = Console(file=io.StringIO(), force_terminal=True, color_system="standard", width=200)
    console.print(renderable)
    return console.file.getvalue()  # type: ignore[attr-defined]


def test_an_aborted_sub_agent_is_yellow_in_every_layout() -> None:
    end = Event(kind="task_end", label="o > scout", agent="scout", data=ABORTED)
    console = Console(file=io.StringIO())
    # The `run` layout showed it red, unlike the others, before one map served them all.
    assert (
        EventLines(console, "task").line(end)
        == "  [dim]\\[o > scout][/] [yellow]aborted: aborted by the user (Ctrl-C)[/]"
    )
    assert (
        EventLines(console, "chat", root="o").line(end) == "  [yellow]✗ scout aborted: aborted by the user (Ctrl-C)[/]"
    )
    assert (
        EventLines(console, "tasks").line(end)
        == "[dim]\\[o > scout][/] [yellow]aborted[/]: aborted by the user (Ctrl-C)"
    )


def test_the_tables_colour_statuses_from_the_same_map() -> None:
    statuses = [TaskStatus(id=f"scout#{i}", agent="scout", status=s) for i, s in enumerate(["completed", "aborted"])]
    assert f"{GREEN}completed" in ansi(tasks_table(statuses)) and f"{YELLOW}aborted" in ansi(tasks_table(statuses))

    results = [RunResult(agent="scout", task="t", status=s, label=s) for s in ("completed", "failed", "aborted")]
    summary = ansi(usage_table(results))
    assert all(
        f"{colour}{status}" in summary
        for colour, status in zip((GREEN, RED, YELLOW), ("completed", "failed", "aborted"))
    )

    view = LiveView(Console(file=io.StringIO()), "tasks", [("a", "scout"), ("b", "scout")])
    done = TaskEndData(status="completed", stop_reason="completed", error=None)
    view.handle(Event(kind="task_end", label="a", agent="scout", data=done))
    view.handle(Event(kind="task_end", label="b", agent="scout", data=ABORTED))
    progress = ansi(view)
    assert f"{GREEN}done" in progress and f"{YELLOW}aborted" in progress
