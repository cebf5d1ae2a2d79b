"""Shared fixtures: an isolated home per test and tiny random models built once per run."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

# huggingface_hub reads these once, at import: set them before anything imports it, so no test
# can reach the network or a developer's real model cache.
_SESSION_HF_HOME = tempfile.mkdtemp(prefix="mlx-subagents-hf-")
atexit.register(shutil.rmtree, _SESSION_HF_HOME, ignore_errors=True)
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=_SESSION_HF_HOME)

from mlx_subagents.testing import make_tiny_model  # noqa: E402


@pytest.fixture(autouse=True)
def isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep every test away from the real ~/.mlx-subagents, user agents and the HF cache."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MLX_SUBAGENTS_HOME", str(home / ".mlx-subagents"))
    monkeypatch.setenv("HF_HOME", str(home / ".cache" / "huggingface"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    return home


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny dense qwen3 folder (trimmable KV cache)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_qwen35_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny hybrid qwen3_5 folder (gated-delta layers: cache not trimmable)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3_5"), "qwen3_5", seed=2)  # seed 2: varied greedy output


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_qwen3_path: Path) -> tuple[Any, Any]:
    """`(model, tokenizer)` from the real `mlx_lm.load`, on the main thread."""
    import mlx_lm

    return mlx_lm.load(str(tiny_qwen3_path))


@pytest.fixture(scope="session")
def tiny_qwen35(tiny_qwen35_path: Path) -> tuple[Any, Any]:
    """`(model, tokenizer)` for the hybrid model, on the main thread."""
    import mlx_lm

    return mlx_lm.load(str(tiny_qwen35_path))


# --- multi-agent runs: scripted models and the CLI in-process ----------------------------------------


@pytest.fixture
def write_script(tmp_path: Path) -> Any:
    """`write_script(data, name="script.json") -> "scripted:PATH"`: a scripted model id for `data`."""
    import json

    def write(data: Any, name: str = "script.json") -> str:
        path = tmp_path / name
        path.write_text(json.dumps(data), encoding="utf-8")
        return f"scripted:{path}"

    return write


@pytest.fixture
def run_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Any:
    """`run_cli(*args) -> (exit_code, stdout, stderr)`: `subagent` in this process, through `main()`."""
    from mlx_subagents import cli

    def invoke(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        monkeypatch.setattr("sys.argv", ["subagent", *args])
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
        captured = capsys.readouterr()
        return int(exit_info.value.code or 0), captured.out, captured.err

    return invoke


@pytest.fixture(scope="session")
def tiny_thinking_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3 folder with the Qwen3.5-style thinking template (opens `<think>` in the generation prompt)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-thinking"), "qwen3", template="thinking")
