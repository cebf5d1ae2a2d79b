"""Where skills come from, which ones an agent is offered, and the catalog that ends its system prompt.

Layers, a later one winning on a name clash (like agents):

    user      $MLX_SUBAGENTS_HOME/skills/<name>/SKILL.md
    project   .agents/skills/, then .claude/skills/, then .mlx-subagents/skills/, found walking up from cwd

A `SKILL.md` is read as an agent file is (a regular file of a sane size, through `userfiles.read_text`;
a bad one is skipped with one warning). Project skills come with the workspace: they are instructions
and may name scripts, so they are offered only after the user's consent (`--yes`), as project agents are.
No part of a project skill's path below the project folder (`.claude`, `skills`, the skill's folder, its
`SKILL.md`) may be a symbolic link: the skill tool reads files confined to the skill's folder, and a
linked folder would be somewhere else. Such a skill is skipped with one warning.

The catalog is one line per offered skill, in name order, each description cut to a bound, so that every
session of an agent has a byte-identical system prompt and the shared prefix survives. It has a budget
scaled to the context window; past it the least specific skills (user before project, then by name from
the end) are left out with a note.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import AgentFileError
from ..home import state_home
from ..text import squash
from ..tools.skill import SKILL_FILE, Skill
from ..userfiles import MAX_FILE_BYTES, linked_part, read_text
from .frontmatter import agent_error, read_frontmatter

PROJECT_SKILL_DIRS = (".agents/skills", ".claude/skills", ".mlx-subagents/skills")
SKILL_NAME_PATTERN = r"[a-z0-9][a-z0-9_.-]{0,63}"
MAX_SKILL_FILE_BYTES = MAX_FILE_BYTES
MAX_SKILL_DESCRIPTION_CHARS = 200
# The catalog's share of the context window (tokens, estimated at 4 characters each); never under the floor.
CATALOG_SHARE = 0.02
MIN_CATALOG_CHARS = 600
CATALOG_HEAD = "Skills (call the skill tool with a name to load its instructions when a task needs one):"
SPECIFICITY = {"project": 0, "user": 1}
# A project skill behind a link could read files outside the project: what to do instead.
LINK_FIX = "a project skill must be a real folder in the project (copy it in, or make it a user skill)"


def user_skills_dir() -> Path:
    """`$MLX_SUBAGENTS_HOME/skills`, default `~/.mlx-subagents/skills`."""
    return state_home() / "skills"


def project_skill_dirs(cwd: Path) -> list[tuple[Path, Path]]:
    """The project skill folders for `cwd`, least specific first, each with the project folder it lies
    in: for each kind, the nearest at or above `cwd` (a folder in the home that is a user-level one,
    like `~/.claude/skills`, never counts)."""
    cwd = cwd.expanduser().resolve()
    home = Path.home().resolve()
    user_level = {user_skills_dir().resolve(), *((home / rel).resolve() for rel in PROJECT_SKILL_DIRS)}
    found = []
    for relative in PROJECT_SKILL_DIRS:
        for folder in (cwd, *cwd.parents):
            candidate = folder / relative
            if candidate.is_dir() and candidate.resolve() not in user_level:
                found.append((folder, candidate))
                break
    return found


def parse_skill_file(path: Path, source: str) -> Skill:
    """Read one `SKILL.md`; raise `AgentFileError` (one line: file, field, fix) if it is bad."""
    text = read_text(path, "skill file", AgentFileError, MAX_SKILL_FILE_BYTES)
    meta, body, _ = read_frontmatter(path, text, ("name", "description"))
    name = meta.get("name")
    if name is None:
        name = path.parent.name  # the standard names a skill by its folder too
    if not isinstance(name, str) or not re.fullmatch(SKILL_NAME_PATTERN, name.strip().lower()):
        fix = "use lowercase letters, digits, '-', '_' and '.', starting with a letter or digit"
        raise agent_error(path, f"field 'name': {name!r} is not a valid skill name", fix)
    description = meta.get("description")
    if not isinstance(description, str) or not description.strip():
        raise agent_error(path, "field 'description' is missing or empty", "say in a line when the skill helps")
    if not body.strip():
        raise agent_error(path, "the body is empty", "write the skill's instructions below the closing '---'")
    return Skill(name.strip().lower(), squash(description), body.strip(), path.parent, source, len(text.encode()))


def load_skills(
    folder: Path, source: str, skills: dict[str, Skill], warnings: list[str], project: Path | None = None
) -> None:
    """Add every `<name>/SKILL.md` in `folder` to `skills` (a same-named one is replaced).

    Args:
        project: the project folder `folder` lies in: no part of a skill's path below it may be a link.
    """
    if not folder.is_dir():
        return
    if project is not None and (link := linked_part(project, folder.relative_to(project))) is not None:
        warnings.append(f"skipped the skills in {folder}: {link} is a symbolic link; {LINK_FIX}")
        return
    layer: dict[str, Skill] = {}
    for path in sorted(folder.glob(f"*/{SKILL_FILE}")):
        if path.parent.name.startswith("."):  # editor and backup folders
            continue
        if project is not None and (link := linked_part(folder, path.relative_to(folder))) is not None:
            warnings.append(f"skipped {path}: {link} is a symbolic link; {LINK_FIX}")
            continue
        try:
            skill = parse_skill_file(path, source)
        except AgentFileError as exc:
            warnings.append(f"skipped {exc}")
            continue
        if skill.name in layer:
            clash = f"skill '{skill.name}' is already defined in {layer[skill.name].path}; rename one of them"
            warnings.append(f"skipped {path}: {clash}")
            continue
        layer[skill.name] = skill
    skills.update(layer)


def discover_skills(cwd: Path, scope: str = "both") -> tuple[dict[str, Skill], list[str]]:
    """`(skills by name, one warning per skipped file)` visible from `cwd`: user < project."""
    skills: dict[str, Skill] = {}
    warnings: list[str] = []
    if scope in ("user", "both"):
        load_skills(user_skills_dir(), "user", skills, warnings)
    if scope in ("project", "both"):
        for project, folder in project_skill_dirs(cwd):
            load_skills(folder, "project", skills, warnings, project)
    return dict(sorted(skills.items())), warnings


@dataclass(frozen=True)
class SkillChoice:
    """The skills an agent is offered (name order) and those its file preloads; `missing` are names
    its `skills:` lists that are not offered here (not found, not allowed, or its parent lacks them)."""

    offered: tuple[Skill, ...] = ()
    preloaded: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()

    def names(self) -> tuple[str, ...]:
        return tuple(skill.name for skill in self.offered)


def choose_skills(
    listed: tuple[str, ...] | None, available: dict[str, Skill], parent: tuple[str, ...] | None = None
) -> SkillChoice:
    """What an agent whose file says `skills: listed` is offered of `available`: all of them when it says
    nothing, only those listed (and preloaded) otherwise; a child only what its `parent` was offered."""
    usable = {n: s for n, s in available.items() if parent is None or n in parent}
    if listed is None:
        return SkillChoice(tuple(usable[n] for n in sorted(usable)))
    offered = tuple(usable[n] for n in sorted(set(listed)) if n in usable)
    names = {s.name for s in offered}
    return SkillChoice(offered, tuple(n for n in listed if n in names), tuple(n for n in listed if n not in names))


def catalog_budget(context_window: int) -> int:
    """The catalog's size in characters for a context window of `context_window` tokens."""
    return max(MIN_CATALOG_CHARS, int(context_window * CATALOG_SHARE * 4))


