"""The tools a parent uses on its background sub-agents: status, output, send, cancel.

They come with the `subagent` grant and work on the parent's own tasks only (the ids `subagent`
with `"background": true` returned). Running them is the caller's `TaskControl` (the parent's task
board, from the runner), so this module never reaches up a layer. Every problem (an unknown id, a
message to a cancelled task, a wait over the cap) is an error result that says what is possible.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from ..caps import cap_answer
from ..errors import SubagentError
from ..results import TaskStatus
from ..text import NO_ANSWER, one_line
from .base import Tool, ToolResult, error_result
from .subagent import READ_MORE
from .workspace import Workspace

# The longest a parent may block on one `subagent_output` call (it can call again).
MAX_OUTPUT_WAIT = 300
NEXT_STEPS = (
    f"call subagent_output again with wait (up to {MAX_OUTPUT_WAIT} s), steer it with subagent_send, "
    "or stop it with subagent_cancel"
)


class TaskControl(Protocol):
    """What the tools need of a parent's background tasks (the runner's `TaskBoard`)."""

    def statuses(self, task_id: str | None = None) -> list[TaskStatus]: ...
    async def output(self, task_id: str, wait: float) -> tuple[TaskStatus, str]: ...
    def send(self, task_id: str, message: str) -> str: ...
    def cancel(self, task_id: str) -> TaskStatus: ...


def status_line(status: TaskStatus) -> str:
    """`scout#1 running: turn 3, 120 tokens, 4.2s, last: grep auth`."""
    facts = [f"turn {status.turn}", f"{status.tokens} tokens", f"{status.elapsed_s:g}s"]
    if status.last_tool:
        facts.append(f"last: {one_line(status.last_tool, 60)}")
    line = f"{status.id} ({status.agent}) {status.status}: {', '.join(facts)}"
    if status.error:
        line += f"; {one_line(status.error, 120)}"
    elif status.status == "completed":
        line += f"; {one_line(status.output, 80) or NO_ANSWER}"
    if status.worktree is not None:
        line += f" {status.worktree.describe(status.id)}"
    return line


# The checks on reading a task's output, shared by `subagent_output` and MCP's `agent_output`.
def wait_problem(wait: float, then: str) -> str | None:
    """A wait over the cap, or None; `then` ends the message (what to do next, in the caller's words)."""
    if wait > MAX_OUTPUT_WAIT:
        return f"wait is at most {MAX_OUTPUT_WAIT} seconds, got {wait:g}; wait {MAX_OUTPUT_WAIT} and call again {then}"
    return None


def offset_problem(status: TaskStatus, text: str, offset: int) -> str | None:
    """An offset past the end of the task's answer (or output so far), or None."""
    if offset and offset >= len(text):
        what = "output so far" if status.status in ("queued", "running") else "answer"
        return f"offset {offset} is past the end of {status.id}'s {what} ({len(text)} characters); read from offset 0"
    return None


# No docstrings on the parameter models: pydantic would put them in the schema the model reads.
class StatusParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(default="", description="A task id; empty: all.")


class OutputParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="A task id, e.g. scout#1.")
    wait: float = Field(default=0, ge=0, description=f"Seconds to wait for its end (at most {MAX_OUTPUT_WAIT}).")
    offset: int = Field(default=0, ge=0, description="First character to read.")


class SendParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="A task id.")
    message: str = Field(description="What to tell it.")


class CancelParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="A task id.")


class _BackgroundTool(Tool):
    """A tool on the parent's background tasks; granted with `subagent`, runs on the event loop."""

    read_only = True
    writes = False
    granted_with = "subagent"

    def __init__(self, workspace: Workspace, control: TaskControl) -> None:
        super().__init__(workspace)
        self.control = control

    async def run(self, params: Any) -> ToolResult:
        try:
            return await self.act(params)
        except SubagentError as exc:  # an unknown id, a cancelled task, the cap: the parent carries on
            return error_result(str(exc))

    async def act(self, params: Any) -> ToolResult:
        raise NotImplementedError

    def describe(self, arguments: dict[str, Any]) -> str:
        return f"{self.name} {arguments.get('id') or 'all'}"


class SubagentStatusTool(_BackgroundTool):
    name = "subagent_status"
    description = "How your background sub-agents are doing."
    Params = StatusParams

    async def act(self, params: StatusParams) -> ToolResult:
        statuses = self.control.statuses(params.id or None)
        if not statuses:
            return ToolResult('No background tasks yet: start some with subagent and "background": true.')
        return ToolResult("\n".join(status_line(s) for s in statuses))


class SubagentOutputTool(_BackgroundTool):
    name = "subagent_output"
    description = "A background sub-agent's answer (or its output so far), after waiting up to `wait` seconds."
    Params = OutputParams

    async def act(self, params: OutputParams) -> ToolResult:
        if problem := wait_problem(
            params.wait, "if it is still running, or carry on and read it when its notice comes"
        ):
            return error_result(problem)
        status, text = await self.control.output(params.id, params.wait)
        if problem := offset_problem(status, text, params.offset):
            return error_result(problem)
        read_more = READ_MORE.format(id=status.id)
        body = cap_answer(text[params.offset :], None, read_more=read_more, offset=params.offset)
        if status.status in ("queued", "running"):
            body = body or "(no text yet)"
            head = f"{status_line(status)}\nIt has not finished; its output so far:"
            return ToolResult(f"{head}\n{body}\n\n[{NEXT_STEPS}]")
        body = body or NO_ANSWER
        head = f"{status.id} {status.status}" + (f": {status.error}" if status.error else "")
        if params.offset:
            head += f" (from character {params.offset})"
        if status.worktree is not None:
            head += f"\n{status.worktree.describe(status.id)}"
        return ToolResult(f"{head}\n\n{body}", is_error=status.status != "completed")


class SubagentSendTool(_BackgroundTool):
    name = "subagent_send"
    description = "Tell a background sub-agent something; it reads it before its next step."
    Params = SendParams
    read_only = False

    async def act(self, params: SendParams) -> ToolResult:
        return ToolResult(self.control.send(params.id, params.message))

    def describe(self, arguments: dict[str, Any]) -> str:
        return f"{self.name} {arguments.get('id', '?')}: {one_line(str(arguments.get('message', '')), 60)}"


class SubagentCancelTool(_BackgroundTool):
    name = "subagent_cancel"
    description = "Stop a background sub-agent."
    Params = CancelParams
    read_only = False

    async def act(self, params: CancelParams) -> ToolResult:
        status = self.control.cancel(params.id)
        return ToolResult(f"{status.id} is being cancelled; subagent_output shows what it had done")


BACKGROUND_TOOLS: tuple[type[_BackgroundTool], ...] = (
    SubagentStatusTool,
    SubagentOutputTool,
    SubagentSendTool,
    SubagentCancelTool,
)


def make_background_tools(workspace: Workspace, control: TaskControl) -> dict[str, Tool]:
    """The four tools, by name, on one parent's tasks."""
    return {cls.name: cls(workspace, control) for cls in BACKGROUND_TOOLS}
