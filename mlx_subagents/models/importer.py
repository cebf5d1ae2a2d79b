"""Import a GGUF file (or an Ollama model) as an mlx-lm model folder under `$MLX_SUBAGENTS_HOME/models`.

The conversion is `gguf2mlx`'s (architecture adapters, config, tokenizer, weights; it fails closed
on what it does not know). Around it this module adds what an import needs: a refusal in one
line before anything is written (architecture, tokenizer), the tokenizer pre-splitting that
gguf2mlx only approximates for some models, a progress bar, and an all-or-nothing result: the
folder is built next to its final place and renamed into it at the end. One import per name at a
time, across processes (a lock file per name); a staging folder no import holds is a killed one's and
is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ModelImportError
from ..home import MAX_NAME_CHARS, long_name_problem, make_state_dir
from ..host.mlx.loading import imported_models_dir
from ..userfiles import read_head
from . import gemma3, ollama
from .gguf_reader import read_gguf, reused

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # at most MAX_NAME_CHARS
IMPORT_FILE = "import.json"  # provenance: where the folder came from
# Beside the models folder, not in it: one lock file per model name, held while it imports.
LOCKS_DIR = Path("locks") / "models"
STAGING = re.compile(r"\.(?P<name>.+)\.importing-[A-Za-z0-9_]+")  # `_staging`'s folders (mkdtemp's suffix)
BITS_CHOICES = (4, 8, 16)
# GGUF quantizes in blocks of 32 weights (K-quants: sub-blocks of 32 with their own scale and min),
# so 32-wide affine groups re-express a 4-bit source almost exactly; gguf2mlx's default of 64
# quantizes it a second time, which SmolLM2-135M does not survive (it stops answering in English).
GROUP_SIZE = 32  # 16: the float16 weights as converted, no re-quantization
TOKENIZER_MODELS = ("gpt2", "llama")  # byte-level BPE and SentencePiece, as gguf2mlx rebuilds them
# llama.cpp's pre-tokenizer types whose splitting gguf2mlx writes exactly.
EXACT_PRE_TYPES = ("gpt-2", "gpt2", "llama-bpe", "llama3", "llama-v3", "qwen2", "deepseek-r1-qwen")
# llama.cpp splits these with `\p{N}` (one digit per piece) then GPT-2's pattern; gguf2mlx
# falls back to a different pattern for them, so the tokenizer is rewritten to HF's equivalent.
DIGITS_THEN_GPT2_PRE_TYPES = ("smollm", "starcoder", "refact")
DIGITS_THEN_GPT2 = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}
# gguf2mlx's numbered steps ("[4/5] Extracting and converting weights...") and mlx-lm's quantization.
STEP_LINE = re.compile(r"^\s*\[(\d)/(\d)\]\s*(.*?)\.*$")
TQDM_COUNT = re.compile(r"(\d+)/(\d+) \[")

Progress = Callable[[str, "int | None", "int | None"], None]  # (step, done, total); None: not counted


@dataclass(frozen=True)
class ImportedModel:
    name: str
    path: Path
    source: str
    bits: int
    seconds: float
    notes: tuple[str, ...] = ()  # one line each: what the import left out (a Gemma 3 vision tower)


def default_name(source: str) -> str:
    """`ollama:qwen2.5-coder:7b` -> `qwen2.5-coder-7b`; `~/m/Model.Q4_K_M.gguf` -> `Model.Q4_K_M`."""
    if source.startswith(ollama.PREFIX):
        repo, tag = ollama.split_reference(source[len(ollama.PREFIX) :])
        stem = f"{repo.rsplit('/', 1)[-1]}-{tag}"
    else:
        stem = Path(source).name.removesuffix(".gguf")
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-.")[:MAX_NAME_CHARS].rstrip("-.") or "model"


def resolve_source(source: str) -> Path:
    """The GGUF file a source names: a path, or `ollama:NAME[:TAG]` through Ollama's manifests."""
    if source.startswith(ollama.PREFIX):
        return ollama.find_blob(source[len(ollama.PREFIX) :])
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelImportError(f"{path} is not a file; pass a .gguf file or ollama:NAME[:TAG]")
    header, _ = read_head(path, "GGUF file", ModelImportError, 4, text=False)  # a FIFO or device: one line
    if header != b"GGUF":
        raise ModelImportError(f"{path} is not a GGUF file (no GGUF header); pass a .gguf file")
    return path


