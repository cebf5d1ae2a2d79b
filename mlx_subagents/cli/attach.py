"""The running commands attach to `subagent serve` when it runs for the state folder.

`run`, `parallel`, `chain`, `workflow` and `resume` build a `Job`; `run_job` runs it on the server
(when one runs, and the command neither says `--standalone` nor brings hosts of its own: an engine,
a KV budget, a window, a prefix cache or batching off) or here, and returns what the command prints
either way: the server sends the job's events, which go to the same views (`--events`, the progress
table, the task's lines), and its result, which the same `finish_*` prints and exits with. A
project file's consent question is asked on this terminal and answered for this command only.
Ctrl-C, SIGTERM and SIGHUP cancel the job there (a second one exits at once; the server then
cancels it as the connection ends).

The server killed during the job: one line (`error: ...`) and exit 1; what the tasks had done is in
their transcripts, as far as they got.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from ..caps import MAX_WARNINGS
from ..errors import SubagentError
from ..events import Event, Fanout
from ..mcp_server.budget import DEFAULT_CALL_BUDGET
from ..runs.jobs import Job
from ..serve.client import Connection, ServerGone, ServerUnreachable, connect, make_hello
from ..serve.state import ServerInfo, running_server
from .flags import Shared, make_publisher
from .interrupts import Finished, run_async, two_press_sigint
from .live import paused
from .output import err, print_warning_lines

SERVE_ENV = "MLX_SUBAGENTS_SERVE"  # 1: `subagent mcp` starts a server when none runs, as --serve does
INTERRUPTED = "interrupted: stopping every task (Ctrl-C again to quit at once)"


def server_for(shared: Shared) -> ServerInfo | None:
    """The server this command attaches to; None runs it here (a dim line says why, when a server runs)."""
    from .. import __version__

    if shared.standalone:
        return None
    info = running_server()
    if info is None:
        return None
    if (flag := shared.own_hosts()) is not None:
        err.print(f"[dim]{flag}: running in this process (the server's hosts keep the server's settings)[/]")
        return None
    if info.version != __version__:
        err.print(
            f"[dim]the server (pid {info.pid}) runs mlx-subagents {info.version}, this is {__version__}: running in "
            "this process (restart the server to share it)[/]"
        )
        return None
    return info


def serve_mcp(
    shared: Shared, workspace: Path | None, *, start: bool = False, call_budget: float | None = DEFAULT_CALL_BUDGET
) -> int:
    """`subagent mcp`: relay to the server (started first with `start` or `$MLX_SUBAGENTS_SERVE`, when
    none runs), else serve in this process; the exit code."""
    from ..mcp_server.server import serve_stdio
    from ..serve.relay import relay

    make = lambda root, on_event: shared.runner(on_event, root)  # noqa: E731
    info = server_for(shared)
    wanted = start or os.environ.get(SERVE_ENV, "").lower() in ("1", "true", "yes")
    if info is None and wanted and not shared.standalone and running_server(wait=0) is None:
        info = start_server(shared)
    if info is not None:
        where = str(workspace.resolve()) if workspace else None
        budget = "off" if call_budget is None else call_budget
        hello = make_hello("mcp", options=shared.options(), workspace=where, call_budget=budget)
        try:
            return asyncio.run(relay(info, hello, make, workspace, call_budget))
        except SubagentError as exc:  # not reached, or refused: nothing was read yet
            err.print(f"[dim]{escape(str(exc))}: serving in this process[/]")
    return asyncio.run(serve_stdio(make, workspace, call_budget))


def serve_acp(shared: Shared) -> int:
    """`subagent acp`: the ACP agent on stdio; its sessions' chats on the running server (one model for the
    machine), else on runners over this process's hosts; the exit code."""
    from .. import __version__
    from ..acp.stdio import runner_factory, serve_stdio

    options = shared.options()
    asyncio.run(serve_stdio(runner_factory(options), options, __version__, server_for(shared)))
    return 0


def start_server(shared: Shared) -> ServerInfo | None:
    """A server started in the background for `subagent mcp --serve`, with this command's model and host
    settings, on the unix socket only (HTTP clients want one started with `subagent serve`)."""
    from .serve import start_detached

    args = ["--no-http", "--batching", shared.batching.value]
    for flag, value in (
        ("--model", shared.model),
        ("--kv-budget", shared.kv_budget),
        ("--context-window", shared.context_window),
        ("--prefix-cache", shared.prefix_cache),
    ):
        if value is not None:
            args += [flag, str(value)]
    try:
        return start_detached(args)
    except SubagentError as exc:
        err.print(f"[dim]{escape(str(exc))}: serving in this process[/]")
        return None


def run_job(shared: Shared, job: Job, sinks: Fanout, *, cwd: Path | None = None) -> Finished[Any]:
    """The job's result (and the exit code a signal chose), from the server or from a runner here."""
    info = server_for(shared)
    if info is not None:
        hello = make_hello(
            "job",
            options=shared.options(),
            workspace=str(Path(cwd or shared.cwd).resolve()),
            interactive=sys.stdin.isatty(),
            job=job,
        )
        publisher = make_publisher(Path(hello.workspace or shared.cwd))  # its tasks, for `subagent watch`
        sinks.targets.append(publisher.handle)
        try:
            return asyncio.run(attached(info, hello, job, sinks))
        except ServerUnreachable as exc:
            err.print(f"[dim]{escape(str(exc))}: running in this process[/]")
        except ServerGone as exc:
            err.print(f"[red]error:[/] {escape(str(exc))}")
            raise typer.Exit(1) from None
        finally:
            publisher.close()
            sinks.targets.remove(publisher.handle)
    runner = shared.runner(sinks, cwd=cwd)
    return run_async(runner, lambda: job.run(runner), err)


async def attached(info: ServerInfo, hello: Any, job: Job, sinks: Fanout) -> Finished[Any]:
    """Send the job, show its events as they come, answer its questions; its result."""
    connection = await connect(info, hello)
    loop = asyncio.get_running_loop()

    def stop(reason: str) -> None:
        connection.send({"cancel": reason})

    try:
        with two_press_sigint(loop, err, INTERRUPTED, stop, exit_after=False, tools_here=False) as signalled:
            while (message := await connection.next()) is not None:
                if "result" in message:
                    return Finished(job.result(message["result"]), signalled.exit_code)
                if "interrupted" in message:  # stopped before anything ran: nothing to print
                    if signalled.exit_code is not None:
                        raise SystemExit(signalled.exit_code)
                    raise KeyboardInterrupt
                on_message(connection, message, sinks)
    finally:
        connection.close()
    raise ServerGone(
        f"the server (pid {info.pid}) went away during the run; what its tasks had done is in their "
        "transcripts (subagent runs, subagent show)"
    )


def on_message(connection: Connection, message: dict[str, Any], sinks: Fanout) -> None:
    """A message of a job or a chat that is not its end: warnings, an event, a consent question, a refusal."""
    if "warnings" in message:
        print_warning_lines(list(message["warnings"]), MAX_WARNINGS)
    elif "event" in message:
        sinks(Event(**message["event"]))
    elif "ask" in message:
        with paused():  # the live status off the terminal while the person answers
            answer = typer.confirm(str(message["ask"]), default=False, err=True)
        connection.send({"answer": answer, "id": message.get("id")})
    elif "error" in message:
        raise SubagentError(str(message["error"]))
