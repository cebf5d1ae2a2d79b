"""Find the GGUF blob of a model pulled with Ollama, through its manifests.

`ollama pull qwen2.5-coder:7b` writes a manifest at
`~/.ollama/models/manifests/registry.ollama.ai/library/qwen2.5-coder/7b` whose layer of media type
`application/vnd.ollama.image.model` names the GGUF blob by digest (`blobs/sha256-<hex>`).
`OLLAMA_MODELS` moves the models folder, as it does for Ollama itself.

A reference and a manifest name paths inside that folder, so both are checked before anything is
opened: each part of a name is a plain name (no `..`, no separators), and a digest is exactly
`sha256:` and 64 hex digits. The manifest and the blob are read through the one guard
(`userfiles`): regular files only.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..errors import ModelImportError
from ..userfiles import open_regular, read_text

PREFIX = "ollama:"
MODEL_LAYER = "application/vnd.ollama.image.model"
DEFAULT_REGISTRY = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
# Ollama's own rules: a name part is letters, digits, `.`, `_`, `-` (a registry may add a port); a tag,
# up to 128 of them. Never `.` or `..` alone: every part becomes a folder name.
NAME_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}(:[0-9]{1,5})?")
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def ollama_models_dir() -> Path:
    """`$OLLAMA_MODELS`, default `~/.ollama/models`."""
    return Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()


def split_reference(reference: str) -> tuple[str, str]:
    """`qwen2.5-coder:7b` -> (`registry.ollama.ai/library/qwen2.5-coder`, `7b`); the tag defaults
    to `latest`, a bare name lives in `library`, and `host/ns/name` keeps its own registry."""
    name, tag = reference, ""
    if ":" in reference.rsplit("/", 1)[-1]:  # the tag follows the last `:` of the model's own part
        name, _, tag = reference.rpartition(":")
    parts = name.split("/")
    own = parts[1:] if len(parts) == 3 else parts  # only a registry host may carry a `:port`
    bad = (
        len(parts) > 3
        or not all(NAME_PART.fullmatch(part) and ".." not in part for part in parts)
        or any(":" in part for part in own)
        or (tag and not TAG.fullmatch(tag))
    )
    if bad:
        raise ModelImportError(
            f"'{PREFIX}{reference[:100]}' is not an Ollama model name ([host/][namespace/]name[:tag], each part letters, "
            "digits, '.', '_' or '-'); use e.g. ollama:qwen2.5-coder:7b"
        )
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
    if not manifest.exists():
        raise ModelImportError(
            f"Ollama has no model {reference} (no manifest at {manifest}); run `ollama pull {reference}` first"
        )
    text = read_text(manifest, "Ollama manifest", ModelImportError)
    try:
        layers = json.loads(text).get("layers") or []
    except (ValueError, AttributeError) as exc:
        raise ModelImportError(f"{manifest}: not a readable Ollama manifest ({str(exc)[:200]})") from None
    if not isinstance(layers, list):
        layers = []
    digests = [
        layer.get("digest") for layer in layers if isinstance(layer, dict) and layer.get("mediaType") == MODEL_LAYER
    ]
    if not digests:
        raise ModelImportError(f"{manifest}: no {MODEL_LAYER} layer; this Ollama model has no GGUF weights to import")
    if not isinstance(digests[0], str) or not DIGEST.fullmatch(digests[0]):
        shown = repr(digests[0])[:100]
        raise ModelImportError(
            f"{manifest}: the model layer's digest {shown} is not sha256: and 64 hex digits; "
            f"run `ollama pull {reference}` again"
        )
    blob = models_dir / "blobs" / digests[0].replace(":", "-")
    if not blob.exists():
        raise ModelImportError(f"{blob} is missing (named by {manifest}); run `ollama pull {reference}` again")
    open_regular(blob, "GGUF file", ModelImportError, None, text=False).close()
    return blob
