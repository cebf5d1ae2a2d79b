"""`subagent models` (and `import`): the models this machine can run; GGUF files imported."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ...runs.tasks import default_model
from ..flags import JsonOpt
from ..output import err, out, warn
from . import listing

app = typer.Typer(name="models", help="The models this machine can run; import GGUF files.", no_args_is_help=False)


@listing(app)
def models(as_json: JsonOpt = False) -> None:
    """List runnable models (imported and in the Hugging Face cache); * marks the default.

    Example: subagent models --json
    """
    from ...models.catalog import list_models
    from ...models.display import models_table

    default = default_model()
    found = list_models(default, warn=warn)
    if as_json:
        out.print_json(data={"models": [m.model_dump() for m in found]})
        return
    if found:
        out.print(models_table(found))
    if not any(m.default for m in found):
        none = "" if found else "no models found; "
        err.print(
            f"{none}the default model, {default}, is not on this machine: get it with `hf download {default}` "
            "(`pip install huggingface_hub` brings `hf`), pass --model, or import a GGUF file: subagent models "
            "import FILE.gguf (or ollama:NAME:TAG). On Linux or without a big model: docs/models.md#on-linux",
            markup=False,
        )


@app.command("import")
def models_import(
    source: Annotated[str, typer.Argument(help="A .gguf file, or ollama:NAME[:TAG] from Ollama's store.")],
    name: Annotated[Optional[str], typer.Option("--name", help="Name for --model (default: from the file).")] = None,
    bits: Annotated[int, typer.Option("--bits", help="4 or 8: quantize with mlx-lm; 16: keep float16.")] = 4,
) -> None:
    """Convert a GGUF model into $MLX_SUBAGENTS_HOME/models/NAME; then `--model NAME` runs it.

    Example: subagent models import ollama:qwen2.5-coder:7b
    """
    from ...models.display import ImportProgress
    from ...models.importer import import_gguf

    with ImportProgress(err) as progress:
        imported = import_gguf(source, name=name, bits=bits, progress=progress)
    for note in imported.notes:
        err.print(f"note: {note}")
    err.print(f"imported {imported.name} in {imported.seconds:.0f} s: {imported.path}")
    out.print(f"use it with: --model {imported.name}")
