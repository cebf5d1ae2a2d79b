"""Consent: the user's word on what comes with the project, asked in one place, once for each thing.

A cloned repository brings four things that act only with the user's word: its agents (their `bash`
sandboxed in the workspace), its skills (instructions for the agents), and two kinds of commands that
run **unsandboxed**, as the user: the hooks of its settings files (`.mlx-subagents/settings.json`,
`.claude/settings.json`) and the MCP servers of its `.mcp.json` and of its agents' `mcpServers:`.
The word is one of:

- `--yes`: all four, without a question; each hook file and MCP server it starts is still named in
  one warning line (what runs, from which file);
- `--yes-agents`: the agents and skills only; hooks and MCP servers are asked about at a terminal,
  else left out (hooks, one warning) or refused (a task whose agent needs the server);
- a question at a terminal that names what would run and from which file.

A repository never chooses where prompts go or what it may reach: its agents' `engine:`, `network:
allow` and `sandbox: off` are not honoured (`prepare.py`, `model_choice.py`), whatever the consent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfirmationRequired
from ..text import terminal_text

Kind = Literal["agents", "commands"]
AGENT_FLAGS = "--yes-agents (or --yes)"
COMMAND_FLAG = "--yes"


@dataclass
class Consent:
    """What the user allowed of the project's agents, skills, hooks and MCP servers (module docstring).

    Args:
        everything: `--yes`.
        agents: `--yes-agents` (or `--yes`): the project's agents and skills.
        interactive, confirm: whether a person can be asked, and how (`typer.confirm`, or a client's).
        on_warning: receives the line naming what `--yes` starts unsandboxed.
    """

    everything: bool = False
    agents: bool = False
    interactive: bool = False
    confirm: Callable[[str], bool] | None = None
    on_warning: Callable[[str], None] = lambda _line: None
    _answers: dict[str, bool] = field(default_factory=dict)

    def ask(self, key: str, question: str, kind: Kind, *, allowed_line: str = "") -> bool | None:
        """The user's word on `key`: True (a flag, or the person said yes), False (declined), None (no
        flag and nobody to ask). Asked at most once; `allowed_line` is the warning `--yes` gives for a
        command it starts unasked."""
        if key in self._answers:
            return self._answers[key]
        if self.everything or (kind == "agents" and self.agents):
            if kind == "commands" and allowed_line:
                self.on_warning(allowed_line)
            answer = True
        elif not self.interactive or self.confirm is None:
            return None
        else:  # the question names what a repository wrote: shown, never obeyed (an ESC could erase it)
            answer = bool(self.confirm(terminal_text(question)))
        self._answers[key] = answer
        return answer

    def agent(self, name: str, path: object) -> None:
        """A project agent may run, or `ConfirmationRequired` (one line) says why not and how to allow it."""
        origin = f"agent '{name}' comes from the project file {path}; its bash runs sandboxed in this workspace."
        answer = self.ask(f"agent {name}", f"{origin} Allow it?", "agents")
        if answer is None:
            raise ConfirmationRequired(f"{origin} Re-run with {AGENT_FLAGS} to allow it.")
        if not answer:
            raise ConfirmationRequired(f"agent '{name}' was not allowed to run (declined). Re-run with {AGENT_FLAGS}.")

    def hooks(self, path: object) -> bool:
        """Whether the hooks of the project's settings file `path` may run (they run unsandboxed)."""
        what = (
            f"the project file {path} has hooks: commands that run unsandboxed, as you, around the agents' tool calls"
        )
        return bool(self.ask(f"hooks {path}", f"{what}. Allow them?", "commands", allowed_line=f"--yes: {what}"))

    def skills(self, names: str, where: str) -> bool:
        """Whether the project's skills may be offered to the agents (instructions, which may name scripts)."""
        question = f"project skills {names} come from {where}; they are instructions for the agents. Offer them?"
        return bool(self.ask(f"skills {where}", question, "agents"))

    def mcp_servers(self, key: str, origin: str) -> bool | None:
        """The user's word on the project's MCP servers `origin` names (they run unsandboxed); None: nobody
        to ask."""
        what = f"{origin}; they run unsandboxed, as you"
        return self.ask(key, f"{what}. Allow it?", "commands", allowed_line=f"--yes: {what}")
