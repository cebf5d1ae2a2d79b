"""What an MCP server asks the person at the chat's terminal: an elicitation form, a URL to open, a
yes or no (the `Person` of `tools/mcp_requests.py`).

A form is asked field by field on the chat's own prompt line (`PromptLine`, read in a thread, so the
agents' lines still print above it): each field says what it takes and shows its default in brackets,
which Enter keeps (SEP-1034); an answer that does not fit is said in red and asked again; `/decline`
or `/cancel` at any field ends the form with that action. Then one question sends it: Enter or `y`
accepts, `n` declines, `c` cancels. A URL is shown to open, then the same question says whether it was
done. Questions wait for each other; Ctrl-C during a turn cancels the form it is filling.
"""

from __future__ import annotations

import asyncio
from typing import Any

import mcp_types as types
from rich.markup import escape

from ..tools.elicitation import AnswerError, form_fields
from .promptline import PromptLine

ACTIONS = {"": "accept", "y": "accept", "yes": "accept", "n": "decline", "no": "decline", "c": "cancel"}
STOP = {"/decline": "decline", "/cancel": "cancel"}


class TerminalPerson:
    """The person of `subagent chat`: asks on `prompt` (the chat's prompt line), prints with `show`."""

    def __init__(self, prompt: PromptLine, show: Any) -> None:
        self.prompt = prompt
        self.show = show  # ChatView.show: a line of markup where the person sees it
        self._lock = asyncio.Lock()
        self._asking: asyncio.Task[Any] | None = None

    async def elicit(self, server: str, params: types.ElicitRequestParams) -> types.ElicitResult:
        async with self._lock:
            self._asking = asyncio.current_task()
            try:
                return await self._elicit(server, params)
            except (asyncio.CancelledError, EOFError):  # Ctrl-C stopped the turn (`interrupt`), or Ctrl-D
                self.show("[yellow]  the form was cancelled[/]")
                return types.ElicitResult(action="cancel")
            finally:
                self._asking = None

    async def _elicit(self, server: str, params: types.ElicitRequestParams) -> types.ElicitResult:
        self.show(f"[bold]mcp {escape(server)} asks:[/] {escape(params.message)}")
        if isinstance(params, types.ElicitRequestURLParams):
            self.show(f"  open this address: {escape(params.url)}", soft_wrap=True)
            action = await self._action("  done there? [Y]es / [n]o, decline / [c]ancel: ")
            return types.ElicitResult(action=action)  # type: ignore[arg-type]
        content: dict[str, Any] = {}
        fields = form_fields(params.requested_schema)
        if fields:
            self.show("[dim]  Enter keeps the value in brackets; /decline or /cancel stops here[/]")
        for field in fields:
            while True:
                text = await self.ask(f"  {field.prompt()}")
                if text.strip().lower() in STOP:
                    return types.ElicitResult(action=STOP[text.strip().lower()])  # type: ignore[arg-type]
                try:
                    value = field.read(text)
                except AnswerError as exc:
                    self.show(f"[red]  {escape(str(exc))}[/]")
                    continue
                if value is not None:
                    content[field.name] = value
                break
        action = await self._action(f"  send this to {server}? [Y]es / [n]o, decline / [c]ancel: ")
        return types.ElicitResult(action=action, content=content if action == "accept" else None)  # type: ignore[arg-type]

    async def _action(self, question: str) -> str:
        while (answer := (await self.ask(question)).strip().lower()) not in ACTIONS:
            self.show("[red]  answer y, n or c[/]")
        return ACTIONS[answer]

    async def confirm(self, question: str) -> bool:
        async with self._lock:
            self.show(f"[bold]{escape(question)}[/]")
            return (await self.ask("  [y/N]: ")).strip().lower() in ("y", "yes")

    async def ask(self, question: str) -> str:
        """One line from the person after `question`, on the chat's prompt line."""
        shown, self.prompt.prompt = self.prompt.prompt, question
        try:
            return await self.prompt.read()
        finally:
            self.prompt.prompt = shown

    def interrupt(self) -> None:
        """Ctrl-C stopped the turn: dismiss the form being filled (the server gets `cancel`)."""
        if self._asking is not None:
            self._asking.cancel()


__all__ = ["TerminalPerson"]
