"""MCP Tasks (`io.modelcontextprotocol/tasks`, 2026-07-28): a long tool call answered with a task handle.

The `mcp` SDK (2.3) knows the revision, dispatches extension methods and lets a `tools/call` handler
answer with an extension result (`resultType: "task"`), but has no Tasks extension: no store, no
`tasks/get`, `tasks/update` or `tasks/cancel`. This is the smallest part written on its lowlevel
server (`CallTasks.install`): a store of the calls answered with a task, and the three methods.

- A call whose request declares the extension (its `_meta` client capabilities, per request) may be
  answered at once with a `CreateTaskResult` (`start`): the task is in the store before the answer
  goes out, so the first `tasks/get` finds it.
- `tasks/get` gives the task: `working` with a status message (the work's own words: for agents,
  each task's turn, tokens and last tool call), then `completed` with the call's result inlined (a
  tool that reported an error is still `completed`, `isError` in its result), `failed` with the
  JSON-RPC error the work raised, or `cancelled`.
- `tasks/cancel` asks the work to stop and acknowledges at once; the status turns `cancelled` once
  it has (its processes killed, what it did saved).
- Work that must ask the client during the task (`ask`) parks it `input_required`: `tasks/get` shows
  the requests still unanswered, `tasks/update` delivers answers (all, or some: the task waits for the
  rest; a key not outstanding is ignored).
- Task ids are unguessable (they are the only key to a task: there is no `tasks/list`); a task is
  kept `ttlMs` after its creation, so a client that reconnects later still reads it. A request that
  does not declare the extension gets -32021 for the three methods, and on HTTP each needs
  `Mcp-Name: <taskId>` (-32020 otherwise), as the extension says.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

import mcp_types as types
from mcp.server import Server, ServerRequestContext
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import ConfigDict, Field

from ..tools.mcp_tasks import EXTENSION

DEFAULT_TTL_S = 24 * 3600.0
DEFAULT_POLL_MS = 1000
MISSING_CAPABILITY = "Missing required client capability"
Status = Literal["working", "input_required", "completed", "failed", "cancelled"]

log = logging.getLogger("mlx_subagents.mcp")


class TaskParams(types.RequestParams):
    """`tasks/get` and `tasks/cancel`: the task's id."""

    task_id: str = Field(alias="taskId")


class UpdateParams(TaskParams):
    """`tasks/update`: the answers to a task's input requests."""

    model_config = ConfigDict(extra="allow")
    input_responses: dict[str, Any] = Field(alias="inputResponses")


@dataclass
class CallTask:
    """One call answered with a task: its work, and where it stands."""

    id: str
    work: asyncio.Future[types.CallToolResult]
    describe: Callable[[], str]  # the status message while it works
    cancel: Callable[[], None]  # asks the work to stop
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    cancelling: bool = False
    # What the work asks the client (`ask`): each request by its key, and its answer once given.
    asked: dict[str, dict[str, Any]] = field(default_factory=dict)
    answers: dict[str, asyncio.Future[Any]] = field(default_factory=dict)

    @property
    def status(self) -> Status:
        if not self.work.done():
            return "input_required" if self.pending() else "working"
        if self.work.cancelled() or self.cancelling:
            return "cancelled"
        return "failed" if self.work.exception() is not None else "completed"

    def pending(self) -> dict[str, dict[str, Any]]:
        """The requests the work waits on, by key."""
        return {key: request for key, request in self.asked.items() if not self.answers[key].done()}


# The task whose work runs in this context (`ask`).
_current: contextvars.ContextVar[CallTask | None] = contextvars.ContextVar("mcp_call_task", default=None)


