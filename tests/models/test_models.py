"""`subagent models`: the catalog, imported-name resolution, Ollama lookup and import refusals
(fast: tiny models and hand-written GGUF headers; the real import is in test_smollm2.py)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.errors import ModelImportError, ModelNotFoundError
from mlx_subagents.host.mlx.loading import resolve_model_path
from mlx_subagents.models import ollama
from mlx_subagents.models.catalog import fits_memory, list_models
from mlx_subagents.models.importer import default_name, import_gguf
from mlx_subagents.runs.model_grants import describe_models


def models_dir() -> Path:
    return Path(os.environ["MLX_SUBAGENTS_HOME"]) / "models"


def write_gguf(path: Path, arch: str, tokenizer: str = "gpt2") -> Path:
    """A small valid GGUF: metadata and one float32 tensor."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_string("tokenizer.ggml.model", tokenizer)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_ollama_reference_names_the_manifest() -> None:
    assert ollama.split_reference("qwen2.5-coder:7b") == ("registry.ollama.ai/library/qwen2.5-coder", "7b")
    assert ollama.split_reference("smollm2") == ("registry.ollama.ai/library/smollm2", "latest")
    assert ollama.split_reference("me/coder:q4") == ("registry.ollama.ai/me/coder", "q4")
    assert ollama.split_reference("hf.co/org/repo:Q4_K_M") == ("hf.co/org/repo", "Q4_K_M")
    assert default_name("ollama:qwen2.5-coder:7b") == "qwen2.5-coder-7b"
    assert default_name("/m/SmolLM2 135M.Q4_1.gguf") == "SmolLM2-135M.Q4_1"


def test_ollama_lookup_errors_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ModelImportError) as info:
        ollama.find_blob("qwen2.5-coder:7b", tmp_path)
    manifest = tmp_path / "manifests/registry.ollama.ai/library/qwen2.5-coder/7b"
    assert str(info.value) == (
        f"Ollama has no model qwen2.5-coder:7b (no manifest at {manifest}); run `ollama pull qwen2.5-coder:7b` first"
    )
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.license"}]}))
    with pytest.raises(ModelImportError, match="no application/vnd.ollama.image.model layer"):
        ollama.find_blob("qwen2.5-coder:7b", tmp_path)
    layer = {"mediaType": ollama.MODEL_LAYER, "digest": "sha256:" + "ab" * 32}
    manifest.write_text(json.dumps({"layers": [layer]}))
    with pytest.raises(ModelImportError) as info:
        ollama.find_blob("qwen2.5-coder:7b", tmp_path)
    assert str(info.value).startswith(f"{tmp_path / 'blobs' / ('sha256-' + 'ab' * 32)} is missing")


@pytest.mark.parametrize(
    ("arch", "tokenizer", "message"),
    [
        ("bert", "gpt2", "GGUF architecture 'bert' is not supported (supported: "),
        ("llama", "rwkv", "tokenizer model 'rwkv' is not supported (supported: gpt2, llama)"),
    ],
)
def test_import_refuses_in_one_line_and_writes_nothing(tmp_path: Path, arch: str, tokenizer: str, message: str) -> None:
    gguf = write_gguf(tmp_path / "model.gguf", arch, tokenizer)
    with pytest.raises(ModelImportError) as info:
        import_gguf(str(gguf), name="m")
    assert str(info.value).startswith(f"{gguf}: {message}")
    assert "\n" not in str(info.value)
    assert not models_dir().exists() or list(models_dir().iterdir()) == []


def test_import_refuses_bad_sources_and_names(tmp_path: Path) -> None:
    with pytest.raises(ModelImportError, match="is not a file; pass a .gguf file or ollama:NAME"):
        import_gguf(str(tmp_path / "missing.gguf"))
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(ModelImportError, match="is not a GGUF file"):
        import_gguf(str(tmp_path / "x.gguf"))
    with pytest.raises(ModelImportError, match="model name 'a/b' is not valid"):
        import_gguf(str(tmp_path / "x.gguf"), name="a/b")
    (models_dir() / "taken").mkdir(parents=True)
    with pytest.raises(ModelImportError, match="a model named 'taken' already exists"):
        import_gguf(str(tmp_path / "x.gguf"), name="taken")
    with pytest.raises(ModelImportError, match="--bits 3 is not supported; use one of 4, 8, 16"):
        import_gguf(str(tmp_path / "x.gguf"), bits=3)


