"""The state folder's server from the terminal: started in the background (`subagent serve --detach`,
`subagent mcp --serve`), asked how it is (`--status`) or to stop (`--stop`). The command itself is
`commands/serve.py`."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

from ..errors import SubagentError
from ..home import make_state_dir
from ..serve.client import make_hello, quick
from ..serve.state import ServerInfo, lock_held, running_server, serve_paths
from .output import err, out

# How long `--stop` waits for the server to save what ran and exit, and `--detach` for it to listen.
STOP_WAIT_S = 30.0
START_WAIT_S = 60.0


def serve_args(argv: list[str]) -> list[str]:
    """This command's arguments without `--detach`, for the process that serves."""
    return [a for a in argv if a not in ("--detach", "-d")]


def start_detached(args: list[str]) -> ServerInfo:
    """Start `subagent serve ARGS` in the background (its own session: the terminal's signals do not
    reach it; its output to its log) and wait until it listens."""
    paths = serve_paths()
    if (info := running_server(paths, wait=0)) is not None:
        return info
    make_state_dir(paths.log.parent, home=paths.home)
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
    """`--status` in words: the server, its models and KV use, its clients, their tasks, and the chat
    endpoints' conversations (`session` lines)."""
    from ..host import drafts_said

    server = status["server"]
    where = " and ".join(p for p in (server.get("url"), server.get("socket")) if p)
    lines = [f"server  pid {server['pid']}, {where}; up {_duration(server['uptime_s'])}; log {server['log']}"]
    kv = status["kv"]
    if kv["budget"] is None:  # the default budget, sized when a model loads
        lines.append(f"kv      {_mib(kv['used'])} in use; the budget is half the memory the weights leave, once loaded")
    else:
        lines.append(f"kv      {_mib(kv['used'])} of {_mib(kv['budget']) if kv['budget'] else 'unbounded'} in use")
    if loading := status.get("loading"):
        lines.append(f"model   {loading['model']}: loading for {_duration(loading['since_s'])} (a client waits for it)")
    if failed := status.get("load_error"):
        lines.append(f"model   {failed['model']} did not load: {failed['error']}")
    if not status["models"] and not loading and not failed:
        lines.append("model   none loaded: each client's model loads at its first task")
    for m in status["models"]:
        budget = _mib(m["kv_budget"]) if m["kv_budget"] else "unbounded"
        drafts = m.get("drafts")
        lines.append(
            f"model   {m['model']}: weights {_mib(m['weights_bytes'])}, KV {_mib(m['kv_bytes'])} of {budget}, "
            f"{_count(m['sessions'], 'session')}, at most {m['most_decoding']} decoding in one batch, "
            f"window {m['context_window']:,} tokens" + (f"; drafts {drafts_said(**drafts)}" if drafts else "")
        )
    for c in status["clients"]:
        pid = f" pid {c['pid']}" if c["pid"] else ""
        gone = "" if c["connected"] else " (gone; its background tasks run on)"
        where = "" if c["kind"] in ("openai", "anthropic") else f" in {c['workspace'] or '?'}"
        lines.append(f"client  {c['id']} {c['kind']}{pid} {c['name']}{where}: {c['running']} running{gone}")
    for t in status["tasks"]:
        waited = t.get("prefill_wait_s", 0.0)
        lines.append(
            f"task    {t['client']} {t['label']} ({t['agent']}) {t['status']}, turn {t['turn']}, {t['output_tokens']:,} tokens"
            + (f", {waited:.1f}s behind other prompts' prefill" if waited >= 0.05 else "")
        )
    for s in status.get("sessions", []):
        state = "running" if s["status"] == "running" else f"idle {_duration(s['idle_s'])}"
        lines.append(
            f"session {s['client']} {s['session']} ({s['model']}) {state}, {_count(s['turns'], 'turn')}, last prompt "
            f"{s['prompt_tokens']:,} tokens ({s['cached_tokens']:,} cached), {s['generated_tokens']:,} generated"
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


__all__ = ["serve_args", "show_status", "start_detached", "status_lines", "stop_server"]
