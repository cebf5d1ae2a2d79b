"""`skill`: a skill's instructions loaded on demand, and its resource files read inside its folder.

A skill is a folder with a `SKILL.md` (frontmatter `name`, `description`; a body of instructions) and
optional scripts and references, as the Agent Skills format defines it. The system prompt lists only
each skill's name and description (the catalog); the body costs context only when the agent calls
`skill` for it. A resource file is read through `read` confined to the skill's own folder, so no
`..` or link leads out of it, wherever the folder lives (a user skill is outside the workspace).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from ..errors import ToolError
from .base import Tool
from .read import ReadTool
from .workspace import Workspace, walk_files

SKILL_FILE = "SKILL.md"
# Resource files listed per skill: enough for any real skill, bounded for a hostile folder.
MAX_LISTED_RESOURCES = 50


@dataclass(frozen=True)
class Skill:
    """One skill as discovered: its name, description and body (read once, so what was confirmed runs),
    its folder, its layer (`user` or `project`) and the size of its `SKILL.md` in bytes."""

    name: str
    description: str
    body: str
    folder: Path
    source: str
    n_bytes: int

    @property
    def path(self) -> Path:
        return self.folder / SKILL_FILE


def skill_resources(folder: Path) -> list[str]:
    """The files of a skill's folder besides `SKILL.md`, relative, in name order (links never followed)."""
    files = (path.relative_to(folder).as_posix() for path in walk_files(folder, skip_hidden=True))
    return [name for name in files if name != SKILL_FILE]


class SkillTool(Tool):
    name = "skill"
    description = (
        "Load a skill listed in the system prompt: its instructions and the names of its files. "
        "Give file to read one of those files."
    )
    read_only = True
    writes = False

    class Params(BaseModel):
        name: str = Field(description="The skill's name, as the system prompt's skill list gives it.")
        file: str | None = Field(default=None, description="One of the skill's files, to read it instead.")
        offset: int = Field(default=1, ge=1, description="With file: the 1-based line to start from.")

    def __init__(self, workspace: Workspace, skills: tuple[Skill, ...]) -> None:
        super().__init__(workspace)
        self.skills = {skill.name: skill for skill in skills}

    def execute(self, params: Params) -> str:
        skill = self.skills.get(params.name.strip().lower())
        if skill is None:
            names = ", ".join(self.skills) or "none"
            raise ToolError(f"no skill '{params.name}' is available to this agent; use one of: {names}")
        if params.file is not None:
            reader = ReadTool(Workspace(skill.folder))
            return reader.execute(ReadTool.Params(path=params.file, offset=params.offset))
        resources = skill_resources(skill.folder)
        listed = resources[:MAX_LISTED_RESOURCES]
        text = f"# Skill: {skill.name}\n\n{skill.body}"
        if listed:
            more = len(resources) - len(listed)
            tail = f"\n(and {more} more)" if more > 0 else ""
            files = "\n".join(f"- {name}" for name in listed)
            text += f'\n\nFiles of this skill (read one with skill name="{skill.name}" file="<name>"):\n{files}{tail}'
        return text

    def describe(self, arguments: dict[str, Any]) -> str:
        file = arguments.get("file")
        return f"skill {arguments.get('name', '')}" + (f" {file}" if file else "")
