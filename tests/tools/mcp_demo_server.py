"""A real MCP server for the tests, on the SDK's `MCPServer`: echo, add, a slow tool, one that raises,
and three that ask the client something mid-call: `summarise` (a completion: sampling), `ask_name`
(a form: elicitation) and `roots` (the client's roots; also remembered on every roots/list_changed).
On stdio by default; `http PORT` serves streamable HTTP on 127.0.0.1:PORT/mcp, with one more tool,
`header`, that says a request header back (so tests see what the client sent).

Each start appends its pid to `$DEMO_PIDS` (when set), so tests can count starts and check that no
process is left; `slow` writes its pid's file `slow-started` next to it and `cancelled` when the call is cancelled.
"""

import asyncio
import json
import os
import sys
import warnings
from pathlib import Path

import mcp_types as types
from mcp.server import MCPServer
from mcp.server.mcpserver import Context

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


@app.tool()
async def summarise(text: str, ctx: Context, max_tokens: int = 40, hint: str = "") -> str:
    """Ask the client's model for a one-line summary of the text (sampling)."""
    prefs = types.ModelPreferences(hints=[types.ModelHint(name=hint)]) if hint else None
    result = await ctx.session.create_message(
        [types.SamplingMessage(role="user", content=types.TextContent(type="text", text=f"Summarise: {text}"))],
        max_tokens=max_tokens,
        system_prompt="You summarise in one line.",
        model_preferences=prefs,
        related_request_id=ctx.request_id,
    )
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
async def ask_name(ctx: Context, question: str = "What is your name?") -> str:
    """Ask the person for a name, an age and a colour (elicitation); says what came back."""
    answer = await ctx.session.elicit_form(question, NAME_FORM, related_request_id=ctx.request_id)
    return json.dumps({"action": answer.action, "content": answer.content, "meta": answer.meta})


@app.tool()
async def roots(ctx: Context) -> str:
    """The client's roots, as file paths."""
    listed = await ctx.session.list_roots()
    return json.dumps([str(r.uri) for r in listed.roots])


def header(key: str, ctx: Context) -> str:
    """Say the request's header KEY back."""
    return (ctx.headers or {}).get(key.lower(), "(no such header)")


if __name__ == "__main__":
    if PIDS:
        with open(PIDS, "a") as f:
            f.write(f"{os.getpid()}\n")
    print("demo server starting", file=sys.stderr)
    if sys.argv[1:2] == ["http"]:
        app.tool()(header)
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run()