class CallTasks:
    """The calls of one server answered with a task, and the extension's methods over them.

    Args:
        ttl_s: how long a task is kept after its creation (`ttlMs`).
        poll_ms: the polling interval clients are asked to keep (`pollIntervalMs`).
    """

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, poll_ms: int = DEFAULT_POLL_MS) -> None:
        self.ttl_s = ttl_s
        self.poll_ms = poll_ms
        self.tasks: dict[str, CallTask] = {}

    def install(self, server: Server[Any]) -> None:
        """Advertise the extension and serve its three methods on `server`."""
        server.extensions[EXTENSION] = {}
        server.add_request_handler("tasks/get", TaskParams, self.get)
        server.add_request_handler("tasks/update", UpdateParams, self.update)
        server.add_request_handler("tasks/cancel", TaskParams, self.cancel)

    # -- making a task --------------------------------------------------------------------------------

    def start(
        self,
        work: Awaitable[types.CallToolResult],
        describe: Callable[[], str],
        cancel: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """Hold `work` as a task and return the `CreateTaskResult` to answer the call with.

        Args:
            describe: the status message while it works.
            cancel: asks the work to stop (default: cancel it).
        """
        self._expire()
        holder: list[CallTask] = []

        async def run() -> types.CallToolResult:
            _current.set(holder[0])  # this task's own context: `ask` finds the task it runs for
            return await work

        future = asyncio.ensure_future(run())
        task = CallTask(secrets.token_urlsafe(24), future, describe, cancel or future.cancel)
        holder.append(task)
        future.add_done_callback(lambda done: self._ended(task, done))
        self.tasks[task.id] = task
        return {"resultType": "task", **self._envelope(task)}

    def _ended(self, task: CallTask, done: asyncio.Future[types.CallToolResult]) -> None:
        task.updated = time.time()
        if not done.cancelled() and (exc := done.exception()) is not None and not isinstance(exc, MCPError):
            log.error("task %s failed: %r", task.id, exc)

    # -- the methods ----------------------------------------------------------------------------------

    async def get(self, ctx: ServerRequestContext[Any], params: TaskParams) -> dict[str, Any]:
        task = self._find(ctx, params.task_id, "retrieve")
        detail = self._envelope(task)
        if task.status == "input_required":
            detail["inputRequests"] = task.pending()
        elif task.status == "completed":
            detail["result"] = task.work.result().model_dump(by_alias=True, mode="json", exclude_none=True)
        elif task.status == "failed":
            detail["error"] = error_of(task.work.exception())
        return detail

    async def update(self, ctx: ServerRequestContext[Any], params: UpdateParams) -> dict[str, Any]:
        task = self._find(ctx, params.task_id, "update")
        for key, answer in params.input_responses.items():
            if key in task.pending():  # a key never asked, or answered already, is ignored
                task.answers[key].set_result(answer)
                task.updated = time.time()
        return {}

    async def cancel(self, ctx: ServerRequestContext[Any], params: TaskParams) -> dict[str, Any]:
        task = self._find(ctx, params.task_id, "cancel")
        if not task.work.done() and not task.cancelling:
            task.cancelling = True
            task.updated = time.time()
            task.cancel()
        return {}

    def _find(self, ctx: ServerRequestContext[Any], task_id: str, verb: str) -> CallTask:
        """The task a request names, once the request may ask (the extension declared, the routing header)."""
        if not declares(ctx):
            raise MCPError(
                code=types.MISSING_REQUIRED_CLIENT_CAPABILITY,
                message=MISSING_CAPABILITY,
                data={"requiredCapabilities": {"extensions": {EXTENSION: {}}}},
            )
        headers = getattr(ctx.request, "headers", None)
        if headers is not None and headers.get("mcp-name", "").strip() != task_id:
            raise MCPError(
                code=types.HEADER_MISMATCH, message=f"the Mcp-Name header must be the task id of {ctx.method}"
            )
        self._expire()
        task = self.tasks.get(task_id)
        if task is None:
            raise MCPError(code=types.INVALID_PARAMS, message=f"Failed to {verb} task: Task not found")
        return task

    def _envelope(self, task: CallTask) -> dict[str, Any]:
        status = task.status
        if status == "working":
            message = task.describe()
        elif status == "cancelled":
            message = "cancelled: " + (task.describe() if task.work.done() else "stopping")
        else:
            message = f"{status}: {task.describe()}"
        return {
            "taskId": task.id,
            "status": status,
            "statusMessage": message,
            "createdAt": iso(task.created),
            "lastUpdatedAt": iso(task.updated),
            "ttlMs": int(self.ttl_s * 1000),
            "pollIntervalMs": self.poll_ms,
        }

    def _expire(self) -> None:
        """Forget the tasks past their time to live (their work, if any, is asked to stop first)."""
        now = time.time()
        for task_id, task in list(self.tasks.items()):
            if now - task.created > self.ttl_s:
                if not task.work.done():
                    task.cancel()
                del self.tasks[task_id]

    async def close(self) -> None:
        """The server stops: every task still working is asked to stop, and waited for."""
        working = [t for t in self.tasks.values() if not t.work.done()]
        for task in working:
            task.cancelling = True
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*(t.work for t in working), return_exceptions=True)


async def ask(requests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """From a task's work: ask the client (`{key: {"method": ..., "params": ...}}`, each key new for the
    task) and wait for its answers, given through `tasks/update`; meanwhile the task is `input_required`."""
    task = _current.get()
    if task is None:
        raise RuntimeError("ask() is for the work of a call answered with a task")
    loop = asyncio.get_running_loop()
    for key, request in requests.items():
        if key in task.asked:
            raise ValueError(f"input request key {key!r} was used before in this task; each key is asked once")
        task.asked[key], task.answers[key] = request, loop.create_future()
    task.updated = time.time()
    return {key: await task.answers[key] for key in requests}


def declares(ctx: ServerRequestContext[Any]) -> bool:
    """Whether this request may be answered with a task: a 2026-07-28 request whose client capabilities
    (its own `_meta`) name the extension. The 2025 revisions carry no extension results."""
    if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
        return False
    caps = ctx.session.client_capabilities
    return caps is not None and EXTENSION in (caps.extensions or {})


def error_of(exc: BaseException | None) -> dict[str, Any]:
    """The JSON-RPC error a failed task carries: an `MCPError`'s own, else an internal error."""
    if isinstance(exc, MCPError):
        return exc.error.model_dump(by_alias=True, mode="json", exclude_none=True)
    return {"code": types.INTERNAL_ERROR, "message": f"Internal error: {type(exc).__name__}"}


def iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


__all__ = ["EXTENSION", "CallTask", "CallTasks", "ask", "declares"]
