"""`subagent doctor`: what mlx sees, and whether a model loads and answers."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable

from ..errors import SubagentError
from ..host import GenerateArgs, MlxModelHost
from ..host.mlx_host import total_memory
from ..host.prefix_store import list_prefixes, prefix_cache_dir

Print = Callable[[str], None]
PROBE = [{"role": "user", "content": "Reply with one short sentence: are you ready?"}]
TOOL_MODES = {
    "native": "the chat template presents the tools; calls are read in the model's own format",
    "prompted": "the template drops tools; their list and a <tool_call> format go in the system prompt",
}


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def environment_lines() -> list[str]:
    import mlx.core as mx
    from mlx_lm import __version__ as mlx_lm_version

    return [
        f"python    {platform.python_version()} on {platform.system()} {platform.machine()}",
        f"mlx       {mx.__version__}  (mlx-lm {mlx_lm_version})",
        f"device    {mx.default_device()}",
        f"memory    {_gib(total_memory())} RAM",
    ]


def prefix_cache_line(bound: int) -> str:
    """Where the warm-start prefixes are, how much they hold and their bound (0: the tier is off)."""
    found = list_prefixes()
    held = f"{len(found)} prefixes, {sum(p.nbytes for p in found) / 2**20:.1f} MiB"
    limit = f"of at most {_gib(bound)}" if bound else "(off)"
    return f"prefixes  {prefix_cache_dir()}: {held} {limit}; `subagent cache` lists them"


async def run_doctor(model: str, context_window: int | None, say: Print, kv_budget: str | None = None) -> bool:
    """Print the checks; True when the model loaded and answered."""
    for line in environment_lines():
        say(line)
    say(f"model     {model}")
    host = MlxModelHost(model, context_window=context_window, kv_budget=kv_budget)
    tic = time.perf_counter()
    try:
        async with host:
            say(
                f"loaded    {host.model_path} in {time.perf_counter() - tic:.1f}s; context window {host.context_window} tokens"
            )
            say(f"tools     {host.tool_mode}: {TOOL_MODES[host.tool_mode]}")
            reply = await host.session("doctor").generate(PROBE, GenerateArgs(max_tokens=32))
            stats = await host.memory_stats()
    except SubagentError as exc:
        say(f"FAILED    {exc}")
        return False
    u = reply.usage
    say(f"reply     {reply.text.strip()[:120]!r}")
    say(
        f"speed     prompt {u.prompt_tokens} tokens in {u.prompt_seconds:.2f}s; {u.generated_tokens} tokens at {u.generation_tps:.1f} tok/s"
    )
    budget = "unbounded" if stats.kv_budget is None else _gib(stats.kv_budget)
    shape = host.kv_shape
    say(
        f"kv cache  {shape.per_token} bytes/token (+{shape.fixed} fixed) per session; budget {budget} "
        f"for {host.max_sessions} sessions; held now {stats.kv_bytes_total / 2**20:.2f} MiB"
    )
    say(f"memory    mlx active {_gib(stats.active_memory)}, peak {_gib(stats.peak_memory)}")
    say(prefix_cache_line(host.prefix_store.max_bytes if host.prefix_store else 0))
    say("ok")
    return True
