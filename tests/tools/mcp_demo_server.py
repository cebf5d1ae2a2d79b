"""A real MCP server for the tests, on the SDK's `MCPServer`: echo, add, a slow tool, one that raises.
On stdio by default; `http PORT` serves streamable HTTP on 127.0.0.1:PORT/mcp, with one more tool,
`header`, that says a request header back (so tests see what the client sent).

Each start appends its pid to `$DEMO_PIDS` (when set), so tests can count starts and check that no
process is left; `slow` writes its pid's file `slow-started` next to it and `cancelled` when the call is cancelled.
"""

import asyncio
import os
import sys
from pathlib import Path

from mcp.server import MCPServer
from mcp.server.mcpserver import Context

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
