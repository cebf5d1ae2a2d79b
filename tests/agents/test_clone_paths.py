"""Paths a cloned repository controls are never followed out of it: a project's memory folder and a
project skill's folder are refused in one line when a part of them is a symbolic link."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from mlx_subagents.agents.skills import LINK_FIX, discover_skills
from mlx_subagents.errors import RequestError
from mlx_subagents.runs.tasks import TaskSpec
from tests.agents.test_skills import write_skill
from tests.helpers import go, make_runner, scripted_host, write_agent


@pytest.mark.parametrize("linked", [".mlx-subagents", "agent-memory", "keeper", "MEMORY.md"])
def test_a_linked_memory_folder_is_refused_in_one_line(tmp_path: Path, linked: str) -> None:
    parts = [".mlx-subagents", "agent-memory", "keeper", "MEMORY.md"]
    outside = tmp_path / "outside"
    write_agent(outside, "keeper", "read, edit", front="memory: project\n")
    memory = outside.joinpath(*parts)
    memory.parent.mkdir(parents=True)
    memory.write_text("# someone's notes\n")
    clone = tmp_path / "clone"
    shutil.copytree(outside, clone)
    link = clone.joinpath(*parts[: parts.index(linked) + 1])  # one part of the clone's copy made a link out
    shutil.rmtree(link) if link.is_dir() else link.unlink()
    link.symlink_to(outside.joinpath(*parts[: parts.index(linked) + 1]))
    host = scripted_host({"agents": {"keeper": {"replies": ["never"]}}})

    with pytest.raises(RequestError) as refused:
        go(make_runner(clone, host, assume_yes=True), "run", TaskSpec("keeper", "remember"))

    assert str(refused.value) == (
        f"{link}: the memory of agent 'keeper' (memory: project) goes through this symbolic link, which could lead "
        f"outside {clone}; make it a real folder (or file), or give the agent another memory scope"
    )
    assert host.history == {}
    assert os.listdir(memory.parent) == ["MEMORY.md"] and memory.read_text() == "# someone's notes\n"


def test_a_linked_project_skill_is_skipped_with_one_warning(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    write_skill(outside, "pdf", "Reads PDF forms")
    (outside / "pdf" / "secret.txt").write_text("not the project's\n")
    clone = tmp_path / "clone"
    skills_dir = clone / ".claude" / "skills"
    write_skill(skills_dir, "good", "A real skill")
    (skills_dir / "pdf").symlink_to(outside / "pdf")  # the skill's folder
    (skills_dir / "notes").mkdir()
    (skills_dir / "notes" / "SKILL.md").symlink_to(outside / "pdf" / "SKILL.md")  # its SKILL.md
    (clone / ".agents").mkdir()
    (clone / ".agents" / "skills").symlink_to(outside)  # the whole skills folder

    skills, warnings = discover_skills(clone, "project")

    assert list(skills) == ["good"]
    assert warnings == [
        f"skipped the skills in {clone / '.agents' / 'skills'}: {clone / '.agents' / 'skills'} is a symbolic link; "
        f"{LINK_FIX}",
        f"skipped {skills_dir / 'notes' / 'SKILL.md'}: {skills_dir / 'notes' / 'SKILL.md'} is a symbolic link; {LINK_FIX}",
        f"skipped {skills_dir / 'pdf' / 'SKILL.md'}: {skills_dir / 'pdf'} is a symbolic link; {LINK_FIX}",
    ]
