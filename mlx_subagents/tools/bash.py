"""`bash`: run a shell command in the workspace root, in its own process group (`command.py`),
sandboxed (`sandbox.py`) when the agent's `sandbox` is on.

Every process it started, those that left the group too, is killed on timeout, on cancellation,
when the command returns (leftover background jobs) and when the program stops. The model reads
the head and the tail of the output under a byte cap. With `"background": true` the command runs on
as a task of the agent's (`background_bash.py`): the call returns its id (`bash#1`) at once, and the
same kills happen at its end, its timeout, a cancel or the agent's end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from pydantic import AliasChoices, BaseModel, Field

from ..errors import SubagentError
from ..text import one_line
from .base import MAX_OUTPUT_BYTES, Tool, ToolResult, error_result
from .command import OutputBuffer, run_command
from .editor import REJECTED, Approval
from .sandbox import Sandbox, sandboxed
from .workspace import Workspace

DEFAULT_BASH_TIMEOUT = 120
MAX_BASH_TIMEOUT = 600


class CommandStarter(Protocol):
    """Where background commands are started and held (the agent's task board, from the runner)."""

    async def start_command(self, args: Sequence[str], *, command: str, cwd: Path, timeout: float) -> str: ...


class BashTool(Tool):
    name = "bash"
    description = (
        "Run a bash command in the workspace root and return its combined stdout and stderr. "
        "No stdin; background processes are killed when the command returns."
    )
    read_only = False
    writes = True
    by_default = True
    claude_names = ("Bash",)
    uses_editor = True

    def __init__(
        self, workspace: Workspace, sandbox: Sandbox | None = None, tasks: CommandStarter | None = None
    ) -> None:
        super().__init__(workspace)
        self.sandbox = sandbox
        self.tasks = tasks

    class Params(BaseModel):
        command: str = Field(min_length=1, description="The bash command to run.")
        timeout: int = Field(
            default=DEFAULT_BASH_TIMEOUT,
            ge=1,
            le=MAX_BASH_TIMEOUT,
            description=f"Seconds before the command is killed (at most {MAX_BASH_TIMEOUT}).",
        )
        # Claude Code's Bash spells it `run_in_background`: a model trained there is understood, not ignored.
        background: bool = Field(
            default=False,
            validation_alias=AliasChoices("background", "run_in_background"),
            description="Return at once with its id; it runs on.",
        )

    async def run(self, params: Params) -> ToolResult:
        """The command, in its sandbox when it has one; with an editor, after the person's approval, and
        in its terminal where it offers one (a background command stays here, on the agent's board)."""
        if self.editor is not None and not await self.editor.approve(
            Approval(self.name, self.describe(params.model_dump()), command=params.command)
        ):
            return error_result(REJECTED)
        args = ["bash", "-c", params.command]
        if self.sandbox is not None:  # fails closed (a ToolError) where no sandbox can run
            args = await asyncio.to_thread(sandboxed, args, self.sandbox)
        if params.background:
            return await self._start(args, params)
        if self.editor is not None and self.editor.runs_commands:
            ran = await self.editor.run_command(args, self.workspace.root, params.timeout, MAX_OUTPUT_BYTES)
            return command_result(ran.output, ran.exit_code, params.timeout)
        output = OutputBuffer()
        returncode = await run_command(args, cwd=self.workspace.root, timeout=params.timeout, output=output)
        return command_result(output.text(), returncode, params.timeout)

    async def _start(self, args: list[str], params: Params) -> ToolResult:
        """A background command: its id at once, and how to read and stop it."""
        if self.tasks is None:
            return error_result('background commands are not available here; run it without "background"')
        try:
            task_id = await self.tasks.start_command(
                args, command=params.command, cwd=self.workspace.root, timeout=params.timeout
            )
        except SubagentError as exc:  # the board's cap: one line
            return error_result(f"bash call refused: {exc}")
        return ToolResult(
            f"Started in the background: {task_id} (killed after {params.timeout}s, or when your task ends). "
            "Carry on; a notice comes when it ends. task_output reads its output (wait to block until it ends), "
            "task_cancel stops it."
        )

    def describe(self, arguments: dict[str, Any]) -> str:
        background = arguments.get("background", arguments.get("run_in_background")) is True
        prefix = "$ (background) " if background else "$ "
        return f"{prefix}{one_line(str(arguments.get('command', '')))}"


def command_result(output: str, returncode: int | None, timeout: int) -> ToolResult:
    """What the model reads of a command: its output, its exit code when not 0, or that it timed out."""
    text = output.rstrip("\n")
    if returncode is None:
        killed = f"command timed out after {timeout}s; its process group was killed"
        return error_result("\n".join(filter(None, [killed, text])))
    text = text or "(no output)"
    return ToolResult(text if returncode == 0 else f"{text}\n[exit code {returncode}]")
