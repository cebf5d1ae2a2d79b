"""The live status of a running command, on a terminal: one line per running agent on stderr.

Each line says the agent's label, its turn, what it does now (`runs/live.py`: waiting for the writer
lease, waiting for the model, prefilling N tokens, decoding at X tok/s, running bash ...) and how
long it has run. `run` and `resume` show above the lines the answer as it is generated (the end of
the reply being written); `parallel`, `chain` and `workflow` show a table, one row per task and
sub-agent, with the last line each is writing. The display is rich's `Live`, transient: it goes away
when the command ends, and the answer is printed to stdout as it always is. So stdout holds exactly
the answer (or `--json`) whatever the terminal, and nothing of this reaches a pipe: it runs only when
stderr is a terminal, and not with `-q`, nor with `--events` on a terminal (its lines would cut
through the display).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..events import Event
from ..render import make_table, status_style
from ..runs.live import ENDED, LiveTasks, TaskNow
from ..text import clip

LiveLayout = Literal["task", "tasks"]
REFRESH_PER_SECOND = 4
# Lines of the answer being written shown above the status lines of `run`.
TEXT_LINES = 8
MAX_LINE_CHARS = 60
_current: LiveView | None = None


def is_tty(console: Console) -> bool:
    """Whether the console writes to a terminal: its file's own answer (FORCE_COLOR never makes a pipe one)."""
    try:
        return console.file.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def wants_live(err: Console, out: Console, *, quiet: bool, events: bool) -> bool:
    """Whether a command shows the live status: stderr is a terminal, no `-q`, and no `--events` on a
    terminal (those lines would go through the display)."""
    return not quiet and is_tty(err) and not (events and is_tty(out))


def elapsed(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 60 else f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def activity_style(task: TaskNow) -> str:
    if task.activity in ENDED:
        return status_style(task.activity)
    return {"queued": "dim", "waiting": "yellow"}.get(task.activity, "cyan")


def status_line(task: TaskNow, *, root: str = "") -> str:
    """`label · turn N · what it does · 12s` as markup; a sub-agent indented, its label after its parent's."""
    label = task.label[len(root) + 3 :] if root and task.label.startswith(root + " > ") else task.label
    parts = [f"[bold]{escape(label)}[/]"]
    if task.turn:
        parts.append(f"turn {task.turn}")
    parts.append(f"[{activity_style(task)}]{escape(task.describe())}[/]")
    if task.started is not None:
        parts.append(elapsed(task.elapsed()))
    line = " · ".join(parts)
    if task.depth and (said := task.last_line()):
        line += f" [dim]{escape(clip(said, MAX_LINE_CHARS))}[/]"
    return "  " * task.depth + line


class LiveView:
    """The live display; use as a context manager around the run, and pass `handle` as an event sink.
    It starts at the first task's start (after any question asked before the run) and is transient.

    Args:
        layout: "task" (`run`, `resume`: the answer being written, then a line per running agent) or
            "tasks" (the multi-task commands: a table).
        planned: `(label, agent)` of a multi-task command's tasks, in order.
    """

    def __init__(self, console: Console, layout: LiveLayout, planned: Sequence[tuple[str, str]] = ()) -> None:
        self.console = console
        self.layout = layout
        self.tasks = LiveTasks(planned)
        self._live: Live | None = None
        self._closed = False

    def __enter__(self) -> LiveView:
        global _current
        _current = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _current
        _current = None
        self._closed = True
        self._stop()

    def handle(self, event: Event) -> None:
        self.tasks.handle(event)
        if self._live is None and not self._closed and event.kind in ("task_start", "waiting"):
            self._start()

    def _start(self) -> None:
        self._live = Live(
            self,
            console=self.console,
            refresh_per_second=REFRESH_PER_SECOND,
            transient=True,
            redirect_stdout=False,  # stdout is the answer's: never through the display
        )
        self._live.start()

    def _stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Take the display off the terminal for the block (a question to the user), then back."""
        was_live = self._live is not None
        self._stop()
        try:
            yield
        finally:
            if was_live and not self._closed:
                self._start()

    def __rich__(self) -> RenderableType:
        return self._task_view() if self.layout == "task" else self._tasks_table()

    def _task_view(self) -> RenderableType:
        alive = self.tasks.alive()
        root = next((t for t in self.tasks.ordered() if t.parent is None), None)
        parts: list[RenderableType] = []
        if root is not None and root.alive and root.text.strip():
            lines = root.text.strip("\n").splitlines()[-TEXT_LINES:]
            parts.append(Text("\n".join(lines)))
        parts.extend(Text.from_markup(status_line(task)) for task in alive)
        return Group(*parts)

    def _tasks_table(self) -> Table:
        numbers = ("turn", "in", "out", "cached", "tok/s", "time")
        table = make_table("task", "agent", "status", *numbers, "now", right=numbers)
        for task in self.tasks.ordered():
            table.add_row(
                "  " * task.depth + escape(task.label.rpartition(" > ")[2]),
                escape(task.agent),
                f"[{activity_style(task)}]{escape(task.describe())}[/]",
                str(task.turn or ""),
                _n(task.input_tokens),
                _n(task.tokens),
                _n(task.cached_tokens),
                f"{task.tps:.1f}" if task.tps else "",
                elapsed(task.elapsed()) if task.started is not None else "",
                f"[dim]{escape(clip(task.last_line(), MAX_LINE_CHARS))}[/]" if task.alive else "",
            )
        return table


@contextmanager
def paused() -> Iterator[None]:
    """The current live display, if any, off the terminal for the block: a question asked mid-run."""
    if _current is None:
        yield
        return
    with _current.paused():
        yield


def _n(value: int) -> str:
    return f"{value:,}" if value else ""
