"""GGUF files people have: the Ollama families in the usual quantizations import and answer through
`mlx_lm.load`, or are refused in one line naming the architecture or tensor type and what would work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten

from mlx_subagents.errors import ModelImportError
from mlx_subagents.host.mlx.loading import imported_models_dir
from mlx_subagents.models.importer import import_gguf
from tests.models.gguf_files import MIXES, QUANTIZATIONS, write, write_gemma3

# general.architecture as Ollama's files carry it: Llama 3.x and Mistral are "llama", Qwen 2.5 "qwen2".
FAMILIES = ("llama", "qwen2", "qwen3", "phi3")


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("arch", FAMILIES)
def test_each_family_imports_in_each_quantization_and_answers(
    tmp_path: Path, arch: str, quantization: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    import mlx.core as mx
    from gguf import GGUFReader
    from mlx_lm import generate, load

    gguf = write(tmp_path / f"{arch}.{quantization}.gguf", arch, MIXES[quantization])
    parses: list[str] = []
    parse = GGUFReader.__init__
    monkeypatch.setattr(
        GGUFReader, "__init__", lambda self, path, *a, **k: parses.append(path) or parse(self, path, *a, **k)
    )
    imported = import_gguf(str(gguf), name=f"{arch}-{quantization}")
    assert parses == [str(gguf)]  # parsed once: the checks and gguf2mlx's two readers share it (5 s for SmolLM2's)
    config = json.loads((imported.path / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    model, tokenizer = load(str(imported.path))
    ids = tokenizer.encode("hi there")
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), 300) and bool(mx.all(mx.isfinite(logits)))
    assert isinstance(generate(model, tokenizer, "hi", max_tokens=2), str)


@pytest.mark.slow
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_gemma3_imports_as_gemma3_text_in_each_quantization_and_answers(tmp_path: Path, quantization: str) -> None:
    import json

    import mlx.core as mx
    from mlx_lm import generate, load

    trained = np.linspace(-0.5, 0.5, 64)  # the q/k norms as trained; the file holds 1 + them
    gguf = write_gemma3(tmp_path / f"gemma3.{quantization}.gguf", MIXES[quantization], norm_shift=trained)
    imported = import_gguf(str(gguf), name=f"gemma3-{quantization}")

    assert imported.notes == ()  # a text model: no vision tower to leave out
    config = json.loads((imported.path / "config.json").read_text())
    assert (config["model_type"], config["quantization"]) == (
        "gemma3_text",
        {"group_size": 32, "bits": 4, "mode": "affine"},
    )
    model, tokenizer = load(str(imported.path))
    weights = dict(tree_flatten(model.parameters()))
    for name in ("q_norm", "k_norm"):
        restored = weights[f"model.layers.0.self_attn.{name}.weight"]
        assert float(mx.abs(restored - mx.array(trained, dtype=restored.dtype)).max()) < 1e-6
    assert float(mx.abs(weights["model.layers.0.input_layernorm.weight"]).max()) == 0.0
    ids = tokenizer.encode("hi there")
    assert (ids, tokenizer.decode(ids)) == ([2, 290, 296], "<bos>hi there")  # SentencePiece, as Gemma's
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    logits = model(mx.array([ids]))
    assert logits.shape == (1, 3, config["vocab_size"]) and bool(mx.all(mx.isfinite(logits)))
    assert isinstance(generate(model, tokenizer, "hi", max_tokens=2), str)


@pytest.mark.slow
def test_a_gemma3_with_its_vision_tower_imports_its_language_model_and_says_so(tmp_path: Path, run_cli: Any) -> None:
    import json

    import mlx.core as mx

    gguf = write_gemma3(tmp_path / "gemma3-4b.gguf", MIXES["Q4_K_M"], vision=True, rope_factor=8.0)
    code, out, err = run_cli("models", "import", str(gguf), "--name", "gemma3-4b")

    assert code == 0, err
    assert (
        "note: the vision tower (5 tensors) is left out: mlx-lm runs Gemma 3's language model, text in and out"
    ) in err.splitlines()
    folder = Path(out.split("--model ", 1)[1].strip())
    folder = imported_models_dir() / folder.name
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["rope_scaling"]) == ("gemma3_text", {"rope_type": "linear", "factor": 8.0})
    names = [k for f in folder.glob("*.safetensors") for k in mx.load(str(f))]
    assert names and not [k for k in names if k.startswith(("v.", "mm.", "vision", "multi_modal"))]


@pytest.mark.slow
def test_an_imported_gemma3_answers_through_the_host(tmp_path: Path) -> None:
    from mlx_lm.utils import load_tokenizer

    from mlx_subagents.runs.tasks import TaskSpec
    from mlx_subagents.testing import ForcedScripts
    from tests.helpers import go, make_runner, write_agent

    imported = import_gguf(str(write_gemma3(tmp_path / "g.gguf", MIXES["Q8_0"])), name="g")
    write_agent(tmp_path, "greeter", "[]", body="Greet.")  # a short prompt: the tiny vocabulary spells it out
    scripts = ForcedScripts(load_tokenizer(imported.path), {"greeter": ["hi there"]})
    runner = make_runner(tmp_path, "g", processor_factory=scripts, assume_yes=True)  # by its name, as --model g
    result = go(runner, "run", TaskSpec("greeter", "say hi"))

    assert result.error is None
    assert (result.status, result.output, result.tool_mode) == ("completed", "hi there", "prompted")


def test_a_tensor_type_that_cannot_be_read_is_refused_naming_it(tmp_path: Path) -> None:
    gguf = write(tmp_path / "q8k.gguf", "llama", {**MIXES["Q8_0"], "ffn_down": T.Q8_K})
    with pytest.raises(ModelImportError) as info:
        import_gguf(str(gguf), name="q")
    assert str(info.value) == (
        f"{gguf}: tensor type Q8_K (tensor 'blk.0.ffn_down.weight') cannot be converted; re-quantize the GGUF "
        "to Q4_K_M, Q5_K_M, Q6_K or Q8_0 (llama-quantize), or import another file"
    )
