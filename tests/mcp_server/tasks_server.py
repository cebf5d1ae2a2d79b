"""An MCP server with the Tasks extension, on the SDK's lowlevel server and `CallTasks` (the part written
here), with the tools the official suite's Tasks scenarios ask for, and for the agents' tests a server
whose long calls answer with a task handle.

- `greet` (never a task), `slow_compute` (a task for a client that declares the extension: sleeps
  `seconds`, then answers; cancelled, it says so in `$TASKS_LOG`), `failing_job` (a task whose tool
  reports an error; a task is required: -32021 without the extension), `protocol_error_job` (a task
  that fails with a JSON-RPC error), `test_tool_with_task` (asks the client's name first, with an
  input-required result, then answers with a task whose result names it), `confirm_delete` and
  `multi_input` (tasks that ask the client during the task, one question or two at once).

On stdio by default; `http PORT` serves streamable HTTP on 127.0.0.1:PORT/mcp.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import mcp_types as types
import uvicorn
from mcp.server import Server, ServerRequestContext
from mcp.shared.exceptions import MCPError

from mlx_subagents.mcp_server.call_tasks import EXTENSION, CallTasks, ask, declares

LOG = os.environ.get("TASKS_LOG")
calls = CallTasks(poll_ms=200)


def note(line: str) -> None:
    if LOG:
        with Path(LOG).open("a") as f:
            f.write(line + "\n")


def text(value: str, *, error: bool = False) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=value)], is_error=error)


def tool(name: str, description: str, properties: dict[str, Any] | None = None) -> types.Tool:
    return types.Tool(
        name=name, description=description, input_schema={"type": "object", "properties": properties or {}}
    )


TOOLS = [
    tool("greet", "Say hello (never a task).", {"name": {"type": "string"}}),
    tool("slow_compute", "Sleep, then answer (a task).", {"seconds": {"type": "number"}, "label": {"type": "string"}}),
    tool("failing_job", "A task whose tool reports an error (a task is required)."),
    tool("protocol_error_job", "A task that fails with a JSON-RPC error."),
    tool("test_tool_with_task", "Ask the client's name, then answer with a task."),
    tool("confirm_delete", "A task that asks the client to confirm, then answers."),
    tool("multi_input", "A task that asks the client two things at once, then answers."),
]
CONFIRM = {"type": "object", "properties": {"confirm": {"type": "boolean"}}, "required": ["confirm"]}


def elicit(message: str) -> dict[str, Any]:
    return {"method": "elicitation/create", "params": {"mode": "form", "message": message, "requestedSchema": CONFIRM}}


async def confirm_delete() -> types.CallToolResult:
    answers = await ask({"confirm": elicit("Delete it?")})
    return text(f"confirmed: {answers['confirm'].get('action')}")


async def multi_input() -> types.CallToolResult:
    answers = await ask({"first": elicit("First?"), "second": elicit("Second?")})
    return text(f"answered: {', '.join(sorted(answers))}")


async def list_tools(ctx: ServerRequestContext[Any], params: Any) -> types.ListToolsResult:
    return types.ListToolsResult(tools=TOOLS)


async def slow(seconds: float, label: str) -> types.CallToolResult:
    note(f"started {label}")
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        note(f"cancelled {label}")
        raise
    return text(f"computed {label} in {seconds:g}s")


async def failing() -> types.CallToolResult:
    await asyncio.sleep(1)
    return text("the job failed: nothing to do", error=True)


async def protocol_error() -> types.CallToolResult:
    await asyncio.sleep(0.2)
    raise MCPError(code=types.INTERNAL_ERROR, message="the job broke")


async def call_tool(ctx: ServerRequestContext[Any], params: types.CallToolRequestParams) -> Any:
    args = params.arguments or {}
    tasks = declares(ctx)
    if params.name == "greet":
        return text(f"Hello, {args.get('name', 'World')}!")
    if params.name == "slow_compute":
        work = slow(float(args.get("seconds", 1)), str(args.get("label", "")))
        return calls.start(work, lambda: f"computing for {args.get('seconds', 1)}s") if tasks else await work
    if params.name == "failing_job":
        if not tasks:
            raise MCPError(
                code=types.MISSING_REQUIRED_CLIENT_CAPABILITY,
                message="Missing required client capability",
                data={"requiredCapabilities": {"extensions": {EXTENSION: {}}}},
            )
        return calls.start(failing(), lambda: "failing")
    if params.name == "protocol_error_job":
        return calls.start(protocol_error(), lambda: "breaking") if tasks else await protocol_error()
    if params.name == "test_tool_with_task":
        return await named_task(params, tasks)
    if params.name in ("confirm_delete", "multi_input") and tasks:
        return calls.start(confirm_delete() if params.name == "confirm_delete" else multi_input(), lambda: "asking")
    raise MCPError(code=types.INVALID_PARAMS, message=f"unknown tool {params.name}")


async def named_task(params: types.CallToolRequestParams, tasks: bool) -> Any:
    answer = (params.input_responses or {}).get("user_name")
    if not isinstance(answer, types.ElicitResult) or answer.action != "accept":
        form = types.ElicitRequestFormParams(
            message="What is your name?",
            requested_schema={"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
        )
        return types.InputRequiredResult(input_requests={"user_name": types.ElicitRequest(params=form)})
    name = (answer.content or {}).get("name", "")

    async def hello() -> types.CallToolResult:
        await asyncio.sleep(0.5)
        return text(f"Hello, {name}!")

    return calls.start(hello(), lambda: "greeting") if tasks else await hello()


server: Server[Any] = Server("tasks-fixture", version="1.0.0", on_list_tools=list_tools, on_call_tool=call_tool)
calls.install(server)

if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        uvicorn.run(server.streamable_http_app(), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
    else:
        import anyio
        from mcp.server.stdio import stdio_server

        async def main() -> None:
            async with stdio_server() as (read, write):
                await server.run(read, write, server.create_initialization_options())

        anyio.run(main)
