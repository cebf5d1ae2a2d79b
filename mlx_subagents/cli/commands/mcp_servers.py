"""`subagent mcp-servers` (and `login`): the MCP servers agents can use, where each is defined, and OAuth."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..flags import CwdOpt, JsonOpt, Scope, ScopeOpt
from ..output import err, out, print_warnings, warn
from . import listing

app = typer.Typer(name="mcp-servers", help="The MCP servers agents can use; sign in to those that want OAuth.")


@listing(app)
def mcp_servers(cwd: CwdOpt = Path("."), scope: ScopeOpt = Scope.both, as_json: JsonOpt = False) -> None:
    """List the MCP servers agents can use: where each is defined, whether it needs consent, and which
    agents get which of its tools (`subagent doctor` starts each and counts its tools).

    Example: subagent mcp-servers --json
    """
    from ...agents.discovery import discover_agents
    from ..mcp_servers import entry_lines, mcp_entries

    root = Path(cwd).resolve()
    catalog = discover_agents(root, scope=scope.value)  # type: ignore[arg-type]
    print_warnings(catalog)
    entries, missing = mcp_entries(catalog, root)
    for line in missing:
        warn(line)
    if as_json:
        out.print_json(data={"servers": [e.as_json() for e in entries]})
        return
    if not entries:
        out.print(f"no MCP servers: define them in {root / '.mcp.json'}, the home's mcp.json or an agent's mcpServers:")
    for entry in entries:
        out.print("\n".join(entry_lines(entry)), markup=False)


@app.command("login")
def mcp_servers_login(
    name: Annotated[str, typer.Argument(help="The server's name (see `subagent mcp-servers`).")],
    cwd: CwdOpt = Path("."),
    client_id: Annotated[
        Optional[str],
        typer.Option("--client-id", help="A client registered with the server beforehand (else it registers itself)."),
    ] = None,
    client_secret: Annotated[
        Optional[str],
        typer.Option(
            "--client-secret", envvar="MCP_CLIENT_SECRET", help="That client's secret (or $MCP_CLIENT_SECRET)."
        ),
    ] = None,
    callback_port: Annotated[
        Optional[int],
        typer.Option(
            "--callback-port",
            min=1,
            max=65535,
            help="The loopback port the browser comes back to (default: any free one, then the same).",
        ),
    ] = None,
) -> None:
    """Sign in to an MCP server over HTTP that wants OAuth: prints the address to open in a browser, waits
    for it to come back, and keeps the tokens in the state folder (owner-only), refreshed by every run.

    Example: subagent mcp-servers login github
    """
    from ...agents.discovery import discover_agents
    from ...tools.mcp_auth import login
    from ..mcp_servers import mcp_entries, server_to_sign_in

    root = Path(cwd).resolve()
    config = server_to_sign_in(mcp_entries(discover_agents(root), root)[0], name)
    say = lambda line: err.print(line, markup=False, highlight=False, soft_wrap=True)  # noqa: E731
    secret = {"client_id": client_id, "client_secret": client_secret, "callback_port": callback_port}
    done = asyncio.run(login(config.name, config.url, dict(config.headers), say, **secret))
    out.print(done, markup=False, highlight=False, soft_wrap=True)
