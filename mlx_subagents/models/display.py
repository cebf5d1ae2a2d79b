"""How `subagent models` shows itself: the models table and the import progress bar (rich)."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..render import make_table
from .catalog import ModelInfo


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GB" if n >= 2**30 else f"{n / 2**20:.0f} MB"


def _count(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def models_table(models: list[ModelInfo]) -> Table:
    """One row per model; `*` marks the default, `fits` answers "can five sessions run here"."""
    table = make_table(
        "", "model", "source", "size", "params", "quantization", "context", "tools", "fits",
        right=("size", "params", "context"),
    )  # fmt: skip
    for m in models:
        fits = {True: "yes", False: "[red]no[/]", None: "?"}[m.fits_memory]
        table.add_row(
            "*" if m.default else "",
            m.name,
            m.source,
            _size(m.size_bytes),
            _count(m.parameters),
            m.quantization,
            str(m.context_window or "?"),
            m.tool_mode or "?",
            fits,
        )
    return table


class ImportProgress:
    """A rich bar for `import_gguf(progress=...)`: one task per conversion step."""

    def __init__(self, console: Console) -> None:
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self._task: TaskID | None = None
        self._step = ""

    def __enter__(self) -> ImportProgress:
        return self  # started at the first step: a refusal before it prints its one line alone

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._task is None:
            return
        if kind is None:
            self._finish()
        self._progress.stop()

    def _finish(self) -> None:
        """Show the current step as done (a step without counts has no total of its own)."""
        if self._task is not None:
            total = self._progress.tasks[-1].total or 1
            self._progress.update(self._task, total=total, completed=total)

    def __call__(self, step: str, done: int | None, total: int | None) -> None:
        if self._task is None:
            self._progress.start()
        if step != self._step or self._task is None:
            self._finish()  # the previous step is over
            self._task = self._progress.add_task(step, total=total)
            self._step = step
        self._progress.update(self._task, completed=done or 0, total=total)
