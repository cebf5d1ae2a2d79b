"""Where the files that ship with the code are: the built-in agents and the no-model demo.

A wheel carries them inside the package (`[tool.hatch.build.targets.wheel.force-include]` in
pyproject.toml); a checkout, an editable install included, has them at the repository's top level.
One function finds either, so a message that names one (the download note's demo) names a path this
install has, not one only a checkout has.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def shipped_dir(in_wheel: str, in_checkout: str) -> Path:
    """The folder `in_wheel` inside the package in a wheel, else `in_checkout` beside the package."""
    bundled = PACKAGE_DIR / in_wheel
    return bundled if bundled.is_dir() else PACKAGE_DIR.parent / in_checkout


def builtin_agents_dir() -> Path:
    """`builtin_agents/`: scout.md, planner.md, reviewer.md, worker.md, orchestrator.md."""
    return shipped_dir("builtin_agents", "builtin_agents")


def demo_dir() -> Path:
    """`examples/demo/`: a small app and the replays (`replay.yaml`, `team.yaml`) that run every command
    without a model (`--model scripted:FILE`)."""
    return shipped_dir("demo", "examples/demo")
