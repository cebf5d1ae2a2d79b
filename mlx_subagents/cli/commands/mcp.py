"""`subagent mcp`: the agents as an MCP server on stdio, relayed to `subagent serve` when it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ...mcp_server.budget import DEFAULT_CALL_BUDGET, parse_call_budget
from ..attach import serve_mcp
from ..flags import Shared, shared_options

app = typer.Typer()


@app.command()
@shared_options(
    isolation=None,  # each call says its own "isolation"
    cwd=None,  # its own --cwd below: no default, so that the client's root can be the workspace
    yes=Annotated[
        bool,
        typer.Option(
            "--yes",
            "-y",
            help="Allow what comes with the project (a client cannot be asked): its agents (bash sandboxed) and skills, "
            "and its hooks and MCP servers, which run unsandboxed, as you (--yes-agents: the agents and skills only).",
        ),
    ],
)
def mcp(
    workspace: Annotated[
        Optional[Path],
        typer.Option(
            "--cwd",
            "-C",
            help="Workspace (default: the client's first root, else the folder the client starts the server in).",
            exists=True,
            file_okay=False,
        ),
    ] = None,
    start_server: Annotated[
        bool,
        typer.Option(
            "--serve",
            help="Start `subagent serve` in the background when none runs (also: MLX_SUBAGENTS_SERVE=1), then relay to it.",
        ),
    ] = False,
    call_budget: Annotated[
        str,
        typer.Option(
            "--call-budget",
            help="Seconds a run_agents call may take before it answers with what finished and the ids of what still "
            "runs (read with agent_output); 'off' for clients that wait. Clients often give a call 60 s.",
        ),
    ] = f"{DEFAULT_CALL_BUDGET:g}",
    *,
    shared: Shared,
) -> None:
    """Serve the agents over MCP on stdio (for Claude Code, Codex, Cursor, ...); the model stays loaded.
    When `subagent serve` runs, relay to it instead: every client shares its one model.

    Example: claude mcp add subagents -- "$(command -v subagent)" mcp (a client needs the absolute path)
    """
    budget = parse_call_budget(call_budget)
    # stdin is the protocol channel, not a terminal: project agents need --yes, as in any script.
    raise typer.Exit(serve_mcp(shared, workspace, start=start_server, call_budget=budget))
