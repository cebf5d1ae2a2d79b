"""One renderer of a run's events as lines on the console, for every command and the chat.

The same events read three ways, by where they are shown (`Layout`):

- "task" (`run`, `resume`): the task's own tool calls, failed tool results and compactions, bare;
  a sub-agent's lines carry its `[parent > child]` label, one indent per level, and its end shows
  its status;
- "tasks" (`parallel`, `chain`, `workflow` when there is no live table): each task's start, tool
  calls and end, after its `[label]`;
- "chat": the parent's tool calls as `▸ ...`; its sub-agents relative to it (indented, `↳` when
  one starts, `✓`/`✗` when it ends); the notice of a background sub-agent's end as `● ...`.

In each, a task that waits for its workspace's writer lease says so, and what an MCP server asked of
the client shows: a completion on the local model (sampling) or the person's input (elicitation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, cast

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .events import (
    SLOT,
    ChildMessageData,
    CompactionData,
    ElicitationData,
    Event,
    HookWarningData,
    SamplingData,
    TaskEndData,
    TaskNoticeData,
    TaskStartData,
    ToolCallData,
    ToolResultData,
    WaitingData,
)
from .results import TaskStatus
from .text import clip, first_line

Layout = Literal["task", "tasks", "chat"]
CHILD = " > "
MAX_TOOL_CHARS = 60
MAX_ERROR_CHARS = 200
# Every status word a view shows and its colour, the one map for all of them: a task's progress
# (`end_status`: done, skipped, ...) and a task's or a result's status (`TaskStatus.status`: completed, ...).
STATUS_STYLES = {
    "queued": "dim",
    "waiting": "yellow",
    "running": "cyan",
    "done": "green",
    "completed": "green",
    "failed": "red",
    "skipped": "dim",
    "aborted": "yellow",
}


def status_style(status: object) -> str:
    """The colour of a status word; one no view knows is a failure's."""
    return STATUS_STYLES.get(str(status), "red")


def end_status(data: TaskEndData) -> str:
    """`done`, `failed`, `skipped` or `aborted`, from a `task_end` event's data."""
    if data["stop_reason"] == "skipped":
        return "skipped"
    return {"completed": "done", "aborted": "aborted"}.get(data["status"], "failed")


def server_request_line(event: Event) -> str:
    """`mcp demo sampled 12 tokens (smollm2)`, `mcp demo asked "Your name?": declined: ...` (markup)."""
    if event.kind == "sampling":
        sample = cast(SamplingData, event.data)
        if sample["error"]:
            return f"[yellow]mcp {escape(sample['server'])}: {escape(sample['error'])}[/]"
        return (
            f"[dim]mcp {escape(sample['server'])} sampled {sample['output_tokens']:,} tokens "
            f"({escape(sample['model'])}, {sample['input_tokens']:,} read)[/]"
        )
    asked = cast(ElicitationData, event.data)
    what = f'mcp {escape(asked["server"])} asked "{escape(clip(first_line(asked["message"]), MAX_TOOL_CHARS))}"'
    if asked["reason"]:
        return f"[yellow]{what}: declined: {escape(asked['reason'])}[/]"
    return f"[dim]{what}: {asked['action']}[/]"


