"""An MCP server's task handle, as this client takes it: polled to its result, cancelled with the caller.

The Tasks extension (`io.modelcontextprotocol/tasks`, 2026-07-28) lets a server answer a long
`tools/call` with a handle (`resultType: "task"`) and the result later through `tasks/get`. The `mcp`
SDK (2.3) lets a client claim such a result shape (`ResultClaim`) but has no Tasks client: this is it,
on the SDK's session. A client declares the extension (`Tasks()` in its extensions: its capability and
its claim); a call that comes back as a `TaskHandle` is `settle`d: `tasks/get` every `pollIntervalMs`
(within bounds) until the task ends, within the tool call's time-out. A call cancelled meanwhile (the
agent's turn, the time-out) sends `tasks/cancel` before it gives up, so the server stops the work.

Loaded with the first MCP server (`tools/mcp.py` imports it there), like the SDK itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Literal

import mcp_types as types
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from pydantic import ConfigDict, Field

from ..deadlines import within

EXTENSION = "io.modelcontextprotocol/tasks"
TERMINAL = ("completed", "failed", "cancelled")
MIN_POLL_S = 0.2
MAX_POLL_S = 5.0
DEFAULT_POLL_S = 1.0
CANCEL_WAIT_S = 5.0


class TaskFailed(Exception):
    """A task that ended without a result: `failed` (the server's JSON-RPC error) or `cancelled`."""


class TaskHandle(types.Result):
    """A `CreateTaskResult`: the task's id and where it stands."""

    model_config = ConfigDict(extra="allow")
    result_type: Literal["task"] = Field(alias="resultType")
    task_id: str = Field(alias="taskId")
    status: str
    poll_interval_ms: int | None = Field(default=None, alias="pollIntervalMs")


class DetailedTask(types.Result):
    """`tasks/get`'s answer: the task, with its result or error once it has ended."""

    model_config = ConfigDict(extra="allow")
    status: str
    status_message: str | None = Field(default=None, alias="statusMessage")
    poll_interval_ms: int | None = Field(default=None, alias="pollIntervalMs")
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


class TaskIdParams(types.RequestParams):
    task_id: str = Field(alias="taskId")


class GetTask(types.Request[TaskIdParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    name_param = "taskId"  # the routing header (`Mcp-Name`) the extension asks for on HTTP


class CancelTask(types.Request[TaskIdParams, Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    name_param = "taskId"


class Tasks(ClientExtension):
    """The extension for the SDK's `Client(extensions=[...])`: declared on every 2026-07-28 request, and a
    call answered with a task settles to its result within whatever bounds the call (its time-out)."""

    identifier = EXTENSION

    def claims(self) -> list[ResultClaim[TaskHandle]]:
        return [claim()]


async def _settle(handle: TaskHandle, ctx: ClaimContext) -> types.CallToolResult:
    return await settle(ctx.session, handle)


def claim() -> ResultClaim[TaskHandle]:
    """The SDK claim that parses a `resultType: "task"` answer as a `TaskHandle` and settles it."""
    return ResultClaim(result_type="task", model=TaskHandle, resolve=_settle)


async def settle(session: Any, handle: TaskHandle, timeout: float | None = None) -> types.CallToolResult:
    """The result of the task `handle` names, polled until it ends: `TimeoutError` after `timeout`
    seconds (None: as long as the caller waits), `TaskFailed` for a failed or cancelled task.
    Cancelled or out of time, it asks the server to cancel the task first."""
    try:
        return await within(_poll(session, handle), timeout)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        with contextlib.suppress(Exception):  # the server gone: nothing to stop
            cancel = CancelTask(params=TaskIdParams(taskId=handle.task_id))
            await asyncio.shield(within(session.send_request(cancel, types.EmptyResult), CANCEL_WAIT_S))
        raise


async def _poll(session: Any, handle: TaskHandle) -> types.CallToolResult:
    interval = handle.poll_interval_ms
    task: DetailedTask | None = None
    while task is None or task.status not in TERMINAL:
        if task is not None or handle.status not in TERMINAL:  # a handle born ended is read at once
            await asyncio.sleep(poll_seconds(interval))
        task = await session.send_request(GetTask(params=TaskIdParams(taskId=handle.task_id)), DetailedTask)
        interval = task.poll_interval_ms or interval
    if task.status == "completed":
        return types.CallToolResult.model_validate(task.result or {}, by_name=False)
    if task.status == "failed":
        error = task.error or {}
        raise TaskFailed(f"the task failed: {error.get('message', 'no error given')} ({error.get('code', '?')})")
    said = f": {task.status_message}" if task.status_message else ""
    raise TaskFailed(f"the server cancelled the task{said}")


def poll_seconds(interval_ms: Any) -> float:
    """The server's polling interval, kept within bounds (a handle without one: a second)."""
    if not isinstance(interval_ms, (int, float)) or isinstance(interval_ms, bool):
        return DEFAULT_POLL_S
    return min(max(interval_ms / 1000, MIN_POLL_S), MAX_POLL_S)


__all__ = ["EXTENSION", "TaskFailed", "TaskHandle", "Tasks", "claim", "settle"]
