"""`subagent agents` and `skills`: what the workspace's agents are and may use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..flags import CwdOpt, JsonListOpt, Scope, ScopeOpt
from ..output import out, print_warnings

if TYPE_CHECKING:
    from ...agents.spec import AgentSpec

app = typer.Typer()


@app.command()
def agents(
    cwd: CwdOpt = Path("."),
    scope: ScopeOpt = Scope.both,
    as_json: JsonListOpt = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="Also show whether each agent takes writer turns, its skills and MCP tools, and the project instructions.",
        ),
    ] = False,
) -> None:
    """List the agents: built-in, user and project.

    Example: subagent agents --json
    """
    from ...agents.discovery import discover_agents
    from ..mcp_servers import agent_mcp_line, mcp_entries

    root = Path(cwd).resolve()
    catalog = discover_agents(root, scope=scope.value)  # type: ignore[arg-type]
    print_warnings(catalog)
    entries = mcp_entries(catalog, root)[0] if verbose else []
    rows = [_agent_row(s) for s in sorted(catalog.agents.values(), key=lambda s: s.name)]
    if as_json:
        out.print_json(json.dumps(rows))
        return
    for row in rows:
        out.print(
            f"{row['name']:<12} {row['source']:<8} {', '.join(row['tools'])}\n  {row['description']}\n  [dim]{row['file']}[/]"
        )
        if verbose:
            out.print(f"  {_writer_line(catalog.agents[row['name']])}", markup=False)
            out.print(f"  {_sandbox_line(catalog.agents[row['name']])}", markup=False)
            out.print(f"  {_skills_line(catalog.agents[row['name']], catalog.skills)}", markup=False)
            if (line := agent_mcp_line(catalog.agents[row["name"]], entries)) is not None:
                out.print(f"  {line}", markup=False)
    if verbose:
        _show_project_context(root, [name for name in catalog.names() if catalog.agents[name].context == "none"])


def _agent_row(spec: AgentSpec) -> dict[str, Any]:
    """One agent as `subagent agents --json` lists it (and the plain listing reads it)."""
    from ...agents.spec import sandbox_default

    return {
        "name": spec.name,
        "description": spec.description,
        "tools": list(spec.tools),
        "source": spec.source,
        "file": str(spec.path),
        "writer": spec.is_writer(),
        "sandbox": sandbox_default(spec),
        "permission": spec.permission,
    }


def _skills_line(spec: AgentSpec, found: dict[str, Any]) -> str:
    """Which skills the agent is offered (project ones once allowed), and those its `skills:` names in vain."""
    from ...agents.skills import choose_skills

    choice = choose_skills(spec.skills, found)
    line = f"skills: {', '.join(choice.names()) or 'none'}"
    if choice.preloaded:
        line += f" (preloaded: {', '.join(choice.preloaded)})"
    if choice.missing:
        line += f"; not found: {', '.join(choice.missing)}"
    return line


@app.command()
def skills(cwd: CwdOpt = Path("."), scope: ScopeOpt = Scope.both, as_json: JsonListOpt = False) -> None:
    """List the skills: user and project (project ones are offered to agents only with --yes).

    Example: subagent skills --json
    """
    from ...agents.discovery import discover_agents

    catalog = discover_agents(Path(cwd).resolve(), scope=scope.value)  # type: ignore[arg-type]
    print_warnings(catalog)
    rows = [
        {
            "name": s.name,
            "description": s.description,
            "source": s.source,
            "path": str(s.path),
            "bytes": s.n_bytes,
        }
        for s in catalog.skills.values()
    ]
    if as_json:
        out.print_json(json.dumps(rows))
        return
    if not rows:
        out.print("no skills found (see docs/agents.md#skills for where they go)", markup=False)
    for row in rows:
        out.print(f"{row['name']:<12} {row['source']:<8} {row['bytes']:,} bytes\n  {row['description']}", markup=False)
        out.print(f"  [dim]{row['path']}[/]")


def _writer_line(spec: AgentSpec) -> str:
    """How the agent shares its workspace: the writer rule, and why it applies."""
    from ...tools import WRITER_TOOLS

    if spec.is_writer():
        why = "writer: true" if spec.writer else f"it has {', '.join(t for t in spec.tools if t in WRITER_TOOLS)}"
        return f"writer: takes turns with other writers in its workspace ({why})"
    why = "writer: false" if spec.writer is False else "no edit, write or bash"
    return f"reader: runs alongside the others ({why})"


def _sandbox_line(spec: AgentSpec) -> str:
    """Whether its bash runs sandboxed by default, and why (`--sandbox on|off` decides for a whole run)."""
    from ...agents.spec import sandbox_default

    if not sandbox_default(spec):
        why = "sandbox: off" if spec.sandbox is False else f"a {spec.source} agent"
        line = f"sandbox: off ({why}); its bash has all your rights"
    else:
        why = "a project agent" if spec.source == "project" else "sandbox: on"
        net = "with network (network: allow)" if spec.network else "no network"
        if spec.network and spec.source == "project":
            net = "no network (its network: allow takes --network allow)"
        line = f"sandbox: on ({why}); its bash writes only in the workspace and a private /tmp, {net}"
    return line + ("; plan mode: read-only tools" if spec.permission == "plan" else "")


def _show_project_context(root: Path, opted_out: list[str]) -> None:
    """Which AGENTS.md / CLAUDE.md files load into the agents' system prompts."""
    from ...agents.context import CONTEXT_FILES, MAX_CONTEXT_CHARS, load_project_context

    context = load_project_context(root)
    if not context.files:
        out.print(f"project instructions: none ({' or '.join(CONTEXT_FILES)} up to the repository root)")
    else:
        cut = f", cut at {MAX_CONTEXT_CHARS:,}" if context.n_chars > MAX_CONTEXT_CHARS or context.more else ""
        more = "more than " if context.more else ""
        out.print(f"project instructions ({more}{context.n_chars:,} characters{cut}), in this order:", markup=False)
        for path in context.files:
            out.print(f"  {path}", markup=False)
    for line in context.skipped:
        out.print(f"  left out {line}", markup=False)
    if opted_out:
        out.print(f"  not for: {', '.join(opted_out)} (context: none)", markup=False)
