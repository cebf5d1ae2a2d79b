"""The files that ship with the code are in the wheel where `shipped` looks for them: a user who
installed the wheel has no checkout, so the demo the download note names must come with the package."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

from mlx_subagents.shipped import builtin_agents_dir, demo_dir

REPO = Path(__file__).resolve().parents[1]


def tracked(folder: str) -> set[str]:
    """The files git keeps under `folder`, relative to it."""
    listed = subprocess.run(["git", "ls-files", folder], cwd=REPO, capture_output=True, text=True, check=True)
    return {str(Path(line).relative_to(folder)) for line in listed.stdout.splitlines()}


def test_the_wheel_carries_the_demo_and_the_builtin_agents_where_shipped_finds_them(tmp_path: Path) -> None:
    """The first-run note named examples/demo/replay.yaml, a path only a checkout has: a wheel now
    carries the demo as mlx_subagents/demo/, which `demo_dir` finds first."""
    from hatchling.builders.wheel import WheelBuilder

    (wheel,) = WheelBuilder(str(REPO)).build(directory=str(tmp_path), versions=["standard"])
    names = set(zipfile.ZipFile(wheel).namelist())
    demo = tracked("examples/demo")
    assert {"replay.yaml", "team.yaml", "app/auth.py"} <= demo
    assert {f"mlx_subagents/demo/{name}" for name in demo} <= names
    assert not {name for name in names if "__pycache__" in name or name.endswith(".pyc")}
    agents = tracked("builtin_agents")
    assert "scout.md" in agents
    assert {f"mlx_subagents/builtin_agents/{name}" for name in agents} <= names
    # In this checkout (an editable install) both are found beside the package.
    assert demo_dir() == REPO / "examples" / "demo"
    assert builtin_agents_dir() == REPO / "builtin_agents"
