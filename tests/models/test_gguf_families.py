"""GGUF files people have: the Ollama families in the usual quantizations import and answer through
`mlx_lm.load`, or are refused in one line naming the architecture or tensor type and what would work."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from mlx_subagents.errors import ModelImportError
from mlx_subagents.models.importer import import_gguf
from tests.models.gguf_files import MIXES, QUANTIZATIONS, write

# general.architecture as Ollama's files carry it: Llama 3.x and Mistral are "llama", Qwen 2.5 "qwen2".
FAMILIES = ("llama", "qwen2", "qwen3", "phi3")


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("arch", FAMILIES)
def test_each_family_imports_in_each_quantization_and_answers(tmp_path: Path, arch: str, quantization: str) -> None:
    import json

    import mlx.core as mx
    from mlx_lm import generate, load

    gguf = write(tmp_path / f"{arch}.{quantization}.gguf", arch, MIXES[quantization])
    imported = import_gguf(str(gguf), name=f"{arch}-{quantization}")
    config = json.loads((imported.path / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    model, tokenizer = load(str(imported.path))
    ids = tokenizer.encode("hi there")
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), 300) and bool(mx.all(mx.isfinite(logits)))
    assert isinstance(generate(model, tokenizer, "hi", max_tokens=2), str)


def test_gemma3_is_refused_in_our_words(tmp_path: Path) -> None:
    gguf = write(tmp_path / "gemma3.gguf", "gemma3", MIXES["Q4_K_M"])
    with pytest.raises(ModelImportError) as info:
        import_gguf(str(gguf), name="g")
    assert str(info.value) == (
        f"{gguf}: GGUF architecture 'gemma3' is imported only as a vision model, which needs the model's "
        "Hugging Face files; run an MLX build of it from the hub instead (--model mlx-community/...)"
    )


def test_a_tensor_type_that_cannot_be_read_is_refused_naming_it(tmp_path: Path) -> None:
    gguf = write(tmp_path / "q8k.gguf", "llama", {**MIXES["Q8_0"], "ffn_down": T.Q8_K})
    with pytest.raises(ModelImportError) as info:
        import_gguf(str(gguf), name="q")
    assert str(info.value) == (
        f"{gguf}: tensor type Q8_K (tensor 'blk.0.ffn_down.weight') cannot be converted; re-quantize the GGUF "
        "to Q4_K_M, Q5_K_M, Q6_K or Q8_0 (llama-quantize), or import another file"
    )
