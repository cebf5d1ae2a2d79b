"""Resolve a model name to a local folder and load it with mlx-lm.

Every failure a user can fix (missing folder, no weights, not downloaded while
offline, unknown hub id) becomes one `ModelNotFoundError` line saying what to do.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ...errors import ModelLoadError, ModelNotFoundError
from ...home import state_home

# Files mlx-lm needs from a hub snapshot (the same set its own loader fetches).
ALLOW_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]


def strip_provider(model: str) -> str:
    """`mlx/<id>` names the local mlx provider explicitly; the id is what follows."""
    return model[len("mlx/") :] if model.startswith("mlx/") else model


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or model.count("/") != 1 or os.sep in model.replace("/", "", 1)


def _check_folder(path: Path) -> Path:
    if not path.is_dir():
        raise ModelNotFoundError(f"model path {path} is not a folder; pass a folder with config.json and *.safetensors")
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"model folder {path} has no config.json; pass an mlx-lm model folder (see `mlx_lm.convert`)"
        )
    if not any(path.glob("*.safetensors")):
        raise ModelNotFoundError(
            f"model folder {path} has no *.safetensors weights; download or convert the model into it"
        )
    return path


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}


def _download(repo_id: str, local_only: bool = False) -> Path:
    """A hub id: the local cache first, then (when online and not `local_only`) a download with progress bars."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        pass
    how = f"download it once while online (`hf download {repo_id}`) or pass a local folder"
    if local_only:
        raise ModelNotFoundError(
            f"model '{repo_id}' is not in the local Hugging Face cache, and a model chosen during a delegation is "
            f"never downloaded; name a local model, or {how}"
        )
    if _hub_offline():
        raise ModelNotFoundError(
            f"model '{repo_id}' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; {how}"
        )
    try:
        return Path(snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS))
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"model '{repo_id}' does not exist on the Hugging Face hub (or is private); check the id"
        ) from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFoundError(
            f"model '{repo_id}' is not in the local cache and could not be downloaded ({first[:120]}); {how}"
        ) from None


def imported_models_dir() -> Path:
    """`$MLX_SUBAGENTS_HOME/models`: where `subagent models import` puts converted GGUF models."""
    return state_home() / "models"


def _exists(path: Path) -> bool:
    """`path.exists()`, False for a name the OS cannot look up (`File name too long`)."""
    try:
        return path.exists()
    except OSError:
        return False


def resolve_model_path(model: str, *, local_only: bool = False) -> Path:
    """A local folder as is, an imported model by its bare name, or a hub id through the Hugging
    Face cache (never downloaded when `local_only`)."""
    name = strip_provider(model)
    path = Path(name).expanduser()
    if _exists(path):
        return _check_folder(path.resolve())
    if "/" not in name and not name.startswith((".", "~")):
        imported = imported_models_dir() / name
        if _exists(imported) and imported.is_dir():
            return _check_folder(imported)
        raise ModelNotFoundError(
            f"model '{name}' is neither a folder nor an imported model; see `subagent models`, "
            "import a GGUF with `subagent models import FILE.gguf`, or pass a hub id like mlx-community/Qwen3-4B-Instruct-2507-4bit"
        )
    if _looks_like_path(name):
        raise ModelNotFoundError(
            f"model folder {path} does not exist; pass an existing folder or a hub id like mlx-community/Qwen3-4B-Instruct-2507-4bit"
        )
    return _check_folder(_download(name, local_only))


def read_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def config_context_window(config: dict[str, Any]) -> int | None:
    """The trained context length, from the top level or a nested text config."""
    for cfg in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
            value = cfg.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


def load_model(path: Path) -> tuple[Any, Any]:
    """Load through the real `mlx_lm.load`; run on the mlx thread."""
    from mlx_lm import load

    try:
        model, tokenizer = load(str(path))
    except FileNotFoundError as exc:
        raise ModelNotFoundError(f"model folder {path} is incomplete ({exc}); re-download or re-convert it") from None
    except (ValueError, KeyError, ImportError) as exc:
        raise ModelLoadError(f"mlx-lm cannot load the model in {path}: {exc}") from None
    return model, tokenizer
