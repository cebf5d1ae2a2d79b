"""`subagent cache` (and `clear`): the prompt prefixes kept on disk for warm starts."""

from __future__ import annotations

import time

import typer

from ..flags import JsonOpt
from ..output import err, out, warn
from . import listing

app = typer.Typer(name="cache", help="The prompt prefixes kept on disk for warm starts.", no_args_is_help=False)


@listing(app)
def cache(as_json: JsonOpt = False) -> None:
    """List the stored prefixes (model, tokens, size, last used), most recently used first.

    Example: subagent cache --json
    """
    from ...host.kv.prefix_files import list_prefixes, prefix_cache_dir

    found = list_prefixes(warn=warn)
    if as_json:
        rows = [
            {"model": p.model, "tokens": p.n_tokens, "bytes": p.nbytes, "last_used": p.last_used, "file": str(p.path)}
            for p in found
        ]
        out.print_json(data={"folder": str(prefix_cache_dir()), "prefixes": rows})
        return
    for p in found:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(p.last_used))
        out.print(f"{p.model}  {p.n_tokens} tokens  {p.nbytes / 2**20:.1f} MiB  last used {used}", highlight=False)
    total = sum(p.nbytes for p in found)
    err.print(f"{len(found)} prefixes, {total / 2**20:.1f} MiB in {prefix_cache_dir()}")


@app.command("clear")
def cache_clear() -> None:
    """Delete every stored prefix; the next run of each agent prefills its prompt again.

    Example: subagent cache clear
    """
    from ...host.kv.prefix_files import clear_prefixes, prefix_cache_dir

    n, freed = clear_prefixes(warn=warn)
    err.print(f"deleted {n} prefixes ({freed / 2**20:.1f} MiB) from {prefix_cache_dir()}")
