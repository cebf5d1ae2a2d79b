"""What a client is told while the agents work: progress notifications and log messages.

- `Progress`: one request's runner events as progress notifications (a call with a progress token),
  sent in order; progress counts the notifications.
- `ClientLog`: the logging capability. A client sets its level with `logging/setLevel` (default
  `warning`) and gets `notifications/message` at or above it: warnings (a hook or an MCP server that
  failed, a task that failed) and each agent's progress (`info`: starts, tool calls, ends, notices;
  `debug`: turns, tokens, tool results), the logger being the task's label. The SDK sends whatever
  it is handed on the 2025 protocol versions (filtering is the application's job there), so the
  level is applied here, per connection.
- `on_event`: the runner's sink; an event goes to the call its task belongs to (`call_progress`,
  `call_client`: child tasks inherit the context of the call that started them).

The SDK marks logging deprecated as of the 2026-07-28 revision (SEP-2577) and warns when it is set
up or used; every client speaks a 2025 version today, where logging is part of the protocol, so the
warning is silenced at those two places only (`quiet`), and tests that turn warnings into errors pass.
Nothing here knows a transport: `subagent mcp` (stdio) and an HTTP server share it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import io
import logging
import warnings
from collections.abc import Iterator
from typing import Any, cast, get_args

import mcp_types as types
from mcp.server.session import ServerSession
from mcp.shared.exceptions import MCPDeprecationWarning
from rich.console import Console
from rich.text import Text

from ..events import Event, TaskEndData, ToolCallData, UsageData
from ..render import EventLines

LEVELS: tuple[types.LoggingLevel, ...] = get_args(types.LoggingLevel)
DEFAULT_LEVEL: types.LoggingLevel = "warning"
LOGGER = "mlx-subagents"  # a message that belongs to no task
# How many log messages may wait to be sent before the oldest is dropped (a client that stopped reading).
MAX_QUEUED = 1000
# How long a call's answer waits for its log messages to be sent first.
FLUSH_WAIT_S = 1.0

log = logging.getLogger("mlx_subagents.mcp")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Around the SDK's logging set-up and sends: its deprecation warning (see the module docstring)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MCPDeprecationWarning)
        yield


def progress_message(event: Event, lines: EventLines) -> str | None:
    """One plain line for a calling agent or its user, or None for events that add nothing.

    Starts, tool calls, waits and ends read as `subagent parallel` prints them (the one renderer);
    a client's progress also counts the turns and the tokens.
    """
    if event.kind == "turn_start":
        return f"[{event.label}] turn {event.turn}"
    if event.kind == "usage":
        usage = cast(UsageData, event.data)
        return (
            f"[{event.label}] {usage['output_tokens']:,} tokens generated, "
            f"{usage['input_tokens']:,} read ({usage['cached_tokens']:,} cached)"
        )
    markup = lines.line(event)
    return Text.from_markup(markup).plain if markup is not None else None


def plain_lines() -> EventLines:
    """The renderer's task-table layout, its lines kept as plain text (only `line()` is used)."""
    return EventLines(Console(file=io.StringIO()), "tasks")


class Progress:
    """Turns one request's runner events into progress notifications, sent in order by `pump`."""

    def __init__(self, session: ServerSession) -> None:
        self.session = session
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.n_sent = 0
        self.closed = False
        self.lines = plain_lines()

    def push(self, event: Event) -> None:
        message = progress_message(event, self.lines)
        if message is not None and not self.closed:
            self.queue.put_nowait(message)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.queue.put_nowait(None)

    async def pump(self) -> None:
        """Send queued messages until `close`; progress counts the notifications (it must grow)."""
        while (message := await self.queue.get()) is not None:
            self.n_sent += 1
            try:
                await self.session.report_progress(self.n_sent, None, message)
            except Exception as exc:  # a client gone or a closed stream: the run itself goes on
                log.warning("progress notification not sent: %s", exc)


