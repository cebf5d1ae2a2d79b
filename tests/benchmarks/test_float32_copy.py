"""The benchmarks' `--dequantize` copy: a quantized model's float32 twin that computes what it computes,
with the same tokenizer and template, so that two servers given the copy serve the same model."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.workload import float32_copy
from mlx_subagents.errors import SubagentError


def quantized_tiny(source: Path, target: Path) -> Path:
    """The tiny model quantized to 4 bits in groups of 32, saved as mlx-lm saves a quantized model."""
    import shutil

    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    model, config = load_model(source)
    model, config = quantize_model(model, config, group_size=32, bits=4)
    target.mkdir()
    save_model(target, model)
    save_config(config, config_path=target / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(source / name, target / name)
    return target


def test_a_float32_copy_computes_the_quantized_models_logits(tiny_qwen3_path: Path, tmp_path: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    quantized = quantized_tiny(tiny_qwen3_path, tmp_path / "q4")
    copy = float32_copy(quantized, tmp_path / "f32")

    assert (copy / "tokenizer.json").read_bytes() == (quantized / "tokenizer.json").read_bytes()
    assert (copy / "tokenizer_config.json").read_bytes() == (quantized / "tokenizer_config.json").read_bytes()
    model_q, tokenizer = load(str(quantized))
    model_f, _ = load(str(copy))
    weights = dict(tree_flatten(model_f.parameters()))
    assert not [k for k in weights if k.endswith((".scales", ".biases"))]
    assert {v.dtype for v in weights.values()} == {mx.float32}
    ids = mx.array([tokenizer.encode("def load_config(path): return read(path)")])
    want, got = model_q(ids), model_f(ids)
    assert got.dtype == mx.float32 and got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-4).item()


def test_a_model_that_is_not_quantized_is_named_with_the_fix(tiny_qwen3_path: Path, tmp_path: Path) -> None:
    with pytest.raises(SubagentError) as error:
        float32_copy(tiny_qwen3_path, tmp_path / "f32")
    assert str(error.value) == f"{tiny_qwen3_path}: not quantized; leave out --dequantize"
    assert not (tmp_path / "f32").exists()
