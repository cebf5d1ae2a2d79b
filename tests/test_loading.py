"""Model resolution: every failure a user can fix is one line that says what to do."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from mlx_subagents.errors import ModelNotFoundError
from mlx_subagents.host import MlxModelHost, make_host
from mlx_subagents.host.loading import config_context_window, resolve_model_path
from mlx_subagents.host.scripted import ScriptedHost


def test_missing_local_folder(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path(str(missing))
    assert str(info.value) == (
        f"model folder {missing} does not exist; pass an existing folder or a hub id like "
        "mlx-community/Qwen3-4B-Instruct-2507-4bit"
    )


def test_folder_without_weights(tmp_path: Path, tiny_qwen3_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_qwen3_path, folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(
        ModelNotFoundError, match=r"has no \*\.safetensors weights; download or convert the model into it$"
    ):
        resolve_model_path(str(folder))
    (folder / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_model_path(str(folder))


def test_hub_id_not_cached_while_offline() -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path("mlx-community/Qwen3-4B-Instruct-2507-4bit")
    message = str(info.value)
    assert message.startswith(
        "model 'mlx-community/Qwen3-4B-Instruct-2507-4bit' is not in the local Hugging Face cache"
    )
    assert "hf download mlx-community/Qwen3-4B-Instruct-2507-4bit" in message
    assert "\n" not in message


def test_mlx_prefix_and_local_load(tiny_qwen3_path: Path) -> None:
    async def go() -> tuple[str, Path | None]:
        async with MlxModelHost(f"mlx/{tiny_qwen3_path}") as host:
            return host.model_id, host.model_path

    model_id, path = asyncio.run(go())
    assert model_id == str(tiny_qwen3_path) and path == tiny_qwen3_path.resolve()


def test_host_start_failure_is_the_one_line_error(tmp_path: Path) -> None:
    async def go() -> None:
        async with MlxModelHost(str(tmp_path / "missing")):
            pass

    with pytest.raises(ModelNotFoundError, match="does not exist"):
        asyncio.run(go())


def test_context_window_from_nested_text_config() -> None:
    assert config_context_window({"max_position_embeddings": 4096}) == 4096
    assert config_context_window({"text_config": {"max_position_embeddings": 2048}}) == 2048
    assert config_context_window({}) is None


def test_make_host_picks_the_backend(tmp_path: Path) -> None:
    script = tmp_path / "s.json"
    script.write_text('{"replies": [{"content": "hi"}]}')
    assert isinstance(make_host(f"scripted:{script}"), ScriptedHost)
    assert isinstance(make_host("mlx-community/x"), MlxModelHost)