class EventLines:
    """Prints one line per notable event; pass `handle` as an event sink.

    Args:
        layout: which reading of the events (see the module docstring).
        root: in a chat, the parent's label; its sub-agents are shown relative to it.
        before_line: called before each line (the chat ends the reply being streamed).
        verbose: first say which model runs a top-level task and how it was given its tools.
    """

    def __init__(
        self,
        console: Console,
        layout: Layout,
        *,
        root: str = "",
        before_line: Callable[[], None] | None = None,
        verbose: bool = False,
    ) -> None:
        self.console = console
        self.layout = layout
        self.root = root
        self.before_line = before_line
        self.verbose = verbose

    def handle(self, event: Event) -> None:
        markup = self.line(event)
        if markup is None:
            return
        if self.before_line is not None:
            self.before_line()
        self.console.print(markup)

    def line(self, event: Event) -> str | None:
        """The event's line as rich markup, or None when the layout does not show it."""
        if event.kind == "hook_warning":  # in every layout: a hook the user relies on did not run as meant
            where = f"[dim]\\[{escape(event.label)}][/] " if event.label else ""
            return f"{where}[yellow]warning: {escape(cast(HookWarningData, event.data)['message'])}[/]"
        if event.kind in ("sampling", "elicitation"):  # in every layout: a server used the model or asked
            own = event.label in (self.root, event.agent) and self.layout != "tasks"  # bare, as its tool calls
            where = f"[dim]\\[{escape(event.label)}][/] " if event.label and not own else ""
            return where + server_request_line(event)
        if event.kind == "waiting" and cast(WaitingData, event.data).get("waiting_for") == SLOT:
            return None  # a queue, not news: the live views and `subagent watch` show it
        if self.layout == "tasks":
            return self._tasks_line(event)
        if self.layout == "task":
            return self._task_line(event)
        if event.label == self.root:
            return self._own_line(event, "", mark="▸ ")
        if self.root and event.label.startswith(self.root + CHILD):
            return self._child_line(event)
        return None

    def _task_line(self, event: Event) -> str | None:
        if self.verbose and event.kind == "task_start" and CHILD not in event.label:
            start = cast(TaskStartData, event.data)
            return f"[dim]{escape(event.label)} on {escape(start['model'])} (tool mode: {start['tool_mode']})[/]"
        prefix = f"[dim]\\[{escape(event.label)}][/] " if event.label != event.agent else ""
        prefix = "  " * event.label.count(CHILD) + prefix
        if event.kind == "waiting":
            return f"{prefix}[yellow]waiting: {escape(cast(WaitingData, event.data)['reason'])}[/]"
        if event.kind == "task_end" and CHILD in event.label:  # a sub-agent's end, under its parent's call
            end = cast(TaskEndData, event.data)
            reason = f": {escape(end['error'])}" if end["error"] else ""
            return f"{prefix}[{status_style(end['status'])}]{end['status']}{reason}[/]"
        return self._own_line(event, prefix)

    def _tasks_line(self, event: Event) -> str | None:
        prefix = f"[dim]\\[{event.label}][/]"
        if event.kind == "task_start":
            return f"{prefix} started ({event.agent})"
        if event.kind == "waiting":
            return f"{prefix} [yellow]waiting[/]: {escape(cast(WaitingData, event.data)['reason'])}"
        if event.kind == "tool_call":
            return f"{prefix} [cyan]{escape(clip(cast(ToolCallData, event.data)['description'], MAX_TOOL_CHARS))}[/]"
        if event.kind == "task_end":
            end = cast(TaskEndData, event.data)
            status = end_status(end)
            reason = end["error"] or end["stop_reason"]
            detail = "" if status == "done" else f": {reason}"
            return f"{prefix} [{status_style(status)}]{status}[/]{escape(detail)}"
        return None

    def _own_line(self, event: Event, prefix: str, mark: str = "") -> str | None:
        """A task's own tool calls, failed tool results (under the call) and compactions."""
        if event.kind == "tool_call":
            return f"{prefix}[cyan]{mark}{escape(cast(ToolCallData, event.data)['description'])}[/]"
        if event.kind == "tool_result" and (result := cast(ToolResultData, event.data))["is_error"]:
            return f"{prefix}{' ' * len(mark)}[red]{escape(first_line(result['output'], MAX_ERROR_CHARS, cut=''))}[/]"
        if event.kind == "child_message":  # a sub-agent said something while it works (`parent_send`)
            said = cast(ChildMessageData, event.data)
            return f"{prefix}[magenta]✉ {escape(said['id'])}:[/] {escape(first_line(said['message'], MAX_ERROR_CHARS))}"
        if event.kind == "task_notice":  # a background call ended
            notice = cast(TaskNoticeData, event.data)
            style = status_style(notice["status"])
            return f"{prefix}[{style}]● {escape(notice['id'])} {notice['status']}:[/] {escape(notice['first_line'])}"
        if event.kind == "compaction":
            counts = cast(CompactionData, event.data)
            before, after = counts["tokens_before"], counts["tokens_after"]
            sep = "," if self.layout == "chat" else ""  # `run` prints plain numbers, as it always has
            return f"{prefix}[yellow]compacted {before:{sep}} -> {after:{sep}} tokens[/]"
        return None

    def _child_line(self, event: Event) -> str | None:
        path = event.label[len(self.root) + len(CHILD) :]
        indent = "  " * (path.count(CHILD) + 1)
        if event.kind == "task_start":
            return f"{indent}[dim]↳ {escape(path)} ({event.agent}) started[/]"
        if event.kind == "waiting":
            return f"{indent}[yellow]… {escape(path)} waiting: {escape(cast(WaitingData, event.data)['reason'])}[/]"
        if event.kind == "tool_call":
            return f"{indent}  [dim]{escape(path)}:[/] [cyan]{escape(cast(ToolCallData, event.data)['description'])}[/]"
        if event.kind != "task_end":
            return None
        end = cast(TaskEndData, event.data)
        if end["status"] == "completed":
            turns = end["usage"]["turns"] if "usage" in end else 0
            return f"{indent}[green]✓ {escape(path)} completed[/] [dim]({turns} turns)[/]"
        reason = end["error"] or end["stop_reason"]
        style = status_style(end["status"])
        return f"{indent}[{style}]✗ {escape(path)} {end['status']}: {escape(reason)}[/]"


def make_table(*columns: str, right: tuple[str, ...] = ()) -> Table:
    """A borderless table with bold headers, the house style of every table the commands print;
    the columns named in `right` (numbers) are right-aligned."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in columns:
        table.add_column(name, justify="right" if name in right else "left")
    return table


def tasks_table(tasks: list[TaskStatus]) -> Table:
    """Background tasks as a table: id, agent, status, turn, tokens, last tool, elapsed."""
    table = make_table(
        "id", "agent", "status", "turn", "tokens", "last tool", "elapsed", right=("turn", "tokens", "elapsed")
    )
    for t in tasks:
        table.add_row(
            escape(t.id),
            escape(t.agent),
            f"[{status_style(t.status)}]{t.status}[/]",
            str(t.turn),
            f"{t.tokens:,}",
            escape(clip(t.last_tool or "-", 40)),
            f"{t.elapsed_s:.1f}s",
        )
    return table
