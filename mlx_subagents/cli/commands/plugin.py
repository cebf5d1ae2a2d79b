"""`subagent plugin path`: where the plugin for Claude Code, Codex and Agent Plugins clients is."""

from __future__ import annotations

import typer

from ..output import out

app = typer.Typer(
    name="plugin", help="The plugin for Claude Code, Codex and Agent Plugins clients (VS Code, Cursor, Kiro)."
)


@app.command("path")
def plugin_path() -> None:
    """Print the plugin's folder (also its marketplace), and record this environment for the plugin's MCP
    server, so that no client configuration names it.

    Example: claude plugin marketplace add "$(subagent plugin path)"
    """
    from ..plugin import plugin_dir, record_environment

    record_environment()
    out.print(str(plugin_dir()), markup=False, soft_wrap=True)
