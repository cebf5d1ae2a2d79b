"""Gemma 3 GGUFs imported as mlx-lm's `gemma3_text`: the language model, the vision tower left out.

gguf2mlx names the `gemma3` architecture a vision model and converts it only with the model's Hugging
Face files; but Gemma 3's text models (270M, 1B) have no vision tower, and the larger ones' language
model is a `gemma3_text` model to mlx-lm on its own. So the import converts the GGUF as a language
model: gguf2mlx's own converter, reading a file whose vision tensors (`v.*`, `mm.*`: the tower and its
projector, which Ollama's files carry inline) are hidden, then sets what gguf2mlx leaves out for this
family, then quantizes with mlx-lm as every import does:

- `model_type` is `gemma3_text` (gguf2mlx writes `gemma3`, mlx-lm's multimodal wrapper, which needs a
  `text_config`);
- the query and key norms lose the 1 that llama.cpp adds to every Gemma 3 norm weight (`Gemma3RMSNorm`
  multiplies by `1 + weight`; gguf2mlx takes it off the four block norms and the output norm only);
- the global layers' linear RoPE scaling (4B and up: factor 8) and the 27B's attention scale, which llama.cpp
  takes as hidden size / heads there, not the head size.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from .gguf_reader import reused

ARCH = "gemma3"
MODEL_TYPE = "gemma3_text"
# Tensor names of a vision tower and its projector (gguf2mlx's own list, `gguf2mlx.vlm.is_vlm`).
VISION_PREFIXES = (
    "v.",
    "mm.",
    "vision_tower.",
    "vision_model.",
    "visual.",
    "mm_projector.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.visual.",
)
QK_NORMS = (".self_attn.q_norm.weight", ".self_attn.k_norm.weight")
GEMMA3_27B_BLOCKS = 62  # llama.cpp scales the 27B's attention by hidden size / heads (its query_pre_attn_scalar)


def is_vision(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def vision_note(reader: Any) -> str | None:
    """The one line an import says when it leaves a vision tower out (None: the file has none)."""
    n = sum(is_vision(t.name) for t in reader.tensors)
    if not n:
        return None
    return f"the vision tower ({n} tensors) is left out: mlx-lm runs Gemma 3's language model, text in and out"


@contextlib.contextmanager
def text_only(reader: Any, gguf: Path) -> Iterator[None]:
    """gguf2mlx converting a Gemma 3 GGUF as a language model: it reads `gguf` through `reader` (already
    parsed) with the vision tensors hidden, and the architecture is not taken for a vision model (it is
    one only with its tower, which is gone)."""
    from gguf2mlx import vlm

    text = copy.copy(reader)  # the caller's reader keeps its vision tensors
    text.tensors = [t for t in reader.tensors if not is_vision(t.name)]
    with reused(text, gguf), mock.patch.object(vlm, "is_vlm", lambda _reader: False):
        yield


def fix_text_model(folder: Path, reader: Any) -> None:
    """Make gguf2mlx's float output a `gemma3_text` model (the module docstring says what and why)."""
    from gguf2mlx.gguf2mlx import get_metadata_float, get_metadata_int, get_metadata_str

    config_path = folder / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["model_type"] = MODEL_TYPE
    config["architectures"] = ["Gemma3ForCausalLM"]
    scaling = get_metadata_str(reader, f"{ARCH}.rope.scaling.type")
    factor = get_metadata_float(reader, f"{ARCH}.rope.scaling.factor")
    if scaling == "linear" and factor and factor != 1.0:
        config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    if get_metadata_int(reader, f"{ARCH}.block_count") == GEMMA3_27B_BLOCKS:
        config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"]
    config_path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    _shift_qk_norms(folder)


def _shift_qk_norms(folder: Path) -> None:
    import mlx.core as mx

    for shard in sorted(folder.glob("*.safetensors")):
        weights, metadata = mx.load(str(shard), return_metadata=True)
        norms = [k for k in weights if k.endswith(QK_NORMS)]
        if not norms:
            continue
        for key in norms:
            weights[key] = weights[key] - 1
        mx.save_safetensors(str(shard), weights, metadata=metadata or {"format": "mlx"})


def convert_text_model(read: tuple[Path, Any], out: Path, dtype: str, bits: int, group_size: int) -> bool:
    """Convert a Gemma 3 GGUF (`read`: the file and its reader) into `out` as `gemma3_text` (gguf2mlx's
    prints go where the caller sends them); `bits` < 16 quantizes with mlx-lm in groups of `group_size`,
    as gguf2mlx does for the others."""
    from gguf2mlx import convert
    from mlx_lm import convert as mlx_convert

    gguf, reader = read
    floats = out.parent / f"{out.name}.float"
    with text_only(reader, gguf):
        if not convert(str(gguf), str(floats), dtype, quantize=False, weight_audit=False):
            return False
    fix_text_model(floats, reader)
    if bits >= 16:
        floats.rename(out)
        return True
    print("\n[mlx-lm] Quantizing converted output...")
    try:
        mlx_convert(str(floats), mlx_path=str(out), quantize=True, q_bits=bits, q_group_size=group_size)
    finally:
        shutil.rmtree(floats, ignore_errors=True)
    return True
