"""The models this machine can run: imported GGUF models and MLX models in the Hugging Face cache.

Everything here is read from disk (config.json, safetensors headers), never by loading weights,
so listing a dozen multi-GB models takes a moment. The memory check mirrors the host's defaults:
a model fits when its weights leave room for a KV budget that holds `DEFAULT_MAX_SESSIONS`
sessions at the host's default context window.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from ..errors import ModelLoadError
from ..host.kv.budget import DEFAULT_MAX_SESSIONS, default_kv_budget, total_memory
from ..host.kv.kv_pool import KV_STEP
from ..host.mlx.loading import config_context_window, imported_models_dir, read_config
from ..host.protocol import DEFAULT_CONTEXT_WINDOW
from ..text import first_line

QUANT_PARTS = (".scales", ".biases")  # mlx's quantization parameters, not model parameters


class ModelInfo(BaseModel):
    """One runnable model, as `subagent models --json` prints it."""

    name: str  # what to pass to --model
    source: Literal["imported", "hf-cache"]
    path: str
    model_type: str
    size_bytes: int
    parameters: int | None
    quantization: str  # "4-bit (group 64)", "float16", ...
    context_window: int | None
    tool_mode: str | None  # "native", "prompted", "no chat template" (refused at load); None if unreadable
    kv_bytes_per_token: int | None
    fits_memory: bool | None  # weights + KV for DEFAULT_MAX_SESSIONS sessions; None if unknown
    default: bool = False


def folder_size(path: Path) -> int:
    """Bytes on disk of the files a folder holds (hub snapshots link to blobs: follow them)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def count_parameters(path: Path, bits: int | None) -> int | None:
    """Parameters from the safetensors headers; packed quantized weights count `32 / bits` each."""
    from safetensors import safe_open

    total = 0
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="numpy") as f:
                for key in f.keys():
                    if key.endswith(QUANT_PARTS):
                        continue
                    part = f.get_slice(key)
                    n = 1
                    for d in part.get_shape():
                        n *= d
                    packed = bits and part.get_dtype() == "U32"
                    total += n * 32 // bits if packed else n
        except (OSError, ValueError):  # a broken or partial download: report no count
            return None
    return total


def quantization(config: dict[str, Any]) -> tuple[str, int | None]:
    """("4-bit (group 64)", 4) for an mlx-quantized config, else its float dtype and None."""
    q = config.get("quantization") or config.get("quantization_config") or {}
    if isinstance(q.get("bits"), int):
        return f"{q['bits']}-bit (group {q.get('group_size', '?')})", q["bits"]
    text = config.get("text_config") or {}
    return str(config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or "?"), None


def kv_bytes_per_token(config: dict[str, Any]) -> int | None:
    """Keys and values of the attention layers for one token (recurrent layers hold a fixed state)."""
    text = config.get("text_config") or config
    layers, heads = text.get("num_hidden_layers"), text.get("num_attention_heads")
    if not isinstance(layers, int) or not isinstance(heads, int) or not heads:
        return None
    if isinstance(text.get("layer_types"), list):
        layers = sum(1 for t in text["layer_types"] if t == "full_attention")
    elif isinstance(text.get("full_attention_interval"), int):
        layers //= text["full_attention_interval"]
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or (text.get("hidden_size") or 0) // heads
    dtype = str(config.get("torch_dtype") or text.get("torch_dtype") or "")
    width = 4 if dtype == "float32" and "quantization" not in config else 2
    return 2 * layers * kv_heads * head_dim * width


def fits_memory(weights: int, per_token: int | None, window: int | None, ram: int) -> bool | None:
    """Whether the host's default KV budget on this machine holds every default session at full window."""
    if per_token is None or not ram:
        return None
    window = min(window or DEFAULT_CONTEXT_WINDOW, DEFAULT_CONTEXT_WINDOW)
    steps = -(-window // KV_STEP) + 1  # buffers grow in steps, with one of slack (as the pool counts)
    needed = DEFAULT_MAX_SESSIONS * per_token * steps * KV_STEP
    return weights < ram and needed <= default_kv_budget(ram, weights)


def tool_mode(path: Path) -> str | None:
    """How the host would give this model its tools, decided from its tokenizer as at load."""
    from mlx_lm.utils import load_tokenizer

    from ..errors import ChatTemplateError
    from ..host.calls.chat_format import ChatFormat

    try:
        return ChatFormat.load(load_tokenizer(path), str(path)).tool_mode
    except ChatTemplateError:
        return "no chat template"
    except Exception:  # a tokenizer transformers cannot read: the listing goes on
        return None


def runnable(model_type: str) -> bool:
    """mlx-lm has a model class for this `model_type`."""
    from mlx_lm.utils import MODEL_REMAPPING

    return importlib.util.find_spec(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}") is not None


def describe(name: str, source: Literal["imported", "hf-cache"], path: Path, ram: int) -> ModelInfo | None:
    """A model folder's row, or None when it is not a complete model mlx-lm can run; a damaged one (weights
    or a config its readers cannot parse) raises one `ModelLoadError` line naming it."""
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        return None
    try:
        return _describe(name, source, path, ram)
    except Exception as exc:  # each reader fails its own way (safetensors' header, a config of another shape)
        problem = first_line(str(exc)) or type(exc).__name__
        raise ModelLoadError(
            f"{path}: not a model mlx-lm can read ({problem}); import it again or remove the folder"
        ) from None


def _describe(name: str, source: Literal["imported", "hf-cache"], path: Path, ram: int) -> ModelInfo | None:
    config = read_config(path)
    model_type = str(config.get("model_type") or "")
    if not model_type or not runnable(model_type):
        return None
    quant, bits = quantization(config)
    size = folder_size(path)
    per_token = kv_bytes_per_token(config)
    window = config_context_window(config)
    return ModelInfo(
        name=name,
        source=source,
        path=str(path),
        model_type=model_type,
        size_bytes=size,
        parameters=count_parameters(path, bits),
        quantization=quant,
        context_window=window,
        tool_mode=tool_mode(path),
        kv_bytes_per_token=per_token,
        fits_memory=fits_memory(size, per_token, window, ram),
    )


def _hub_snapshots() -> Iterator[tuple[str, Path]]:
    """(repo id, newest snapshot) of every model repo in the Hugging Face cache."""
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir(constants.HF_HUB_CACHE)
    except CacheNotFound:
        return
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type == "model" and repo.revisions:
            newest = max(repo.revisions, key=lambda r: r.last_modified)
            yield repo.repo_id, Path(newest.snapshot_path)


def list_models(default: str | None = None, warn: Callable[[str], None] | None = None) -> list[ModelInfo]:
    """Imported models first, then the hub cache's; `default` (a name or id) is marked. A damaged folder
    is left out, its one line given to `warn`: one such folder failed the whole catalog."""
    ram = total_memory()
    found: list[ModelInfo] = []
    home = imported_models_dir()
    folders: list[tuple[str, Literal["imported", "hf-cache"], Path]] = []
    if home.is_dir():
        folders += [
            (p.name, "imported", p) for p in sorted(home.iterdir()) if p.is_dir() and not p.name.startswith(".")
        ]
    folders += [(repo_id, "hf-cache", snapshot) for repo_id, snapshot in _hub_snapshots()]
    for name, source, folder in folders:
        try:
            info = describe(name, source, folder, ram)
        except ModelLoadError as exc:
            if warn is not None:
                warn(str(exc))
            continue
        if info is not None:
            found.append(info)
    if default is not None:
        name = default.removeprefix("mlx/")
        found = [m.model_copy(update={"default": m.name == name or m.path == name}) for m in found]
    return found