def check_supported(gguf: Path, reader: Any) -> dict[str, Any]:
    """Refuse, in one line and before writing anything, what the conversion cannot do right.

    Args:
        reader: `gguf`'s reader of the file (`read_gguf`).

    Returns a few metadata facts for the provenance record.
    """
    from gguf2mlx import detect_architecture
    from gguf2mlx.gguf2mlx import CONVERTIBLE_ARCHES, get_metadata_str
    from gguf2mlx.vlm import is_vlm

    arch = detect_architecture(reader)
    if arch not in CONVERTIBLE_ARCHES:
        raise ModelImportError(
            f"{gguf}: GGUF architecture '{arch}' is not supported (supported: {', '.join(sorted(CONVERTIBLE_ARCHES))})"
        )
    notes = [note] if arch == gemma3.ARCH and (note := gemma3.vision_note(reader)) else []
    if arch != gemma3.ARCH and is_vlm(reader):  # gguf2mlx takes these only with the model's Hugging Face files
        raise ModelImportError(
            f"{gguf}: GGUF architecture '{arch}' is imported only as a vision model, which needs the model's "
            f"Hugging Face files; run an MLX build of it from the hub instead (--model mlx-community/...)"
        )
    if bad := next((t for t in reader.tensors if not _decodable(t.tensor_type) and not gemma3.is_vision(t.name)), None):
        raise ModelImportError(
            f"{gguf}: tensor type {bad.tensor_type.name} (tensor '{bad.name}') cannot be converted; "
            f"re-quantize the GGUF to Q4_K_M, Q5_K_M, Q6_K or Q8_0 (llama-quantize), or import another file"
        )
    tokenizer = (get_metadata_str(reader, "tokenizer.ggml.model") or "").lower()
    if tokenizer not in TOKENIZER_MODELS:
        raise ModelImportError(
            f"{gguf}: tokenizer model '{tokenizer or 'none'}' is not supported (supported: {', '.join(TOKENIZER_MODELS)})"
        )
    pre = get_metadata_str(reader, "tokenizer.ggml.pre")
    embedded = get_metadata_str(reader, "tokenizer.huggingface.json") is not None
    known = (*EXACT_PRE_TYPES, *DIGITS_THEN_GPT2_PRE_TYPES)
    if tokenizer == "gpt2" and pre and not embedded and pre not in known:
        raise ModelImportError(
            f"{gguf}: tokenizer pre-type '{pre}' is not supported: its text would split differently "
            f"from the model's training (supported: {', '.join(known)})"
        )
    facts = {
        "architecture": arch,
        "tokenizer": tokenizer,
        "tokenizer_pre": pre,
        "tensors": len(reader.tensors),
        "parameters": sum(int(t.n_elements) for t in reader.tensors),  # the source's, before any re-quantization
    }
    return {**facts, "notes": notes}


def _decodable(tensor_type: Any) -> bool:
    """Whether gguf2mlx can read a tensor of this type: a float or integer one, or one `gguf` dequantizes."""
    from gguf.constants import GGMLQuantizationType as T
    from gguf.quants import _type_traits

    return tensor_type in _type_traits or tensor_type in (T.F32, T.F16, T.F64, T.I8, T.I16, T.I32, T.I64)


def float_dtype() -> str:
    """float16 where Metal runs the model; float32 on a CPU, which has no fast float16 arithmetic
    (a 4-bit matmul with float16 scales and activations is ~40x slower there than with float32)."""
    import mlx.core as mx

    return "float16" if mx.metal.is_available() else "float32"


def fix_pre_tokenizer(folder: Path) -> bool:
    """Give the tokenizer llama.cpp's exact splitting where gguf2mlx approximates it."""
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    if config.get("gguf_tokenizer_pre") not in DIGITS_THEN_GPT2_PRE_TYPES:
        return False
    tokenizer = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer["normalizer"] = None  # llama.cpp does not normalize these vocabularies
    tokenizer["pre_tokenizer"] = DIGITS_THEN_GPT2
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    return True


class ConverterOutput(io.TextIOBase):
    """Where gguf2mlx's prints and tqdm bars go: kept for the error line, turned into progress."""

    def __init__(self, progress: Progress | None) -> None:
        self.lines: list[str] = []
        self._progress = progress
        self._step = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        for line in re.split(r"[\r\n]+", text):
            line = line.strip()
            if not line:
                continue
            self.lines.append(line)
            if self._progress is None:
                continue
            step = STEP_LINE.match(line)
            if step:
                self._step = step.group(3)
                self._progress(f"{step.group(1)}/{step.group(2)} {self._step}", None, None)
            elif line.startswith("[mlx-lm]"):
                self._step = "Quantizing with mlx-lm"
                self._progress(self._step, None, None)
            elif (count := TQDM_COUNT.search(line)) and self._step:
                self._progress(f"  {self._step}: tensors", int(count.group(1)), int(count.group(2)))
        return len(text)

    def failure(self) -> str:
        """gguf2mlx's own reason: its last `❌` line."""
        reasons = [line.lstrip("❌ ").strip() for line in self.lines if line.startswith("❌")]
        return reasons[-1] if reasons else (self.lines[-1] if self.lines else "no reason given")


