"""`subagent serve`: start the state folder's server (in the foreground, or in the background with
`--detach`), or ask the running one how it is (`--status`) or to stop (`--stop`)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import SubagentError
from ..runs.options import RunOptions
from ..serve.client import make_hello, quick
from ..serve.state import ServerInfo, lock_held, running_server, serve_paths
from .flags import (
    Batching,
    BatchingOpt,
    JsonOpt,
    KvBitsOpt,
    KvBudgetOpt,
    ModelOpt,
    PrefillSliceOpt,
    PrefixCacheOpt,
    WindowOpt,
)
from .output import err, out

# How long `--stop` waits for the server to save what ran and exit, and `--detach` for it to listen.
STOP_WAIT_S = 30.0
START_WAIT_S = 60.0


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
    from .config import load_config, read_kv_budget, read_prefill_slice, read_prefix_cache

    configured = load_config().values  # below the flags, as for every command (its `model`: the environment's)
    kv_budget = kv_budget if kv_budget is not None else configured.get("kv_budget")
    prefix_cache = prefix_cache if prefix_cache is not None else configured.get("prefix_cache")
    prefill_slice = prefill_slice if prefill_slice is not None else configured.get("prefill_slice")
    bits = kv_bits if kv_bits is not None else configured.get("kv_bits")
    options = RunOptions(
        model=model,
        batching=batching == Batching.on,
        kv_budget=read_kv_budget(kv_budget),
        prefix_cache=read_prefix_cache(prefix_cache),
        prefill_slice=read_prefill_slice(prefill_slice),
        kv_bits=None if bits is None else int(bits),
        context_window=context_window,
    )
    if detach:
        info = start_detached(serve_args(sys.argv[2:]))
        out.print(f"serving: {info.where()}; log {info.log}", markup=False)
        return
    from ..serve.service import ServeConfig
    from ..serve.service import serve as run_server

    config = ServeConfig(options, Path(cwd).resolve(), None if no_http else port)
    raise typer.Exit(asyncio.run(run_server(config)))


def serve_args(argv: list[str]) -> list[str]:
    """This command's arguments without `--detach`, for the process that serves."""
    return [a for a in argv if a not in ("--detach", "-d")]


def start_detached(args: list[str]) -> ServerInfo:
    """Start `subagent serve ARGS` in the background (its own session: the terminal's signals do not
    reach it; its output to its log) and wait until it listens."""
    paths = serve_paths()
    if (info := running_server(paths, wait=0)) is not None:
        return info
    paths.log.parent.mkdir(parents=True, exist_ok=True)
    with open(paths.log, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "mlx_subagents.cli", "serve", *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            cwd=paths.home,  # never a folder that may go away under it
            start_new_session=True,
        )
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        if (info := running_server(paths, wait=0)) is not None:
            return info
        if process.poll() is not None and not lock_held(paths):
            raise SubagentError(f"the server did not start (exit {process.returncode}); its log is {paths.log}")
        time.sleep(0.1)
    raise SubagentError(f"the server did not listen within {START_WAIT_S:.0f}s; its log is {paths.log}")


def show_status(as_json: bool) -> int:
    paths = serve_paths()
    info = running_server(paths, wait=0)
    if info is None:
        if as_json:
            out.print_json(data={"running": False, "home": str(paths.home)})
        else:
            err.print(f"no server runs for {paths.home} (subagent serve starts one)", markup=False)
        return 1
    status = quick(info, make_hello("status"))["status"]
    if as_json:
        out.print_json(data={"running": True, **status})
        return 0
    for line in status_lines(status):
        out.print(line, markup=False, highlight=False)
    return 0


def status_lines(status: dict[str, Any]) -> list[str]:
    """`--status` in words: the server, its models and KV use, its clients, their tasks."""
    server = status["server"]
    where = " and ".join(p for p in (server.get("url"), server.get("socket")) if p)
    lines = [f"server  pid {server['pid']}, {where}; up {_duration(server['uptime_s'])}; log {server['log']}"]
    kv = status["kv"]
    lines.append(f"kv      {_mib(kv['used'])} of {_mib(kv['budget']) if kv['budget'] else 'unbounded'} in use")
    for m in status["models"] or [{"model": "(none loaded yet)"}]:
        if "weights_bytes" not in m:
            lines.append(f"model   {m['model']}")
            continue
        budget = _mib(m["kv_budget"]) if m["kv_budget"] else "unbounded"
        lines.append(
            f"model   {m['model']}: weights {_mib(m['weights_bytes'])}, KV {_mib(m['kv_bytes'])} of {budget}, "
            f"{_count(m['sessions'], 'session')}, at most {m['most_decoding']} decoding in one batch, "
            f"window {m['context_window']:,} tokens"
        )
    for c in status["clients"]:
        pid = f" pid {c['pid']}" if c["pid"] else ""
        gone = "" if c["connected"] else " (gone; its background tasks run on)"
        lines.append(
            f"client  {c['id']} {c['kind']}{pid} {c['name']} in {c['workspace'] or '?'}: {c['running']} running{gone}"
        )
    for t in status["tasks"]:
        waited = t.get("prefill_wait_s", 0.0)
        lines.append(
            f"task    {t['client']} {t['label']} ({t['agent']}) {t['status']}, turn {t['turn']}, {t['output_tokens']:,} tokens"
            + (f", {waited:.1f}s behind other prompts' prefill" if waited >= 0.05 else "")
        )
    return lines


def stop_server() -> int:
    """Ask the server to stop and wait until it has saved what ran and exited."""
    paths = serve_paths()
    info = running_server(paths, wait=0)
    if info is None:
        err.print(f"no server runs for {paths.home}", markup=False)
        return 1
    quick(info, make_hello("stop"))
    deadline = time.monotonic() + STOP_WAIT_S
    while lock_held(paths):
        if time.monotonic() > deadline:
            err.print(f"the server (pid {info.pid}) is still stopping after {STOP_WAIT_S:.0f}s; see {info.log}")
            return 1
        time.sleep(0.05)
    err.print(f"stopped the server (pid {info.pid}); what ran is saved (subagent runs lists it)", markup=False)
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _mib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h {m}m" if hours else f"{m}m {s}s" if m else f"{s}s"


__all__ = ["serve", "start_detached"]
