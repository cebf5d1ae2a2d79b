"""The MCP server's background tools: start agents, look in on them, read, steer and stop them.

`start_agents` takes the `run_agents` forms and returns the new tasks' ids at once; `agent_status`,
`agent_output` (waiting up to a cap: 300 s, and never past the server's call budget, so that its
answer comes before the client gives up; read in pieces with `offset`), `send_to_agent` and
`cancel_agent` work on those ids, and on the tasks of a `run_agents` call that answered before they
ended. Every task a client starts is on one `TaskBoard` per server (ids
`scout#1`, `scout#2`, ... in start order, or the label given); at most 8 are alive at once. A
cancelled task's `bash` processes are killed as it unwinds; the server's end cancels what still
runs. Each tool answers with text for the calling model and the same facts as structured content.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import mcp_types as types
from pydantic import BaseModel, Field, ValidationError

from ..caps import MAX_ANSWER_BYTES, utf8_head
from ..deadlines import within
from ..results import TaskStatus
from ..runs.board import TaskBoard
from ..tools import background
from ..tools.background import (
    MAX_OUTPUT_WAIT,
    CancelParams,
    SendParams,
    StatusParams,
    offset_problem,
    status_line,
    wait_problem,
)
from ..userfiles import error_message, error_path

CANCELLED_BY_CLIENT = "cancelled by the MCP client"
# How long `cancel_agent` waits for the task to stop (its processes killed, its transcript saved).
CANCEL_WAIT = 10.0
NEXT_STEPS = (
    "agent_status shows how they are doing, agent_output reads an answer (with wait, it blocks until the task "
    "ends), send_to_agent steers one, cancel_agent stops one"
)


# -- what the tools take: the model-facing tools' parameters, ids as start_agents gives them -------------


class OutputParams(background.OutputParams):
    id: str = Field(description="The task's id, as start_agents returned it (e.g. scout#1).")


# -- what they return ---------------------------------------------------------------------------------


class StartedTasks(BaseModel):
    """`start_agents`'s structured content."""

    ids: list[str]
    tasks: list[TaskStatus]


class TaskList(BaseModel):
    """`agent_status`'s structured content."""

    tasks: list[TaskStatus]


class TaskOutput(BaseModel):
    """`agent_output`'s structured content: the status, and the answer (or the output so far) from `offset`.

    `next_offset` is where to read on when the text did not fit in one answer, else None.
    """

    task: TaskStatus
    text: str
    offset: int
    total_chars: int
    next_offset: int | None


class ServerTasks:
    """The tasks MCP clients started on this server: one board, and the background tools' calls on it.

    Args:
        wait_cap: the server's call budget: `agent_output` waits at most this long (None: up to 300 s).
    """

    def __init__(self, board: TaskBoard, wait_cap: float | None = None) -> None:
        self.board = board
        self.wait_cap = wait_cap

    def tools(self, start_schema: dict[str, Any], agents: str) -> list[types.Tool]:
        """The five tools; `start_schema` is `run_agents`'s input schema, `agents` the agents' list."""
        rw = types.ToolAnnotations(destructive_hint=True, open_world_hint=False)
        ro = types.ToolAnnotations(read_only_hint=True, open_world_hint=False)
        specs = [
            ("start_agents", describe_start(agents), start_schema, StartedTasks, rw),
            ("agent_status", STATUS_DESCRIPTION, StatusParams.model_json_schema(), TaskList, ro),
            ("agent_output", describe_output(self.wait_cap), self.output_schema(), TaskOutput, ro),
            ("send_to_agent", SEND_DESCRIPTION, SendParams.model_json_schema(), TaskList, rw),
            ("cancel_agent", CANCEL_DESCRIPTION, CancelParams.model_json_schema(), TaskList, rw),
        ]
        return [
            types.Tool(
                name=name, description=text, input_schema=schema, output_schema=out.model_json_schema(), annotations=ann
            )
            for name, text, schema, out, ann in specs
        ]

    def output_schema(self) -> dict[str, Any]:
        """`agent_output`'s parameters, its `wait` saying the cap that applies here."""
        schema = OutputParams.model_json_schema()
        if self.wait_cap is not None and self.wait_cap < MAX_OUTPUT_WAIT:
            schema["properties"]["wait"]["description"] = (
                f"Seconds to wait for its end (at most {self.wait_cap:g}, this server's call budget)."
            )
        return schema

    def handler(self, name: str) -> Callable[[dict[str, Any]], Awaitable[types.CallToolResult]] | None:
        """The call for a background tool's name; None for another name."""
        calls = {
            "agent_status": (StatusParams, self.status),
            "agent_output": (OutputParams, self.output),
            "send_to_agent": (SendParams, self.send),
            "cancel_agent": (CancelParams, self.cancel),
        }
        if name not in calls:
            return None
        params_model, call = calls[name]

        async def run(arguments: dict[str, Any]) -> types.CallToolResult:
            try:
                params = params_model.model_validate(arguments)
            except ValidationError as exc:
                fields = ", ".join(params_model.model_fields)
                return error(f"invalid {name} call: {problem(exc)}; it takes: {fields}")
            return await call(params)  # type: ignore[operator]

        return run

    # -- the calls (a `SubagentError` they raise becomes an error result in the server) -------------------

    def started(self, ids: list[str]) -> types.CallToolResult:
        statuses = [self.board.get(i).snapshot() for i in ids]
        text = f"Started in the background: {', '.join(ids)}. Carry on with other work; {NEXT_STEPS}."
        return result(text, StartedTasks(ids=ids, tasks=statuses))

    async def status(self, params: StatusParams) -> types.CallToolResult:
        statuses = self.board.statuses(params.id or None)
        text = "\n".join(status_line(s) for s in statuses) or "No tasks started yet: start_agents starts some."
        return result(text, TaskList(tasks=statuses))

    async def output(self, params: OutputParams) -> types.CallToolResult:
        if problem := wait_problem(params.wait, "if the task still runs"):
            return error(problem)
        capped = self.wait_cap is not None and params.wait > self.wait_cap
        status, whole = await self.board.output(params.id, min(params.wait, self.wait_cap or params.wait))
        if problem := offset_problem(status, whole, params.offset):
            return error(problem)
        ended = status.status not in ("queued", "running")
        piece, next_offset = window(whole, params.offset)
        if ended:
            head = f"{status.id} {status.status}" + (f": {status.error}" if status.error else "")
            if status.worktree is not None:
                head += f"\n{status.worktree.describe(status.id)}"
        else:
            waited = f" (waited {self.wait_cap:g} s, this server's call budget: call again)" if capped else ""
            head = f"{status_line(status)}\nIt has not finished{waited}; its output so far:"
        more = f'\n\n[more: agent_output {{"id": "{status.id}", "offset": {next_offset}}}]' if next_offset else ""
        content = TaskOutput(
            task=status, text=piece, offset=params.offset, total_chars=len(whole), next_offset=next_offset
        )
        failed = ended and status.status != "completed"
        return result(f"{head}\n\n{piece or '(no text yet)'}{more}", content, is_error=failed)

    async def send(self, params: SendParams) -> types.CallToolResult:
        said = self.board.send(params.id, params.message)
        return result(said, TaskList(tasks=[self.board.get(params.id).snapshot()]))

    async def cancel(self, params: CancelParams) -> types.CallToolResult:
        handle = self.board.stop(params.id, CANCELLED_BY_CLIENT)
        try:  # its bash processes are killed as it unwinds: answer once that is done
            await within(asyncio.shield(handle.join()), CANCEL_WAIT)
        except asyncio.TimeoutError:
            pass
        status = handle.snapshot()
        return result(f"{status.id} {status.status}; agent_output shows what it had done", TaskList(tasks=[status]))

    async def close(self) -> None:
        """The server stops: cancel what still runs and wait until it is saved."""
        await self.board.close("the MCP server stopped")


