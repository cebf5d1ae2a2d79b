"""`subagent acp`: the agents for an editor over the Agent Client Protocol on stdio, attached to `subagent
serve` when it runs."""

from __future__ import annotations

from typing import Annotated

import typer

from ..flags import Shared, shared_options

app = typer.Typer()


@app.command("acp")
@shared_options(
    isolation=None,  # a chat's task works in the shared tree
    cwd=None,  # each session's workspace is the folder the editor gives it (session/new's cwd)
    yes=Annotated[
        bool,
        typer.Option(
            "--yes",
            "-y",
            help="Allow the project's agents (bash sandboxed) and skills, and its hooks and MCP servers, which run "
            "unsandboxed, as you, without asking the editor (--yes-agents: the agents and skills only).",
        ),
    ],
)
def acp_command(*, shared: Shared) -> None:
    """Serve the agents to an editor over the Agent Client Protocol on stdio (Zed, JetBrains IDEs, Neovim):
    a session is a chat with the orchestrator (or the agent chosen in the editor) in the editor's folder.

    Example: subagent acp --model mlx-community/Qwen3-4B-Instruct-2507-4bit   (in the editor's agent settings)
    """
    from ..attach import serve_acp

    raise typer.Exit(serve_acp(shared))