def test_a_bare_name_resolves_to_an_imported_model(tiny_qwen3_path: Path) -> None:
    shutil.copytree(tiny_qwen3_path, models_dir() / "tiny")
    assert resolve_model_path("tiny") == models_dir() / "tiny"
    assert resolve_model_path("mlx/tiny") == models_dir() / "tiny"
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path("nothing-here")
    assert str(info.value).startswith("model 'nothing-here' is neither a folder nor an imported model; ")


def tiny_parameters(path: Path) -> int:
    import mlx.core as mx

    return sum(v.size for v in mx.load(str(path / "model.safetensors")).values())


def test_catalog_lists_imported_models_with_their_facts(tiny_qwen3_path: Path, run_cli: Any) -> None:
    shutil.copytree(tiny_qwen3_path, models_dir() / "tiny")
    (models_dir() / ".tiny.importing-x").mkdir()  # an import in progress is not a model
    (models_dir() / "empty").mkdir()  # nor is a folder without weights
    [info] = list_models(default="tiny")
    assert (info.name, info.source, info.model_type, info.default) == ("tiny", "imported", "qwen3", True)
    assert info.parameters == tiny_parameters(tiny_qwen3_path)
    assert info.quantization == "float32" and info.context_window == 4096
    assert info.tool_mode == "native"  # the tiny model's Qwen-style template renders tools
    config = json.loads((tiny_qwen3_path / "config.json").read_text())
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4
    assert info.kv_bytes_per_token == per_token
    assert info.size_bytes == sum(f.stat().st_size for f in tiny_qwen3_path.iterdir())
    assert info.fits_memory is True

    code, out, _ = run_cli("models", "--json")
    assert code == 0
    [row] = json.loads(out)["models"]
    assert row["name"] == "tiny" and row["default"] is False  # the default is the Qwen3 4B, not this
    code, out, _ = run_cli("models")
    assert code == 0 and "tiny" in out and "float32" in out


