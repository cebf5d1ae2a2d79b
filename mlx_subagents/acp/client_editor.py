"""The editor as the tools see it (`tools/editor.py`'s `Editor`), over the ACP client of one session.

What the client offered at `initialize` is what is used: its `fs/read_text_file` and
`fs/write_text_file` for the workspace's files (so an unsaved buffer is what the agent reads and
changes), its `terminal/*` for `bash` (the terminal embedded in the call, killed at the time-out or
a cancel, released after). Every change a tool makes is first asked through
`session/request_permission` (allow once, allow always for this session, reject), its diff or command
shown; "always" is remembered per tool for the session. The same request asks the consent questions
of the preparer (a project agent, the project's hooks and MCP servers, the client's own MCP servers)
and of the MCP servers the agents call (`confirm`). An MCP server's form goes to the editor as an ACP
form (`elicitation/create`, stable since 2026-07, on the call that asked) where the client offers
forms; else, and for a URL to open, it is declined with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import acp
from acp.schema import (
    AcceptElicitationResponse,
    AllowedOutcome,
    ClientCapabilities,
    ElicitationFormSessionMode,
    ElicitationSchema,
    PermissionOption,
    ToolCallUpdate,
)
from pydantic import ValidationError

from ..deadlines import within
from ..errors import ToolError
from ..text import one_line
from ..tools.editor import Approval, CommandOutput, current_call
from .updates import Updates, diff_content, text_content, tool_kind

if TYPE_CHECKING:
    import mcp_types

ALLOW_ONCE, ALLOW_ALWAYS, REJECT = "allow_once", "allow_always", "reject_once"
OPTIONS = [
    PermissionOption(option_id=ALLOW_ONCE, name="Allow once", kind="allow_once"),
    PermissionOption(option_id=ALLOW_ALWAYS, name="Always allow in this session", kind="allow_always"),
    PermissionOption(option_id=REJECT, name="Reject", kind="reject_once"),
]
CONSENT_OPTIONS = [OPTIONS[0], OPTIONS[2]]
NO_FORMS = "the editor offers no forms (elicitation.form at initialize); the form was declined"
NO_URLS = "the editor is not asked to open addresses here; the request was declined"
# JSON-RPC's "resource not found": what a client answers `fs/read_text_file` of a file it does not have.
NOT_FOUND = -32002


class ClientEditor:
    """One ACP session's editor: the client's files, terminal and permission requests.

    Args:
        conn: the connection to the client.
        session_id: the ACP session whose questions these are.
        capabilities: what the client offered at `initialize`.
        updates: the session's updates (a question waits for the call's own update to go first).
    """

    def __init__(self, conn: Any, session_id: str, capabilities: ClientCapabilities, updates: Updates) -> None:
        self.conn = conn
        self.session_id = session_id
        self.capabilities = capabilities
        self.updates = updates
        self.always: set[str] = set()  # the tools the person allowed always, for this session

    @property
    def reads_files(self) -> bool:
        return bool(self.capabilities.fs and self.capabilities.fs.read_text_file)

    @property
    def writes_files(self) -> bool:
        return bool(self.capabilities.fs and self.capabilities.fs.write_text_file)

    @property
    def runs_commands(self) -> bool:
        return bool(self.capabilities.terminal)

    # -- the person's answers -----------------------------------------------------------------------

    async def approve(self, approval: Approval) -> bool:
        """Ask the person about a change (its diff or command on its call); an "always" is kept."""
        call = self.updates.call_of(current_call.get())
        if call is not None and approval.change is not None:
            self.updates.show_diff(call, approval.change)
        if approval.tool in self.always:
            return True
        content: list[Any] = []
        if approval.change is not None:
            content.append(diff_content(approval.change))
        elif approval.command is not None:
            content.append(text_content(f"$ {approval.command}"))
        asked = ToolCallUpdate(
            tool_call_id=call.acp_id if call is not None else f"approval-{next(self.updates.ids)}",
            title=approval.title,
            kind=tool_kind(approval.tool),
            status="pending",
            content=content,
        )
        answer = await self._ask(asked, OPTIONS)
        if answer == ALLOW_ALWAYS:
            self.always.add(approval.tool)
        return answer in (ALLOW_ONCE, ALLOW_ALWAYS)

    async def ask(self, question: str) -> bool:
        """A consent question of the preparer (a project agent, hooks, MCP servers), as a yes or no."""
        asked = ToolCallUpdate(
            tool_call_id=f"consent-{next(self.updates.ids)}",
            title=one_line(question, 200),
            kind="other",
            status="pending",
            content=[text_content(question)],
        )
        return await self._ask(asked, CONSENT_OPTIONS) == ALLOW_ONCE

    async def confirm(self, question: str) -> bool:
        """`Person.confirm`: an MCP server's yes or no (its sampling, a sign-in)."""
        return await self.ask(question)

    @property
    def fills_forms(self) -> bool:
        return bool(self.capabilities.elicitation and self.capabilities.elicitation.form is not None)

    async def elicit(self, server: str, params: mcp_types.ElicitRequestParams) -> mcp_types.ElicitResult:
        """`Person.elicit`: an MCP server's form filled in the editor, on the call that asked; declined
        with the reason where the editor offers no forms, for a URL, or when the form could not be shown."""
        import mcp_types

        def declined(reason: str) -> mcp_types.ElicitResult:
            return mcp_types.ElicitResult(action="decline", _meta={"reason": reason})

        if not isinstance(params, mcp_types.ElicitRequestFormParams):
            return declined(NO_URLS)
        if not self.fills_forms:
            return declined(NO_FORMS)
        call = self.updates.call_of(current_call.get())
        await self.updates.flush()
        try:
            mode = ElicitationFormSessionMode(
                session_id=self.session_id,
                tool_call_id=call.acp_id if call is not None else None,
                requested_schema=ElicitationSchema.model_validate(params.requested_schema),
            )
            answer = await self.conn.create_elicitation(message=f"{server}: {params.message}", mode=mode)
        except (acp.RequestError, ConnectionError, ValidationError) as exc:
            return declined(f"the editor could not show the form: {one_line(str(exc), 200)}")
        if isinstance(answer, AcceptElicitationResponse):
            return mcp_types.ElicitResult(action="accept", content=answer.content or {})
        return mcp_types.ElicitResult(action=answer.action)

    async def _ask(self, tool_call: ToolCallUpdate, options: list[PermissionOption]) -> str | None:
        """The option the person chose; None when the client cancelled the question or went away."""
        await self.updates.flush()
        try:
            response = await self.conn.request_permission(
                session_id=self.session_id, tool_call=tool_call, options=options
            )
        except (acp.RequestError, ConnectionError):
            return None
        outcome = response.outcome
        return outcome.option_id if isinstance(outcome, AllowedOutcome) else None

    # -- the client's files -------------------------------------------------------------------------

    async def read_text(self, path: Path) -> str:
        await self.updates.flush()  # the call's own update first
        try:
            response = await self.conn.read_text_file(session_id=self.session_id, path=str(path))
        except acp.RequestError as exc:
            if exc.code == NOT_FOUND:
                raise FileNotFoundError(str(path)) from None
            raise ToolError(f"the editor could not read {path}: {exc}; try again or read another file") from None
        except ConnectionError:
            raise ToolError("the editor went away; the file was not read") from None
        return response.content

    async def write_text(self, path: Path, content: str) -> None:
        await self.updates.flush()
        try:
            await self.conn.write_text_file(session_id=self.session_id, path=str(path), content=content)
        except acp.RequestError as exc:
            raise ToolError(f"the editor could not write {path}: {exc}; nothing was written") from None
        except ConnectionError:
            raise ToolError("the editor went away; nothing was written") from None

    # -- the client's terminal ----------------------------------------------------------------------

    async def run_command(self, args: Sequence[str], cwd: Path, timeout: float, max_bytes: int) -> CommandOutput:
        """Run `args` in a terminal of the editor's, shown on the call; killed at `timeout` or a cancel."""
        await self.updates.flush()
        try:
            made = await self.conn.create_terminal(
                session_id=self.session_id,
                command=args[0],
                args=list(args[1:]),
                cwd=str(cwd),
                output_byte_limit=max_bytes,
            )
        except (acp.RequestError, ConnectionError) as exc:
            raise ToolError(f"the editor could not start a terminal: {exc}; the command did not run") from None
        terminal = made.terminal_id
        call = self.updates.call_of(current_call.get())
        if call is not None:
            self.updates.show_terminal(call, terminal)
        where = {"session_id": self.session_id, "terminal_id": terminal}
        try:
            try:
                exited = await within(self.conn.wait_for_terminal_exit(**where), timeout)
                code = exited.exit_code if exited.exit_code is not None else (-1 if exited.signal else 0)
            except asyncio.TimeoutError:
                await self.conn.kill_terminal(**where)
                code = None
            output = await self.conn.terminal_output(**where)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.conn.kill_terminal(**where))
            raise
        except (acp.RequestError, ConnectionError) as exc:
            raise ToolError(f"the editor's terminal failed: {exc}; the command's end is unknown") from None
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.conn.release_terminal(**where))
        return CommandOutput(output.output, code, output.truncated)


__all__ = ["ClientEditor"]
