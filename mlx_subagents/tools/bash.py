"""`bash`: run a shell command in the workspace root, in its own process group (`command.py`),
sandboxed (`sandbox.py`) when the agent's `sandbox` is on.

Every process it started, those that left the group too, is killed on timeout, on cancellation,
when the command returns (leftover background jobs) and when the program stops. The model reads
the head and the tail of the output under a byte cap.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, Field

from ..text import one_line
from .base import Tool, ToolResult, error_result
from .command import OutputBuffer, run_command
from .sandbox import Sandbox, sandboxed
from .workspace import Workspace

DEFAULT_BASH_TIMEOUT = 120
MAX_BASH_TIMEOUT = 600


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

    def __init__(self, workspace: Workspace, sandbox: Sandbox | None = None) -> None:
        super().__init__(workspace)
        self.sandbox = sandbox

    class Params(BaseModel):
        command: str = Field(min_length=1, description="The bash command to run.")
        timeout: int = Field(
            default=DEFAULT_BASH_TIMEOUT,
            ge=1,
            le=MAX_BASH_TIMEOUT,
            description=f"Seconds before the command is killed (at most {MAX_BASH_TIMEOUT}).",
        )

    async def run(self, params: Params) -> ToolResult:
        output = OutputBuffer()
        args = ["bash", "-c", params.command]
        if self.sandbox is not None:  # fails closed (a ToolError) where no sandbox can run
            args = await asyncio.to_thread(sandboxed, args, self.sandbox)
        returncode = await run_command(args, cwd=self.workspace.root, timeout=params.timeout, output=output)
        text = output.text().rstrip("\n")
        if returncode is None:
            killed = f"command timed out after {params.timeout}s; its process group was killed"
            return error_result("\n".join(filter(None, [killed, text])))
        text = text or "(no output)"
        return ToolResult(text if returncode == 0 else f"{text}\n[exit code {returncode}]")

    def describe(self, arguments: dict[str, Any]) -> str:
        return f"$ {one_line(str(arguments.get('command', '')))}"