def test_catalog_lists_mlx_models_in_the_hub_cache(
    tiny_qwen3_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = tmp_path / "hub/models--mlx-community--tiny/snapshots/0123abcd"
    shutil.copytree(tiny_qwen3_path, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs/main").write_text("0123abcd")
    [info] = list_models(default="mlx-community/tiny")
    assert (info.name, info.source, info.default) == ("mlx-community/tiny", "hf-cache", True)
    assert info.parameters == tiny_parameters(tiny_qwen3_path)


def test_fits_memory_leaves_room_for_five_full_sessions() -> None:
    per_token = 2 * 28 * 8 * 128 * 2  # a Qwen3-4B-like model: 112 KiB per token
    gib = 2**30
    assert fits_memory(2 * gib, per_token, 262144, ram=64 * gib) is True  # capped at 32k: 5 x 3.5 GiB
    assert fits_memory(2 * gib, per_token, 262144, ram=16 * gib) is False
    assert fits_memory(20 * gib, per_token, 4096, ram=16 * gib) is False  # weights alone are too big
    assert fits_memory(2 * gib, None, 4096, ram=16 * gib) is None


def test_import_progress_shows_each_step_and_the_tensor_count() -> None:
    import io

    from rich.console import Console

    from mlx_subagents.models.display import ImportProgress
    from mlx_subagents.models.importer import ConverterOutput

    stream = io.StringIO()
    with ImportProgress(Console(file=stream, width=100)) as progress:
        out = ConverterOutput(progress)
        out.write("[1/5] Reading GGUF file...\n  ✓ GGUF version 3\n[4/5] Extracting and converting weights...\n")
        out.write(
            "\r  Converting:  50%|#####     | 136/272 [00:05<00:05]\r  Converting: 100%|##| 272/272 [00:09<00:00]"
        )
        out.write("\n[mlx-lm] Quantizing converted output...\n❌ Quantization failed: out of memory\n")
    text = stream.getvalue()
    for line in ("1/5 Reading GGUF file", "4/5 Extracting and converting weights", "272/272", "Quantizing with mlx-lm"):
        assert line in text
    assert out.failure() == "Quantization failed: out of memory"


HOLD_IMPORT = """
import sys
from pathlib import Path
from mlx_subagents.host.mlx.loading import imported_models_dir
from mlx_subagents.models.importer import _import_lock, _staging

target = imported_models_dir() / sys.argv[1]
with _import_lock(target), _staging(target) as stage:
    (stage / "model").mkdir()
    (stage / "model" / "part.safetensors").write_bytes(b"half-written")
    print(stage.name, flush=True)
    sys.stdin.read()  # holds the name until the test closes stdin or kills it
"""


def hold_import(name: str) -> tuple[Any, str]:
    """Another process importing `name`, stopped in the middle of its conversion: (process, staging folder)."""
    import subprocess
    import sys

    process = subprocess.Popen(
        [sys.executable, "-c", HOLD_IMPORT, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    return process, process.stdout.readline().strip()  # type: ignore[union-attr]


@pytest.mark.process
def test_a_second_import_of_one_name_is_refused_while_the_first_runs(tmp_path: Path, run_cli: Any) -> None:
    gguf = write_gguf(tmp_path / "model.gguf", "llama")  # passes the checks that come before the lock
    process, staging = hold_import("m")
    try:
        code, out, err = run_cli("models", "import", str(gguf), "--name", "m")
        assert (code, out) == (2, "")
        assert err.strip() == (  # one line, after the progress display's blank one
            "error: model 'm' is being imported by another process; wait for that import to end, or pass another --name"
        )
        assert (models_dir() / staging / "model" / "part.safetensors").is_file()  # the running import's own
        with pytest.raises(ModelImportError, match="^model 'm' is being imported by another process; "):
            import_gguf(str(gguf), name="m")  # in one process too: the lock is per open file
    finally:
        process.stdin.close()  # type: ignore[union-attr]
        assert process.wait() == 0
    assert sorted(p.name for p in models_dir().iterdir()) == []  # it cleaned up after itself


@pytest.mark.slow
@pytest.mark.process
def test_a_killed_import_leaves_nothing_after_the_next_import(tmp_path: Path) -> None:
    import signal

    running, running_staging = hold_import("other")  # started first: its own clean-up cannot be the cause
    killed, killed_staging = hold_import("m")
    killed.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    assert (models_dir() / killed_staging).is_dir()  # what a killed import leaves
    try:
        gguf = write_gguf(tmp_path / "model.gguf", "llama")  # no weights to convert: the conversion fails
        with pytest.raises(ModelImportError, match="conversion failed"):
            import_gguf(str(gguf), name="m")  # the next import of that name cleans up, even one that fails
        # The killed import's folder is gone; the running import's is kept.
        assert sorted(p.name for p in models_dir().iterdir()) == [running_staging]
    finally:
        running.stdin.close()  # type: ignore[union-attr]
        assert running.wait() == 0


def test_a_damaged_model_folder_is_one_warning_and_the_catalog_stands(tiny_qwen3_path: Path, run_cli: Any) -> None:
    """One damaged folder (weights cut short, a config of another shape) made `subagent models` and the
    `models` form end in a traceback: every model was lost with it."""
    shutil.copytree(tiny_qwen3_path, models_dir() / "tiny")
    (models_dir() / "cut").mkdir()
    (models_dir() / "cut" / "config.json").write_text('{"model_type": "qwen3"}')
    (models_dir() / "cut" / "model.safetensors").write_bytes(b"xx")
    (models_dir() / "listed").mkdir()
    (models_dir() / "listed" / "config.json").write_text("[]")
    (models_dir() / "listed" / "model.safetensors").write_bytes(b"")

    code, out, err = run_cli("models", "--json")
    assert code == 0 and [row["name"] for row in json.loads(out)["models"]] == ["tiny"]
    fix = "import it again or remove the folder"
    assert err.startswith(
        f"warning: {models_dir() / 'cut'}: not a model mlx-lm can read (Error while deserializing header: header "
        f"too small); {fix}\nwarning: {models_dir() / 'listed'}: not a model mlx-lm can read ('list' object has "
        f"no attribute 'get'); {fix}\n"
    )
    lines = describe_models(["tiny", "cut"], {}, []).splitlines()
    assert lines[1].startswith("- tiny: not loaded; context 4,096 tokens")
    assert (
        lines[2]
        == f"- cut: {models_dir() / 'cut'}: not a model mlx-lm can read (Error while deserializing header: header too small); {fix}"
    )
