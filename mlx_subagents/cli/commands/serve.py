"""`subagent serve`: the state folder's server started here or in the background, its status, its stop
(what those do: `cli/serve.py`)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Annotated

import typer

from ...runs.options import RunOptions
from ..flags import (
    Batching,
    BatchingOpt,
    DraftOpt,
    JsonOpt,
    KvBitsOpt,
    KvBudgetOpt,
    ModelOpt,
    PrefillSliceOpt,
    PrefixCacheOpt,
    WindowOpt,
)
from ..output import err, out
from ..serve import serve_args, show_status, start_detached, stop_server

app = typer.Typer()


@app.command()
def serve(
    model: ModelOpt = None,
    cwd: Annotated[
        Path,
        typer.Option(
            "--cwd",
            "-C",
            exists=True,
            file_okay=False,
            help="Workspace of an HTTP client that gives none (no roots, no ?cwd= in its URL).",
        ),
    ] = Path("."),
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="HTTP port on 127.0.0.1 (0: any free port).")
    ] = 8421,
    no_http: Annotated[bool, typer.Option("--no-http", help="Serve only on the unix socket (no HTTP).")] = False,
    kv_budget: KvBudgetOpt = None,
    kv_bits: KvBitsOpt = None,
    context_window: WindowOpt = None,
    batching: BatchingOpt = Batching.on,
    prefix_cache: PrefixCacheOpt = None,
    prefill_slice: PrefillSliceOpt = None,
    draft: DraftOpt = None,
    detach: Annotated[
        bool, typer.Option("--detach", "-d", help="Start in the background and return once it listens.")
    ] = False,
    status: Annotated[
        bool, typer.Option("--status", help="Show the running server's clients, models and tasks.")
    ] = False,
    stop: Annotated[
        bool, typer.Option("--stop", help="Stop the running server: its tasks are cancelled and saved.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Hold the models and run the agents of every client in one process: MCP over HTTP and a unix socket;
    `subagent mcp` and the commands use it when it runs.

    Example: subagent serve --model mlx-community/Qwen3-4B-Instruct-2507-4bit
    """
    if status:
        raise typer.Exit(show_status(as_json))
    if stop:
        raise typer.Exit(stop_server())
    from ..config import load_config, read_draft, read_kv_budget, read_prefill_slice, read_prefix_cache

    configured = load_config().values  # below the flags, as for every command (its `model`: the environment's)
    kv_budget = kv_budget if kv_budget is not None else configured.get("kv_budget")
    prefix_cache = prefix_cache if prefix_cache is not None else configured.get("prefix_cache")
    prefill_slice = prefill_slice if prefill_slice is not None else configured.get("prefill_slice")
    draft = draft if draft is not None else configured.get("draft")
    bits = kv_bits if kv_bits is not None else configured.get("kv_bits")
    options = RunOptions(
        model=model,
        batching=batching == Batching.on,
        kv_budget=read_kv_budget(kv_budget),
        prefix_cache=read_prefix_cache(prefix_cache),
        prefill_slice=read_prefill_slice(prefill_slice),
        draft=read_draft(draft),
        kv_bits=None if bits is None else int(bits),
        context_window=context_window,
    )
    if detach:
        info = start_detached(serve_args(sys.argv[2:]))
        out.print(f"serving: {info.where()}; log {info.log}", markup=False)
        from ...serve.service import sandbox_notice

        if notice := sandbox_notice():  # the server's log has it too; a detached server's is not on screen
            err.print(f"warning: {notice}", markup=False)
        return
    from ...serve.service import ServeConfig
    from ...serve.service import serve as run_server

    config = ServeConfig(options, Path(cwd).resolve(), None if no_http else port)
    raise typer.Exit(asyncio.run(run_server(config)))
