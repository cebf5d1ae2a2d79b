"""The command groups of `subagent`, one module each; `cli/__init__.py` lists them in order.

A group named for what it lists (`models`, `worktrees`, `mcp-servers`, `cache`) lists it when no
subcommand follows its name: `listing` registers that command as the group's callback.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import typer


def listing(group: typer.Typer) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Makes the decorated command what `group` runs when no subcommand is named (`subagent cache`
    lists, `subagent cache clear` does not), with the command's own options."""

    def register(command: Callable[..., None]) -> Callable[..., None]:
        own = list(inspect.signature(command, eval_str=True).parameters.values())

        @functools.wraps(command)
        def callback(ctx: typer.Context, **kwargs: Any) -> None:
            if ctx.invoked_subcommand is None:
                command(**kwargs)

        context = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
        params = [context, *(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own)]
        callback.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        callback.__annotations__ = {p.name: p.annotation for p in params}
        group.callback(invoke_without_command=True)(callback)
        return command

    return register
