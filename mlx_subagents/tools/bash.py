"""`bash`: run a shell command in the workspace root, in its own process group (`command.py`).

Every process it started, those that left the group too, is killed on timeout, on cancellation,
when the command returns (leftover background jobs) and when the program stops. The model reads
the head and the tail of the output under a byte cap.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from ..text import one_line
from .base import Tool, ToolResult, error_result
from .command import OutputBuffer, run_command

DEFAULT_BASH_TIMEOUT = 120
MAX_BASH_TIMEOUT = 600


class BashTool(Tool):
    name = "bash"
    description = (
        "Run a bash command in the workspace root and return its combined stdout and stderr. "
        "No stdin; background processes are killed when the command returns."
    )
    read_only = False

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
        returncode = await run_command(
            ["bash", "-c", params.command], cwd=self.workspace.root, timeout=params.timeout, output=output
        )
        text = output.text().rstrip("\n")
        if returncode is None:
            killed = f"command timed out after {params.timeout}s; its process group was killed"
            return error_result("\n".join(filter(None, [killed, text])))
        text = text or "(no output)"
        return ToolResult(text if returncode == 0 else f"{text}\n[exit code {returncode}]")

    def describe(self, arguments: dict[str, Any]) -> str:
        return f"$ {one_line(str(arguments.get('command', '')))}"
