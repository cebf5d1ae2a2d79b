"""`subagent`: the command line. A table of command groups, one module each in `commands/`, and the one
error boundary in `main()`.

Results go to stdout, progress and errors to stderr. Exit codes: 0 every task completed, 1 a task
failed, 2 bad usage or input (nothing ran), 130 interrupted (Ctrl-C). The flags are declared in
`flags.py`, what a command prints in `output.py`.

What only some commands use is imported in them: a command attached to `subagent serve` (`run`,
`parallel`, ...) loads no runner, host, tools or agent files (tests/cli/test_light_client.py).
"""

from __future__ import annotations

import asyncio
import io
import sys
from importlib import import_module
from typing import Annotated

import click
import typer
from rich.markup import escape

from ..errors import SubagentError
from .help_text import one_line_summaries, plain_flags
from .interrupts import EXIT_INTERRUPTED
from .output import err, out

# The command groups, in the order `subagent --help` lists them: each module of `commands/` adds its
# commands to its own `app`, which this one takes in whole.
COMMAND_GROUPS = (
    "run",  # run, parallel, chain, workflow, workflows
    "runs",  # runs, watch, show, resume
    "chat",
    "agents",  # agents, skills
    "mcp",
    "acp",
    "serve",
    "doctor",
    "worktrees",  # apply, worktrees (prune)
    "mcp_servers",  # mcp-servers (login)
    "plugin",  # plugin path
    "models",  # models (import)
    "cache",  # cache (clear)
)

app = typer.Typer(
    name="subagent",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Coding sub-agents on a local MLX model, in one process.",
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        from .. import __version__

        out.print(f"subagent {__version__} (mlx {version('mlx')}, mlx-lm {version('mlx-lm')})", markup=False)
        raise typer.Exit()


@app.callback()
def _everywhere(
    show_version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Coding sub-agents on a local MLX model, in one process."""
    from .config import apply_model_default, load_config

    apply_model_default(load_config())  # config.toml's `model`, below $MLX_SUBAGENTS_MODEL, for every command


for group in COMMAND_GROUPS:
    app.add_typer(import_module(f".commands.{group}", __name__).app)
one_line_summaries(app)  # docs/cli.md is made from `app`: it has them too

# typer >= 0.22 vendors click: its exceptions are not click's. Catch both families.
_EXIT = tuple({typer.Exit, click.exceptions.Exit})
_USAGE = tuple({click.ClickException, *(c for c in (getattr(typer, "TyperException", None),) if c)})
_ABORT = tuple({typer.Abort, click.exceptions.Abort, KeyboardInterrupt, asyncio.CancelledError})


def main() -> None:
    """Entry point: maps library errors to one line and an exit code, never a traceback."""
    for stream in (sys.stdout, sys.stderr):  # a lone surrogate in a model's text prints escaped, never raises
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    try:
        # Without standalone mode, typer returns the code of a `typer.Exit` instead of raising it.
        command = plain_flags(typer.main.get_command(app))
        code = command.main(prog_name="subagent", standalone_mode=False)  # its name in help and completion scripts
    except SubagentError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        sys.exit(2)
    except _EXIT as exc:
        sys.exit(exc.exit_code)
    except _USAGE as exc:
        if isinstance(reason := getattr(exc, "message", None), str):
            # typer's pydantic coercion words a refused choice as pydantic does a ValueError:
            # "Invalid value for '--sandbox': Value error, 'maybe' is not one of 'on', 'off'."
            exc.message = reason.removeprefix("Value error, ")
        show = getattr(exc, "show", None)
        show() if show else err.print(f"Error: {escape(str(exc))}")
        sys.exit(getattr(exc, "exit_code", 2))
    except _ABORT:
        err.print("[yellow]interrupted[/]")
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
