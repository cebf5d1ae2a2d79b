"""Choosing an engine: `engine:`/`engine_model:` in agent files, `--engine` on the command line,
and what a user sees (messages, exit codes, transcripts) when the engine fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_subagents.agents import parse_agent_file
from mlx_subagents.errors import AgentFileError

ENGINE = "http://gpu-box:8000/v1"


def agent_file(tmp_path: Path, extra: str, name: str = "big") -> Path:
    path = tmp_path / f"{name}.md"
    path.write_text(f"---\nname: {name}\ndescription: Runs on the engine.\ntools: read, ls\n{extra}---\n\nYou help.\n")
    return path


def test_an_agent_names_its_engine_and_the_engines_model(tmp_path: Path) -> None:
    spec = parse_agent_file(agent_file(tmp_path, f"engine: {ENGINE}\nengine_model: openai/gpt-oss-20b\n"), "user")
    assert (spec.engine, spec.engine_model, spec.model) == (ENGINE, "openai/gpt-oss-20b", None)
    assert spec.warnings == ()


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        (f"engine: {ENGINE}\n", "fields 'engine' and 'engine_model' must both be given, as text"),
        ("engine_model: qwen3\n", "fields 'engine' and 'engine_model' must both be given, as text"),
        ("engine: gpu-box:8000\nengine_model: qwen3\n", "field 'engine': 'gpu-box:8000' is not an http(s) URL"),
        ("engine: [a]\nengine_model: qwen3\n", "fields 'engine' and 'engine_model' must both be given, as text"),
    ],
)
def test_a_bad_engine_field_is_one_line(tmp_path: Path, extra: str, problem: str) -> None:
    path = agent_file(tmp_path, extra)
    with pytest.raises(AgentFileError) as info:
        parse_agent_file(path, "user")
    fix = "write engine: http://gpu-box:8000/v1 and engine_model: <the engine's model id>"
    assert str(info.value) == f"{path}: {problem}; {fix}"


def test_a_bare_remote_model_name_is_still_refused(tmp_path: Path) -> None:
    path = agent_file(tmp_path, "model: openai/gpt-4o\n")
    with pytest.raises(AgentFileError, match="is a remote 'openai' model; only local MLX models run here"):
        parse_agent_file(path, "user")
