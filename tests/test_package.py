"""The package's API (`from mlx_subagents import Runner, ...`): each name imported from its module when first used."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import mlx_subagents
from tests.helpers import REPO, cli_env


def test_importing_the_package_imports_none_of_its_modules() -> None:
    code = "import sys, mlx_subagents; print(sorted(m for m in sys.modules if m.startswith('mlx_subagents')))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout == "['mlx_subagents']\n"


def test_every_name_of_the_api_is_its_modules_object() -> None:
    names = [n for n in mlx_subagents.__all__ if n != "__version__"]
    assert sorted(mlx_subagents._EXPORTS) == names
    for name in names:
        module = importlib.import_module(mlx_subagents._EXPORTS[name], "mlx_subagents")
        assert getattr(mlx_subagents, name) is getattr(module, name)
    assert set(mlx_subagents.__all__) <= set(dir(mlx_subagents))


def test_a_name_the_package_has_not_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError) as info:
        mlx_subagents.Runnr  # type: ignore[attr-defined]  # noqa: B018
    assert str(info.value) == "module 'mlx_subagents' has no attribute 'Runnr'"


@pytest.mark.process
def test_a_scripted_run_never_imports_mlx_lm(tmp_path: Path, write_script: Any) -> None:
    """mlx-lm (and transformers under it) take seconds of a CPU to import: a process whose model is a
    script (or an engine's) has no use for them, and each CLI process the tests start paid them."""
    cmd = [sys.executable, "-X", "importtime", "-m", "mlx_subagents.cli", "run", "scout", "look"]
    done = subprocess.run(
        [*cmd, "--model", write_script(["found it"]), "--cwd", str(tmp_path)],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "found it" in done.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time")}
    assert "mlx_subagents.runs.runner" in imported and "mlx_lm" not in imported and "transformers" not in imported
