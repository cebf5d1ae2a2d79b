"""Where agents come from: the layers of agent folders, and the consent a project agent needs.

Layers, a later one winning on a name clash:

    builtin   builtin_agents/*.md (inside the wheel, or at the repo top level in a dev install)
    user      $MLX_SUBAGENTS_HOME/agents/*.md (default ~/.mlx-subagents/agents)
    project   .claude/agents/*.md, then .mlx-subagents/agents/*.md, found walking up from cwd

Project files come with the workspace (a cloned repository), so they are read defensively (only
regular files of a sane size, through `userfiles.read_text`) and run only after the user's consent
(`runs/consent.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..errors import AgentFileError, AgentNotFoundError
from ..home import state_home
from ..shipped import builtin_agents_dir
from ..tools.skill import Skill
from ..userfiles import MAX_FILE_BYTES
from .skills import discover_skills
from .spec import AgentSpec, Source, parse_agent_file

Scope = Literal["user", "project", "both"]
MAX_AGENT_FILE_BYTES = MAX_FILE_BYTES  # a system prompt far longer than any context window
PROJECT_AGENTS_DIR = ".mlx-subagents/agents"
CLAUDE_AGENTS_DIR = ".claude/agents"


@dataclass
class AgentCatalog:
    """The agents found for one working folder; `warnings` has one line per skipped file."""

    agents: dict[str, AgentSpec] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    project_root: Path | None = None
    # The skills found beside the agents (user and project layers), by name in name order.
    skills: dict[str, Skill] = field(default_factory=dict)

    def names(self) -> list[str]:
        return sorted(self.agents)

    def all_warnings(self) -> list[str]:
        """Skipped files first, then what each agent that loaded dropped or read leniently: the one
        order every front end (and the `subagent` tool's description) shows them in."""
        return [*self.warnings, *(w for name in self.names() for w in self.agents[name].warnings)]

    def get(self, name: str) -> AgentSpec:
        """The agent called `name`; `AgentNotFoundError` lists the available ones."""
        try:
            return self.agents[name.strip().lower()]
        except KeyError:
            available = ", ".join(self.names()) or "(none)"
            raise AgentNotFoundError(f"unknown agent '{name}'; available: {available}") from None

    def load_folder(self, folder: Path, source: Source, *, claude: bool = False) -> None:
        """Add every `*.md` agent in `folder` (not recursive), overriding same-named agents."""
        if not folder.is_dir():
            return
        layer: dict[str, AgentSpec] = {}
        for path in sorted(folder.glob("*.md")):
            if path.name.startswith("."):  # editor lock and backup files
                continue
            try:
                spec = parse_agent_file(path, source, claude=claude)
            except AgentFileError as exc:
                self.warnings.append(f"skipped {exc}")
                continue
            if spec.name in layer:
                other = layer[spec.name].path
                clash = f"agent '{spec.name}' is already defined in {other}; rename one of them"
                self.warnings.append(f"skipped {path}: {clash}")
                continue
            layer[spec.name] = spec
        self.agents.update(layer)


def user_agents_dir() -> Path:
    """`$MLX_SUBAGENTS_HOME/agents`, default `~/.mlx-subagents/agents`."""
    return state_home() / "agents"


def find_project_agent_dirs(cwd: Path) -> tuple[Path | None, Path | None, Path | None]:
    """`(project_root, mlx_agents_dir, claude_agents_dir)` for `cwd`, each None if absent.

    The root is the nearest folder at or above `cwd` with `.mlx-subagents/agents`; its
    `.claude/agents` comes with it, else the nearest `.claude/agents` (which is then the root if
    there is no `.mlx-subagents`). User-level folders (`~/.claude/agents`, the user agents dir)
    are never project folders, even when the project lives under the home folder.
    """
    cwd = cwd.expanduser().resolve()
    mlx_root = _nearest(cwd, PROJECT_AGENTS_DIR)
    if mlx_root is not None and (mlx_root / CLAUDE_AGENTS_DIR).is_dir():
        claude_root: Path | None = mlx_root
    else:
        claude_root = _nearest(cwd, CLAUDE_AGENTS_DIR)
    return (
        mlx_root or claude_root,
        mlx_root / PROJECT_AGENTS_DIR if mlx_root else None,
        claude_root / CLAUDE_AGENTS_DIR if claude_root else None,
    )


def _nearest(cwd: Path, relative: str) -> Path | None:
    home = Path.home()
    user_level = {
        user_agents_dir().resolve(),
        (home / CLAUDE_AGENTS_DIR).resolve(),
        (home / PROJECT_AGENTS_DIR).resolve(),
    }
    for folder in (cwd, *cwd.parents):
        candidate = folder / relative
        if candidate.is_dir() and candidate.resolve() not in user_level:
            return folder
    return None


def discover_agents(cwd: Path, scope: Scope = "both") -> AgentCatalog:
    """All agents visible from `cwd`: builtin < user < project, a later layer winning a clash.

    Args:
        scope: "user" = builtin + user, "project" = builtin + project, "both" = all three.
            Built-ins are always included. Never raises for a bad file: it is skipped and
            named in `catalog.warnings`.
    """
    catalog = AgentCatalog()
    builtin = builtin_agents_dir()
    if not builtin.is_dir():
        missing = f"built-in agents folder not found: {builtin}; reinstall mlx-subagents"
        catalog.warnings.append(missing)
    catalog.load_folder(builtin, "builtin")
    if scope in ("user", "both"):
        catalog.load_folder(user_agents_dir(), "user")
    if scope in ("project", "both"):
        root, mlx_dir, claude_dir = find_project_agent_dirs(cwd)
        catalog.project_root = root
        if claude_dir is not None:
            catalog.load_folder(claude_dir, "project", claude=True)
        if mlx_dir is not None:
            catalog.load_folder(mlx_dir, "project")
    catalog.skills, skipped = discover_skills(cwd, scope)
    catalog.warnings.extend(skipped)
    return catalog
