"""The agents the server runs: `list_agents`'s answer, the project agents it withholds without `--yes`,
and the agents' lines in the tools' descriptions.

A project agent comes with the workspace and can run commands in it, so the server runs it only when
it was started with `--yes`; `list_agents` names the others in its `withheld` field, and a call that
names one is refused (`check_confirmed`).
"""

from __future__ import annotations

import mcp_types as types
from pydantic import BaseModel

from ..agents.spec import AgentSpec
from ..errors import ConfirmationRequired
from ..runs.runner import Runner
from ..runs.workflow import find_workflow, load_workflow
from ..tools.delegation import Delegation

RESTART_WITH_YES = (
    "to allow project agents, add --yes to the server's command in the MCP client configuration and restart it"
)
LIST_AGENTS_DESCRIPTION = (
    "List the sub-agents run_agents can start: name, what each is for, its tools and its model. Project agents "
    "(from the workspace) are listed only when the server was started with --yes; the note says which are withheld."
)


class AgentInfo(BaseModel):
    name: str
    description: str
    tools: list[str]
    model: str
    source: str


class UnconfirmedAgent(BaseModel):
    name: str
    path: str


class AgentList(BaseModel):
    """`list_agents`'s structured content."""

    workspace: str
    agents: list[AgentInfo]
    withheld: list[UnconfirmedAgent]  # the field's name is what clients read
    note: str | None = None


def unconfirmed_agents(runner: Runner) -> list[AgentSpec]:
    """Project agents the server will not run: they need `--yes` at start."""
    if runner.options.assume_yes:
        return []
    return sorted((s for s in runner.catalog.agents.values() if s.source == "project"), key=lambda s: s.name)


def check_confirmed(runner: Runner, call: Delegation) -> None:
    """Refuse a call that names a project agent the server withholds (it was started without `--yes`)."""
    unconfirmed = {s.name for s in unconfirmed_agents(runner)}
    named = [t.agent for t in call.tasks]
    if call.workflow:  # its steps' agents, from the workflow file
        named += [s.agent for s in load_workflow(find_workflow(call.workflow, runner.cwd, named=True)).steps]
    if blocked := sorted({a.strip().lower() for a in named} & unconfirmed):
        raise ConfirmationRequired(
            f"project agent(s) withheld: {', '.join(blocked)}; they come with the workspace and can run "
            f"commands in it; {RESTART_WITH_YES}"
        )


def agent_list(runner: Runner) -> AgentList:
    unconfirmed = unconfirmed_agents(runner)
    names = {s.name for s in unconfirmed}
    agents = [
        AgentInfo(
            name=s.name,
            description=s.description,
            tools=list(s.tools),
            model=str(runner.preparer.model_for(s)),
            source=s.source,
        )
        for s in sorted(runner.catalog.agents.values(), key=lambda s: s.name)
        if s.name not in names
    ]
    note = None
    if unconfirmed:
        note = (
            f"{len(unconfirmed)} project agent(s) withheld: {', '.join(sorted(names))}. They come with the workspace and "
            f"can run commands in it; {RESTART_WITH_YES}"
        )
    return AgentList(
        workspace=str(runner.cwd),
        agents=agents,
        withheld=[UnconfirmedAgent(name=s.name, path=str(s.path)) for s in unconfirmed],
        note=note,
    )


def list_result(listing: AgentList) -> types.CallToolResult:
    lines = [f"Workspace: {listing.workspace}", ""]
    for a in listing.agents:
        lines.append(f"- {a.name} ({a.source}; tools: {', '.join(a.tools)}; model: {a.model}): {a.description}")
    if listing.note:
        lines += ["", listing.note]
    return types.CallToolResult(
        content=[types.TextContent(text="\n".join(lines))], structured_content=listing.model_dump(mode="json")
    )


def agent_lines(runner: Runner) -> str:
    """One line per agent the server runs: name, tools, description."""
    unconfirmed = {s.name for s in unconfirmed_agents(runner)}
    listing = "\n".join(
        f"- {s.name} (tools: {', '.join(s.tools)}): {s.description}"
        for s in sorted(runner.catalog.agents.values(), key=lambda s: s.name)
        if s.name not in unconfirmed
    )
    return listing or "- (none)"
