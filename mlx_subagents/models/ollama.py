"""Find the GGUF blob of a model pulled with Ollama, through its manifests.

`ollama pull qwen2.5-coder:7b` writes a manifest at
`~/.ollama/models/manifests/registry.ollama.ai/library/qwen2.5-coder/7b` whose layer of media type
`application/vnd.ollama.image.model` names the GGUF blob by digest (`blobs/sha256-<hex>`).
`OLLAMA_MODELS` moves the models folder, as it does for Ollama itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import ModelImportError

PREFIX = "ollama:"
MODEL_LAYER = "application/vnd.ollama.image.model"
DEFAULT_REGISTRY = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"


def ollama_models_dir() -> Path:
    """`$OLLAMA_MODELS`, default `~/.ollama/models`."""
    return Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()


def split_reference(reference: str) -> tuple[str, str]:
    """`qwen2.5-coder:7b` -> (`registry.ollama.ai/library/qwen2.5-coder`, `7b`); the tag defaults
    to `latest`, a bare name lives in `library`, and `host/ns/name` keeps its own registry."""
    name, _, tag = reference.partition(":")
    if not name or "/" in tag:
        raise ModelImportError(f"'{PREFIX}{reference}' is not an Ollama model name; use e.g. ollama:qwen2.5-coder:7b")
    parts = name.split("/")
    if len(parts) == 1:
        parts = [DEFAULT_REGISTRY, DEFAULT_NAMESPACE, *parts]
    elif len(parts) == 2:
        parts = [DEFAULT_REGISTRY, *parts]
    return "/".join(parts), tag or DEFAULT_TAG


def find_blob(reference: str, models_dir: Path | None = None) -> Path:
    """The GGUF file of `reference` (`qwen2.5-coder:7b`, without the `ollama:` prefix)."""
    models_dir = models_dir or ollama_models_dir()
    repo, tag = split_reference(reference)
    manifest = models_dir / "manifests" / repo / tag
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers") or []
    except FileNotFoundError:
        raise ModelImportError(
            f"Ollama has no model {reference} (no manifest at {manifest}); run `ollama pull {reference}` first"
        ) from None
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelImportError(f"{manifest}: not a readable Ollama manifest ({exc})") from None
    digests = [layer.get("digest", "") for layer in layers if layer.get("mediaType") == MODEL_LAYER]
    if not digests:
        raise ModelImportError(f"{manifest}: no {MODEL_LAYER} layer; this Ollama model has no GGUF weights to import")
    blob = models_dir / "blobs" / digests[0].replace(":", "-")
    if not blob.is_file():
        raise ModelImportError(f"{blob} is missing (named by {manifest}); run `ollama pull {reference}` again")
    return blob
