"""Resolve a model name to a local folder and load it with mlx-lm.

Every failure a user can fix (missing folder, no weights, not downloaded while
offline, unknown hub id) becomes one `ModelNotFoundError` line saying what to do.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shlex
from pathlib import Path
from typing import Any

from ...errors import ModelLoadError, ModelNotFoundError
from ...home import state_home
from ...shipped import demo_dir

log = logging.getLogger(__name__)

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


# What an agent's first turn costs on mlx's CPU build, measured on a fresh Linux machine (issue 61):
# SmolLM2-135M in 4 bits (about 90 MB of weights) prefilled a scout's 1,407-token first prompt at 6.5
# tokens/s. A 4-bit model's prefill there grows with its weights, so a download's size tells its cost.
CPU_FIRST_TURN_S_PER_MB = 1407 / 6.5 / 90


def cpu_download_note(repo_id: str) -> str | None:
    """The line said before a model is downloaded to a machine where mlx runs on the CPU (Linux without
    a GPU): its size and what one agent turn of it costs there, and the two ways that take seconds (the
    no-model demo, an engine); None where mlx has a GPU. The size is asked of the hub (None if it does
    not answer: the download then says what went wrong)."""
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return None
    size = _download_size(repo_id)
    cost = (
        f" ({size / 1e9:.1f} GB); mlx runs on this machine's CPU, where an agent's first turn of it takes about "
        f"{size / 1e6 * CPU_FIRST_TURN_S_PER_MB / 60:,.0f} minutes"
        if size
        else "; mlx runs on this machine's CPU, where an agent's first turn takes minutes, or hours for a 4B model"
    )
    return f"downloading {repo_id}{cost}. {demo_note()}"


def demo_note() -> str:
    """The two ways that take seconds, said before a long download: the no-model demo as a command to
    paste (its folder as this install has it: the package's in a wheel, examples/demo in a checkout),
    and an engine."""
    demo = demo_dir()
    command = shlex.join(
        ["subagent", "run", "scout", "where is auth handled?", "-C", str(demo)]
        + ["--model", f"scripted:{demo / 'replay.yaml'}"]
    )
    return (
        f"Without a model, a replay shows every command: {command}; for a real model in seconds, an engine: "
        "docs/engines.md (llama.cpp's server, --engine URL)"
    )


def _download_size(repo_id: str) -> int | None:
    """The bytes `_download` would fetch for `repo_id` (the files of `ALLOW_PATTERNS`), or None."""
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(repo_id, files_metadata=True, timeout=10)
    except Exception:  # offline, refused, unknown: the download itself says so in its one line
        return None
    files = info.siblings or []
    wanted = [f.size or 0 for f in files if any(fnmatch.fnmatch(f.rfilename, p) for p in ALLOW_PATTERNS)]
    return sum(wanted) or None


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
    if note := cpu_download_note(repo_id):
        log.warning(note)
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
