"""A real MCP server for the tests, on the SDK's `MCPServer`: echo, add, a slow tool, one that raises,
and three that ask the client something mid-call: `summarise` (a completion: sampling), `ask_name`
(a form: elicitation) and `roots` (the client's roots). It answers both revisions, as the SDK does: a
2025 client is asked with a request of the server's own, a 2026-07-28 client with an input-required
result (the client calls again with the answer, `ask`). `--legacy` serves only the 2025 handshake (a
server from before 2026-07-28). On stdio by default; `http PORT` serves streamable HTTP on
127.0.0.1:PORT/mcp, with one more tool, `header`, that says a request header back (so tests see what
the client sent).

Each start appends its pid to `$DEMO_PIDS` (when set), so tests can count starts and check that no
process is left; `slow` writes its pid's file `slow-started` next to it and `cancelled` when the call is cancelled.
"""

import asyncio
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.runner import serve_loop
from mcp.server.stdio import stdio_server
from mcp.shared.message import ServerMessageMetadata
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

warnings.simplefilter("ignore")  # sampling, elicitation and roots are deprecated in the 2026-07-28 revision

app = MCPServer("demo")
PIDS = os.environ.get("DEMO_PIDS")


@app.tool()
def echo(text: str) -> str:
    """Say the text back."""
    return f"echo: {text}"


@app.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@app.tool()
async def slow(seconds: float) -> str:
    """Wait, then answer."""
    folder = Path(PIDS).parent if PIDS else None
    if folder:
        (folder / "slow-started").write_text(str(os.getpid()))
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        if folder:
            (folder / "cancelled").write_text("yes")
        raise
    return "done waiting"


@app.tool()
def fail(reason: str) -> str:
    """Always raises."""
    raise ValueError(f"cannot do it: {reason}")


@app.tool()
def crash() -> str:
    """Ends the server process mid-call."""
    os._exit(3)


class Asked(Exception):
    """The client must be asked first (2026-07-28): the tool answers with the input-required result."""

    def __init__(self, key: str, request: Any) -> None:
        self.result = types.InputRequiredResult(input_requests={key: request})


async def ask(ctx: Context, key: str, request: Any, answer_type: Any) -> Any:
    """The client's answer to `request`: on 2026-07-28 from the call's input responses (raises `Asked`
    when it has not answered yet), before it with a request to the client during the call."""
    if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
        answer = (ctx.input_responses or {}).get(key)
        if answer is None:
            raise Asked(key, request)
        return answer_type.model_validate(answer.model_dump(by_alias=True, mode="json"), by_name=False)
    metadata = ServerMessageMetadata(related_request_id=ctx.request_id)
    return await ctx.session.send_request(request, answer_type, metadata=metadata)


@app.tool()
async def summarise(text: str, ctx: Context, max_tokens: int = 40, hint: str = "") -> str | types.InputRequiredResult:
    """Ask the client's model for a one-line summary of the text (sampling)."""
    prefs = types.ModelPreferences(hints=[types.ModelHint(name=hint)]) if hint else None
    params = types.CreateMessageRequestParams(
        messages=[
            types.SamplingMessage(role="user", content=types.TextContent(type="text", text=f"Summarise: {text}"))
        ],
        max_tokens=max_tokens,
        system_prompt="You summarise in one line.",
        model_preferences=prefs,
    )
    try:
        result = await ask(ctx, "summary", types.CreateMessageRequest(params=params), types.CreateMessageResult)
    except Asked as asked:
        return asked.result
    return f"{result.model} said: {result.content.text} ({result.stop_reason})"


NAME_FORM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "title": "Name", "default": "Ada"},
        "age": {"type": "integer", "description": "in years", "minimum": 0, "maximum": 150},
        "colour": {"type": "string", "enum": ["red", "green"], "default": "green"},
    },
    "required": ["name"],
}


@app.tool()
async def ask_name(ctx: Context, question: str = "What is your name?") -> str | types.InputRequiredResult:
    """Ask the person for a name, an age and a colour (elicitation); says what came back."""
    form = types.ElicitRequestFormParams(message=question, requested_schema=NAME_FORM)
    try:
        answer = await ask(ctx, "name", types.ElicitRequest(params=form), types.ElicitResult)
    except Asked as asked:
        return asked.result
    return json.dumps({"action": answer.action, "content": answer.content, "meta": answer.meta})


@app.tool()
async def roots(ctx: Context) -> str | types.InputRequiredResult:
    """The client's roots, as file paths."""
    try:
        listed = await ask(ctx, "roots", types.ListRootsRequest(), types.ListRootsResult)
    except Asked as asked:
        return asked.result
    return json.dumps([str(r.uri) for r in listed.roots])


def header(key: str, ctx: Context) -> str:
    """Say the request's header KEY back."""
    return (ctx.headers or {}).get(key.lower(), "(no such header)")


async def serve_legacy() -> None:
    """Stdio with the 2025 handshake only: a `server/discover` before it is refused, as by older servers."""
    server = app._lowlevel_server
    async with stdio_server() as (read, write), server.lifespan(server) as state:
        await serve_loop(server, read, write, lifespan_state=state, init_options=server.create_initialization_options())


if __name__ == "__main__":
    if PIDS:
        with open(PIDS, "a") as f:
            f.write(f"{os.getpid()}\n")
    print("demo server starting", file=sys.stderr)
    if sys.argv[1:2] == ["http"]:
        app.tool()(header)
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    elif "--legacy" in sys.argv:
        anyio.run(serve_legacy)
    else:
        app.run()