def _try_lock(models: Path, name: str) -> int | None:
    """An open lock file of `name`, locked; None if another import holds it. The kernel lets go of
    a `flock` when its holder dies, so a killed import never leaves the name locked."""
    locks = make_state_dir(models.parent / LOCKS_DIR)
    fd = os.open(locks / name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def _import_lock(target: Path) -> Iterator[None]:
    """Hold `target`'s name for one import; a second import of it is refused, not queued (it would
    find the name taken when the first ends)."""
    fd = _try_lock(target.parent, target.name)
    if fd is None:
        raise ModelImportError(
            f"model '{target.name}' is being imported by another process; wait for that import to end, or pass another --name"
        )
    try:
        _remove_stale_staging(target.parent, held=target.name)
        yield
    finally:
        os.close(fd)  # closing the file lets go of the lock


def _remove_stale_staging(models: Path, held: str) -> None:
    """Remove the staging folders of killed imports: those whose name no running import holds, and
    those of `held`, the name this import holds (so no other import of it runs: a folder of that name
    is a killed one's; asking for its lock again would be refused, by this import's own)."""
    for folder in make_state_dir(models).iterdir():
        match = STAGING.fullmatch(folder.name)
        if match is None or folder.is_symlink() or not folder.is_dir():
            continue
        name = match.group("name")
        if name == held:
            shutil.rmtree(folder, ignore_errors=True)
            continue
        fd = _try_lock(models, name) if NAME_PATTERN.fullmatch(name) else None
        if fd is not None:
            shutil.rmtree(folder, ignore_errors=True)
            os.close(fd)


@contextlib.contextmanager
def _staging(target: Path) -> Iterator[Path]:
    """A folder beside `target`, removed unless the block renamed it into place."""
    make_state_dir(target.parent)
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.importing-", dir=target.parent))
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def import_gguf(
    source: str, *, name: str | None = None, bits: int = 4, progress: Progress | None = None
) -> ImportedModel:
    """Convert `source` (a .gguf path or `ollama:NAME[:TAG]`) into `$MLX_SUBAGENTS_HOME/models/NAME`.

    Args:
        name: the model's name for `--model` (default: from the file or Ollama name).
        bits: 4 or 8 re-quantize with mlx-lm (groups of 32, as GGUF blocks); 16 keeps the float weights.
        progress: called with (step, done, total) as the conversion advances.
    """
    if bits not in BITS_CHOICES:
        raise ModelImportError(f"--bits {bits} is not supported; use one of {', '.join(map(str, BITS_CHOICES))}")
    name = name or default_name(source)
    if problem := long_name_problem(name, "model name"):
        raise ModelImportError(problem)
    if not NAME_PATTERN.fullmatch(name):
        raise ModelImportError(f"model name '{name}' is not valid; use letters, digits, '.', '_' and '-'")
    target = imported_models_dir() / name
    _check_free(target)
    gguf = resolve_source(source)
    reader = read_gguf(gguf)  # parsed once: the checks and the conversion share it
    facts = check_supported(gguf, reader)
    with _import_lock(target):
        _check_free(target)  # another process may have imported it while this one read the file
        return _convert(source, (gguf, reader), target, bits, facts, progress)


def _run_converter(read: tuple[Path, Any], arch: str, folder: Path, dtype: str, bits: int) -> bool:
    """gguf2mlx's conversion into `folder` (Gemma 3 as `gemma3_text`, its vision tower left out), on the
    reader already parsed; False when it refused (its reason is in its output)."""
    from gguf2mlx import convert

    if arch == gemma3.ARCH:
        return gemma3.convert_text_model(read, folder, dtype, bits, GROUP_SIZE)
    gguf, reader = read
    with reused(reader, gguf):
        return convert(
            str(gguf),
            str(folder),
            dtype,
            quantize=bits < 16,
            q_bits=bits,
            q_group_size=GROUP_SIZE,
            weight_audit=False,
        )


def _check_free(target: Path) -> None:
    if target.exists():
        raise ModelImportError(f"a model named '{target.name}' already exists at {target}; pass --name or delete it")


def _convert(
    source: str, read: tuple[Path, Any], target: Path, bits: int, facts: dict[str, Any], progress: Progress | None
) -> ImportedModel:
    """Convert `read` (the GGUF file and its reader) into a staging folder beside `target` and rename it
    into place (the name's lock held)."""
    gguf = read[0]
    dtype = float_dtype()
    start = time.perf_counter()
    with _staging(target) as stage:
        out = ConverterOutput(progress)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its tokenizer warning is handled by fix_pre_tokenizer
            try:
                ok = _run_converter(read, facts["architecture"], stage / "model", dtype, bits)
            except Exception as exc:  # the converter's own failures, made one line
                raise ModelImportError(f"{gguf}: conversion failed ({type(exc).__name__}: {exc})") from None
        if not ok:
            raise ModelImportError(f"{gguf}: conversion failed: {out.failure()}")
        folder = stage / "model"
        fixed = fix_pre_tokenizer(folder)
        record = {
            "source": source,
            "gguf": str(gguf),
            "bits": bits,
            "dtype": dtype,
            "pre_tokenizer_fixed": fixed,
            **facts,
        }
        (folder / IMPORT_FILE).write_text(json.dumps(record, indent=2), encoding="utf-8")
        folder.rename(target)
    return ImportedModel(target.name, target, source, bits, time.perf_counter() - start, tuple(facts["notes"]))
