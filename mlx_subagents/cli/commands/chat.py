"""`subagent chat`: a parent agent at the terminal (or `--once`), on the server when one runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..flags import Shared, shared_options
from ..output import err, out

app = typer.Typer()


@app.command()
@shared_options(
    isolation=None,  # a chat's tasks run in the workspace
    timeout=Annotated[
        Optional[float],
        typer.Option("--timeout", min=0.001, help="Stop a sub-agent after this many seconds (wall clock)."),
    ],
)
def chat(
    agent: Annotated[
        str, typer.Option("--agent", "-a", help="The parent agent; it delegates if its file grants `subagent`.")
    ] = "orchestrator",
    once: Annotated[
        Optional[str],
        typer.Option("--once", help="Send this one message, print the answer and exit (no terminal needed)."),
    ] = None,
    resume: Annotated[
        Optional[str],
        typer.Option("--resume", "-r", help="Continue a saved chat: a run id, a prefix of one, or `last`."),
    ] = None,
    plan: Annotated[
        bool, typer.Option("--plan", help="Plan mode: the parent and its sub-agents only look (no edit, write, bash).")
    ] = False,
    wake: Annotated[
        bool,
        typer.Option("--wake/--no-wake", help="A background sub-agent's end starts the parent's next turn (/wake)."),
    ] = True,
    *,
    shared: Shared,
) -> None:
    """Talk with a parent agent that hands jobs to sub-agents; /help inside lists the commands.

    Example: subagent chat   (or: subagent chat --once "where is auth handled, and is it tested?")
    """
    from ...runs.transcripts import load_run
    from ..attach_chat import chat_on_server
    from ..terminal import run_chat

    cwd = Path(load_run(resume).cwd) if resume is not None else None
    code = chat_on_server(
        shared, agent=agent, once=once, resume=resume, cwd=cwd, plan=plan, out=out, err=err, wake=wake
    )
    if code is None:
        make = lambda sink: shared.runner(sink, cwd=cwd, plan=plan)  # noqa: E731
        code = run_chat(make, agent=agent, once=once, resume=resume, wake=wake, out=out, err=err)
    raise typer.Exit(code)