def event_level(event: Event) -> types.LoggingLevel | None:
    """The level an event is logged at; None for what a log does not carry (streamed text, answers)."""
    if event.kind == "hook_warning":
        return "warning"
    if event.kind == "task_end":
        status = cast(TaskEndData, event.data)["status"]
        return "info" if status == "completed" else "warning"
    if event.kind in (
        "task_start",
        "tool_call",
        "waiting",
        "task_notice",
        "child_message",
        "task_send",
        "task_cancel",
        "compaction",
    ):
        return "info"
    if event.kind in ("turn_start", "usage", "tool_result"):
        return "debug"
    return None  # reasoning and message: the text itself, which the result carries


class ClientLog:
    """One client connection's log messages: those at or above the level it set, sent in order.

    A message that belongs to a call in progress goes with that call (on streamable HTTP, on its
    response stream); one from a task still running after its call answered, on the connection's
    own channel.
    """

    def __init__(self) -> None:
        self.level: types.LoggingLevel = DEFAULT_LEVEL
        self.session: ServerSession | None = None  # the latest request's: any of them sends on the connection
        self.calls: set[types.RequestId] = set()  # requests in progress
        self.lines = plain_lines()
        self._queue: asyncio.Queue[tuple[types.LoggingLevel, str, str, types.RequestId | None]] = asyncio.Queue()
        self._pump: asyncio.Task[None] | None = None

    def wants(self, level: types.LoggingLevel) -> bool:
        return LEVELS.index(level) >= LEVELS.index(self.level)

    def event(self, event: Event, request_id: types.RequestId | None) -> None:
        """Log a runner event at its level (`event_level`), as its progress line."""
        level = event_level(event)
        if level is None or not self.wants(level):
            return
        text = progress_message(event, self.lines)
        if text is not None:
            self.push(level, text, event.label or LOGGER, request_id)

    def push(self, level: types.LoggingLevel, text: str, logger: str = LOGGER, request_id: Any = None) -> None:
        """Queue one message if the client wants its level; sent in order by one task."""
        if self.session is None or not self.wants(level):
            return
        if self._queue.qsize() >= MAX_QUEUED:
            self._queue.get_nowait()
        self._queue.put_nowait((level, text, logger, request_id))
        if self._pump is None or self._pump.done():
            self._pump = asyncio.ensure_future(self._send_all())

    async def _send_all(self) -> None:
        while not self._queue.empty():
            level, text, logger, request_id = self._queue.get_nowait()
            related = request_id if request_id in self.calls else None
            assert self.session is not None
            try:
                with quiet():
                    sending = self.session.send_log_message(level, text, logger=logger, related_request_id=related)
                await sending
            except Exception as exc:  # a client gone: the agents go on
                log.warning("log message not sent to the client: %s", exc)
                return

    async def flush(self, within: float = FLUSH_WAIT_S) -> None:
        """Wait (a moment at most) until what is queued is sent: a call's messages go before its answer."""
        if self._pump is not None and not self._pump.done():
            await asyncio.wait({self._pump}, timeout=within)

    async def close(self) -> None:
        """Stop sending (the connection ends)."""
        if self._pump is not None and not self._pump.done():
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)


# The request an event belongs to: child tasks inherit the context of the call that started them.
call_progress: contextvars.ContextVar[Progress | None] = contextvars.ContextVar("mcp_progress", default=None)
# The client whose call started the event's task, and that call's request id: its log messages.
call_client: contextvars.ContextVar[tuple[ClientLog, Any] | None] = contextvars.ContextVar("mcp_client", default=None)


def on_event(event: Event) -> None:
    """The runner's sink: an event goes to the progress of the call it belongs to, if any."""
    progress = call_progress.get()
    if progress is not None:
        progress.push(event)
    if (client := call_client.get()) is not None:
        client[0].event(event, client[1])
    if event.kind == "tool_call":
        log.debug("%s %s %s", event.label, event.kind, cast(ToolCallData, event.data)["description"])
    elif event.kind == "task_end":
        log.debug("%s %s %s", event.label, event.kind, cast(TaskEndData, event.data)["status"])
    elif event.kind == "task_start":
        log.debug("%s %s ", event.label, event.kind)


__all__ = [
    "DEFAULT_LEVEL",
    "LEVELS",
    "ClientLog",
    "Progress",
    "call_client",
    "call_progress",
    "event_level",
    "on_event",
    "progress_message",
    "quiet",
]
