"""What a runner reads from the files around its tasks, once each, so that every session's prompt is
byte-identical: the settings files' hooks (a project's after the user's consent), the skills agents
may be offered (a project's after consent), an agent's memory and the project's instructions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..agents.context import ProjectContext, load_project_context
from ..agents.hooks import (
    SETTINGS_FILE,
    Hooks,
    find_project_settings,
    load_settings_hooks,
    project_hooks,
    read_settings,
)
from ..agents.memory import memory_block, memory_folder, start_memory
from ..agents.spec import AgentSpec
from ..home import state_home
from ..tools import MEMORY_TOOLS, Workspace
from ..tools.skill import Skill
from .consent import Consent
from .options import RunOptions


class ProjectFiles:
    """The hooks, skills, memories and instructions of one runner's tasks, each read at its first use.

    Args:
        on_warning: receives one line per problem that blocks nothing (project hooks not allowed).
    """

    def __init__(self, options: RunOptions, cwd: Path, consent: Consent, on_warning: Callable[[str], None]) -> None:
        self.options = options
        self.cwd = cwd
        self.consent = consent
        self.on_warning = on_warning
        self._contexts: dict[Path, ProjectContext] = {}
        self._hooks: Hooks | None = None
        self._memories: dict[tuple[Path, bool], str] = {}
        self._project_skills: bool | None = None  # the user's answer about project skills, once asked

    def settings_hooks(self, root: Path) -> Hooks:
        """The settings files' hooks, read at the first task and kept for the runner's life: the user's
        (`$MLX_SUBAGENTS_HOME/settings.json`), then the project's (`.mlx-subagents/settings.json`,
        `.claude/settings.json` at or above the runner's folder, unless `--scope user`) once the user
        allows them: they come with the workspace and run commands, as a project agent does. Project
        hooks not allowed are left out with one warning; the run goes on. A project file is parsed as
        JSON to see whether it has hooks, and its hooks are checked only once allowed: each problem in it
        is one warning and the run goes on without that part; the user's own file is strict."""
        if self._hooks is not None:
            return self._hooks
        warnings: list[str] = []
        user = state_home() / SETTINGS_FILE
        hooks = load_settings_hooks(user, warnings)
        if self.options.scope != "user":
            user_level = {user.resolve(), (Path.home() / ".claude" / SETTINGS_FILE).resolve()}
            for path in find_project_settings((self.cwd or root).resolve(), user_level):
                if (found := read_settings(path, warnings)) is None:  # no hooks, or one warning
                    continue
                if not self.consent.hooks(path):
                    warnings.append(
                        f"the hooks in {path} did not run: they come with the project; re-run with --yes to allow them"
                    )
                    continue
                section, text = found
                hooks += project_hooks(section, path, text, warnings)  # checked only after consent
        self._hooks = hooks
        for line in warnings:
            self.on_warning(line)
        return hooks

    def usable_skills(self, skills: dict[str, Skill]) -> dict[str, Skill]:
        """The skills agents may be offered: every user skill, and the project's once the user allowed them
        (`--yes`, or asked once): they come with the workspace, are instructions and may name scripts."""
        project = [s.name for s in skills.values() if s.source == "project"]
        if project and self._project_skills is None:
            where = ", ".join(sorted({str(s.folder.parent) for s in skills.values() if s.source == "project"}))
            self._project_skills = self.consent.skills(", ".join(project), where)
        return {n: s for n, s in skills.items() if s.source != "project" or self._project_skills}

    def memory(self, spec: AgentSpec, workspace: Workspace) -> tuple[Workspace, str]:
        """`(the workspace its tools get, its memory's part of the system prompt)`: with `memory:`, the
        head of its `MEMORY.md` (read once per run, so every session's prompt is byte-identical), and,
        for an agent that can edit files, its memory folder opened to its tools."""
        if spec.memory is None:
            return workspace, ""
        folder = memory_folder(spec.memory, spec.name, workspace.root)
        writable = any(tool in spec.tools for tool in MEMORY_TOOLS)
        key = (folder, writable)
        if key not in self._memories:
            if writable:
                start_memory(folder, spec.name)
            self._memories[key] = memory_block(folder, writable, workspace.root)
        return (replace(workspace, memory=folder) if writable else workspace), self._memories[key]

    def project_context(self, spec: AgentSpec, workspace: Workspace) -> str:
        """The project's instructions for an agent's system prompt, read once per workspace (so every
        session's prompt is byte-identical); "" for an agent with `context: none`."""
        if spec.context == "none":
            return ""
        if workspace.root not in self._contexts:
            self._contexts[workspace.root] = load_project_context(workspace.root)
        return self._contexts[workspace.root].text