def window(text: str, offset: int, max_bytes: int = MAX_ANSWER_BYTES) -> tuple[str, int | None]:
    """`text` from `offset`, at most `max_bytes` of UTF-8; and where the rest starts (None: nothing left)."""
    piece = utf8_head(text[offset : offset + max_bytes], max_bytes)
    end = offset + len(piece)
    return piece, (end if end < len(text) else None)


def problem(exc: ValidationError) -> str:
    """The first thing wrong with a call's arguments, in words."""
    err = exc.errors()[0]
    field = error_path(err["loc"]) or "arguments"
    return f"unknown field '{field}'" if err["type"] == "extra_forbidden" else f"'{field}': {error_message(err)}"


def result(text: str, content: BaseModel, *, is_error: bool = False) -> types.CallToolResult:
    """Text and structured content; a task's `output` is left out (agent_output reads it, in pieces)."""
    exclude = {"task": {"output"}} if isinstance(content, TaskOutput) else {"tasks": {"__all__": {"output"}}}
    structured = content.model_dump(mode="json", exclude=exclude)  # type: ignore[arg-type]
    return types.CallToolResult(
        content=[types.TextContent(text=text)], structured_content=structured, is_error=is_error
    )


def error(message: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=message)], is_error=True)


STATUS_DESCRIPTION = (
    "How the tasks started with start_agents are doing: id, agent, status (queued, running, completed, failed, "
    "aborted), turn, tokens generated, last tool call, seconds; all of them, or one by id."
)


def describe_output(wait_cap: float | None) -> str:
    cap = f"{wait_cap:g}" if wait_cap is not None and wait_cap < MAX_OUTPUT_WAIT else f"{MAX_OUTPUT_WAIT}"
    return (
        f"A task's answer by id (started with start_agents, or a run_agents task still running when that call "
        f"answered), after waiting up to `wait` seconds (at most {cap}) for it to finish; before it finishes, its "
        "output so far and its status. A long answer comes in pieces: read on with `offset` (the result says where)."
    )


SEND_DESCRIPTION = (
    "Send a started task a message by id: a running one reads it before its next step (a correction, more "
    "detail); a finished one continues its conversation with it, in the background (its context kept)."
)
CANCEL_DESCRIPTION = (
    "Stop a started task by id: its commands are killed, what it had done is kept (agent_output shows it)."
)


def describe_start(agents: str) -> str:
    return (
        "Start local sub-agents in the background and get their ids at once (scout#1, scout#2, ... or the label "
        "given), then carry on with your own work; the same forms as run_agents. At most 8 started tasks are "
        f"alive at once. Then: {NEXT_STEPS}.\nAgents:\n{agents}"
    )


__all__ = ["ServerTasks"]
