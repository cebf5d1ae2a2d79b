"""The tools an agent uses on its tasks: `task_status`, `task_output`, `task_send`, `task_cancel`.

One set for both kinds of task an agent starts: its sub-agents (`subagent`, background or not) and its
background commands (`bash` with `"background": true`, ids `bash#1`), as Claude Code's `TaskOutput`
reads background shells and agents alike. They come with the `subagent` grant, or with `bash` (then
only `task_output` and `task_cancel`: a command reads no messages, its output's head is its status,
and every tool costs a small model's context), and work on
the agent's own tasks only. Running them is the caller's `TaskControl` (the agent's task board, from
the runner), so this module never reaches up a layer. Every problem (an unknown id, a message to a
cancelled task or to a command, a wait over the cap) is an error result that says what is possible.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from ..caps import cap_answer
from ..errors import SubagentError
from ..results import TaskStatus
from ..text import NO_ANSWER, one_line
from .base import Tool, ToolResult, error_result
from .delegation import READ_MORE
from .workspace import Workspace

# The longest an agent may block on one `task_output` call (it can call again).
MAX_OUTPUT_WAIT = 300
NEXT_STEPS = (
    f"call task_output again with wait (up to {MAX_OUTPUT_WAIT} s), steer it with task_send, "
    "or stop it with task_cancel"
)
COMMAND_NEXT_STEPS = f"call task_output again with wait (up to {MAX_OUTPUT_WAIT} s), or stop it with task_cancel"


class TaskControl(Protocol):
    """What the tools need of a parent's background tasks (the runner's `TaskBoard`)."""

    def statuses(self, task_id: str | None = None) -> list[TaskStatus]: ...
    async def output(self, task_id: str, wait: float) -> tuple[TaskStatus, str]: ...
    def send(self, task_id: str, message: str) -> str: ...
    def cancel(self, task_id: str) -> TaskStatus: ...


def status_line(status: TaskStatus) -> str:
    """`scout#1 running: turn 3, 120 tokens, 4.2s, last: grep auth`; a command's
    `bash#1 (bash) completed: 3.2s, $ pytest -q; last line: 5 passed`."""
    if status.kind == "command":
        line = f"{status.id} ({status.agent}) {status.status}: {status.elapsed_s:g}s, {one_line(status.last_tool or '', 60)}"
        if status.error:
            line += f"; {one_line(status.error, 120)}"
        return line + (f"; last line: {one_line(status.output, 80)}" if status.output else "")
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


# The checks on reading a task's output, shared by `task_output` and MCP's `agent_output`.
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
    wait: float = Field(default=0, ge=0, description=f"Seconds to wait for its answer (at most {MAX_OUTPUT_WAIT}).")


class CancelParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="A task id.")


class _BackgroundTool(Tool):
    """A tool on the agent's tasks; granted with `subagent` (or, for an agent without it, with `bash`:
    `granted_by`), runs on the event loop."""

    read_only = True
    writes = False
    granted_with = "subagent"

    def __init__(self, workspace: Workspace, control: TaskControl, granted_by: str = "subagent") -> None:
        super().__init__(workspace)
        self.control = control
        self.granted_by = granted_by

    @property
    def grant(self) -> str:
        return self.granted_by

    async def run(self, params: Any) -> ToolResult:
        try:
            return await self.act(params)
        except SubagentError as exc:  # an unknown id, a cancelled task, the cap: the parent carries on
            return error_result(str(exc))

    async def act(self, params: Any) -> ToolResult:
        raise NotImplementedError

    def describe(self, arguments: dict[str, Any]) -> str:
        return f"{self.name} {arguments.get('id') or 'all'}"


class TaskStatusTool(_BackgroundTool):
    name = "task_status"
    description = "How your tasks are doing."
    Params = StatusParams

    async def act(self, params: StatusParams) -> ToolResult:
        statuses = self.control.statuses(params.id or None)
        if not statuses:
            return ToolResult('No tasks yet: start some with "background": true.')
        return ToolResult("\n".join(status_line(s) for s in statuses))


class TaskOutputTool(_BackgroundTool):
    name = "task_output"
    description = "A task's answer or output (so far), after waiting up to `wait` seconds."
    Params = OutputParams

    async def act(self, params: OutputParams) -> ToolResult:
        if problem := wait_problem(
            params.wait, "if it is still running, or carry on and read it when its notice comes"
        ):
            return error_result(problem)
        status, text = await self.control.output(params.id, params.wait)
        if problem := offset_problem(status, text, params.offset):
            return error_result(problem)
        return output_result(status, text, params.offset)


def output_result(status: TaskStatus, text: str, offset: int = 0) -> ToolResult:
    """What `task_output` (and `task_send` with `wait`) answers: the task's answer from `offset`, capped,
    or its output so far and what to do next while it runs."""
    read_more = READ_MORE.format(id=status.id)
    body = cap_answer(text[offset:], None, read_more=read_more, offset=offset)
    command = status.kind == "command"
    if status.status in ("queued", "running"):
        body = body or ("(no output yet)" if command else "(no text yet)")
        head = f"{status_line(status)}\nIt has not finished; its output so far:"
        return ToolResult(f"{head}\n{body}\n\n[{COMMAND_NEXT_STEPS if command else NEXT_STEPS}]")
    body = body or ("(no output)" if command else NO_ANSWER)
    head = f"{status.id} {status.status}" + (f": {status.error}" if status.error else "")
    if command:
        head += f" ({one_line(status.last_tool or '', 80)})"
    if offset:
        head += f" (from character {offset})"
    if status.worktree is not None:
        head += f"\n{status.worktree.describe(status.id)}"
    return ToolResult(f"{head}\n\n{body}", is_error=status.status != "completed")


class TaskSendTool(_BackgroundTool):
    name = "task_send"
    description = "Tell a sub-agent something (it reads it before its next step); with wait, get its answer."
    Params = SendParams
    read_only = False

    async def act(self, params: SendParams) -> ToolResult:
        if problem := wait_problem(params.wait, "with task_output, once it has read the message"):
            return error_result(problem)
        said = self.control.send(params.id, params.message)
        if not params.wait:
            return ToolResult(said)
        status, text = await self.control.output(params.id, params.wait)
        return output_result(status, text)

    def describe(self, arguments: dict[str, Any]) -> str:
        return f"{self.name} {arguments.get('id', '?')}: {one_line(str(arguments.get('message', '')), 60)}"


class TaskCancelTool(_BackgroundTool):
    name = "task_cancel"
    description = "Stop a task (a command's processes are killed)."
    Params = CancelParams
    read_only = False

    async def act(self, params: CancelParams) -> ToolResult:
        status = self.control.cancel(params.id)
        return ToolResult(f"{status.id} is being cancelled; task_output shows what it had done")


BACKGROUND_TOOLS: tuple[type[_BackgroundTool], ...] = (TaskStatusTool, TaskOutputTool, TaskSendTool, TaskCancelTool)
# An agent with `bash` and no sub-agents: its output (whose head is the status line) and its stop; every
# tool costs a small model's context, and `task_status` or `task_send` would add nothing for commands.
COMMAND_TOOLS: tuple[type[_BackgroundTool], ...] = (TaskOutputTool, TaskCancelTool)


def make_background_tools(workspace: Workspace, control: TaskControl, *, sub_agents: bool = True) -> dict[str, Tool]:
    """The tools, by name, on one agent's tasks: all four with `subagent` (`sub_agents`); for an agent
    that has only `bash`, `COMMAND_TOOLS`, granted with `bash`."""
    if sub_agents:
        return {cls.name: cls(workspace, control) for cls in BACKGROUND_TOOLS}
    return {cls.name: cls(workspace, control, "bash") for cls in COMMAND_TOOLS}
