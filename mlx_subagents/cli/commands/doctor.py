"""`subagent doctor`: the MCP servers, mlx, the device, memory and the model checked."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from ...runs.tasks import default_model
from ..flags import CwdOpt, DraftOpt, KvBitsOpt, KvBudgetOpt, ModelOpt, PrefillSliceOpt, WindowOpt
from ..output import out

app = typer.Typer()


@app.command()
def doctor(
    model: ModelOpt = None,
    context_window: WindowOpt = None,
    kv_budget: KvBudgetOpt = None,
    prefill_slice: PrefillSliceOpt = None,
    kv_bits: KvBitsOpt = None,
    draft: DraftOpt = None,
    cwd: CwdOpt = Path("."),
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Also start the MCP servers of the project's files.")
    ] = False,
) -> None:
    """Check each configured MCP server answers (one line each), then mlx, the device and memory, and
    that the model loads and answers.

    Example: subagent doctor --model mlx-community/Qwen3-4B-Instruct-2507-4bit
    """
    from ...agents.discovery import discover_agents
    from ...host import DEFAULT_KV_BITS
    from ..config import load_config, read_draft
    from ..doctor import run_doctor
    from ..mcp_servers import check_servers, mcp_entries

    config = load_config()
    for line in config.lines():
        out.print(line, markup=False)
    root = Path(cwd).resolve()
    entries, _ = mcp_entries(discover_agents(root), root)
    servers_ok = asyncio.run(check_servers(entries, root, out.print, yes))
    kv_budget = kv_budget or config.values.get("kv_budget")
    prefill_slice = prefill_slice or config.values.get("prefill_slice")
    bits = int(kv_bits or config.values.get("kv_bits") or DEFAULT_KV_BITS)
    draft = read_draft(draft) or config.values.get("draft")
    ok = asyncio.run(
        run_doctor(model or default_model(), context_window, out.print, kv_budget, prefill_slice, bits, draft)
    )
    raise typer.Exit(0 if ok and servers_ok else 1)
