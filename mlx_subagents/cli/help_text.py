"""How the commands' help reads: each command's summary on one line, and a flag without a type.

typer keeps a docstring's line breaks in the command lists (`subagent --help` broke a summary where its
source line ended, and docs/cli.md cut each at 45 characters, mid-sentence), and it prints `<bool>` after
every flag, which takes no value. `one_line_summaries` runs on the app as it is defined (so docs/cli.md
has them too); `plain_flags` on the command `main()` runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import typer


def one_line_summaries(app: typer.Typer) -> None:
    """Give every command of `app` (its groups' too) its docstring's first paragraph, on one line, as the
    summary the command lists show; a command that names its own keeps it."""
    for info in app.registered_commands:
        doc = info.callback.__doc__ if info.callback is not None else None
        if info.short_help is None and doc:
            info.short_help = " ".join(inspect.cleandoc(doc).split("\n\n", 1)[0].split())
    for group in app.registered_groups:
        sub = group.typer_instance
        if sub is None:
            continue
        text = group.help if isinstance(group.help, str) else sub.info.help  # typer's placeholders: not given
        if not isinstance(group.short_help, str) and isinstance(text, str):
            group.short_help = " ".join(inspect.cleandoc(text).split("\n\n", 1)[0].split())
        one_line_summaries(sub)


def plain_flags(command: Any) -> Any:
    """`command` (typer's click command for the app) with no type shown after a flag, `--help` included."""
    for each in _commands(command):
        each.get_help_option(typer.core._click.Context(each))  # made now (it is cached) so that it is seen here
        for param in [*each.params, each._help_option]:
            if param is not None and getattr(param, "is_flag", False):
                param.metavar = ""
    return command


def _commands(command: Any) -> Iterator[Any]:
    yield command
    for sub in getattr(command, "commands", {}).values():
        yield from _commands(sub)