def catalog_line(skill: Skill) -> str:
    description = skill.description
    if len(description) > MAX_SKILL_DESCRIPTION_CHARS:
        description = description[: MAX_SKILL_DESCRIPTION_CHARS - 3].rstrip() + "..."
    return f"- {skill.name}: {description}"


def skills_block(skills: tuple[Skill, ...], preloaded: tuple[str, ...], context_window: int) -> str:
    """The end of an agent's system prompt: the preloaded skills in full, then the catalog ("" for none).

    The same skills and window give the same bytes: the order is fixed, nothing depends on time or on
    which session asks."""
    if not skills:
        return ""
    bodies = [f"## Skill: {s.name}\n{s.body}" for name in preloaded for s in skills if s.name == name]
    budget = catalog_budget(context_window)
    lines = {s.name: catalog_line(s) for s in skills}
    kept = sorted(skills, key=lambda s: (SPECIFICITY.get(s.source, 2), s.name))
    while kept and sum(len(lines[s.name]) + 1 for s in kept) > budget:
        kept.pop()
    shown = [lines[s.name] for s in skills if s in kept]
    if len(kept) < len(skills):
        n_out = len(skills) - len(kept)
        shown.append(
            f"[{n_out} more skill(s) left out of this list to fit the context; skill still loads them by name]"
        )
    parts = [*bodies, "\n".join([CATALOG_HEAD, *shown])]
    return "\n\n".join(parts)
