"""An attached editor's chat (`subagent acp` on the server): the tools' `Editor` over its connection.

The chat runs here; its tools' requests of the editor (`tools/editor.py`: approve a change, read or
write a file, run a command in its terminal) and the MCP servers' questions for the person
(`tools/mcp_requests.py`'s `Person`: a form, a yes or no) go to the client as lines, each naming the call it is
for (label, turn, id: the same as in the events the client shows), and wait for the client's answer,
which its editor gave. A client gone answers every request still open with an error, so a call ends
instead of waiting.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ToolError
from ..tools.editor import Approval, CommandOutput, current_call
from .protocol import EditorOffer
from .wire import send

if TYPE_CHECKING:
    import mcp_types

GONE = "the editor went away; the request was not answered"


class RemoteEditor:
    """The client's editor, for the tools of its chat's runner."""

    def __init__(self, writer: asyncio.StreamWriter, offer: EditorOffer) -> None:
        self.writer = writer
        self.offer = offer
        self._ids = itertools.count(1)
        self._open: dict[int, asyncio.Future[dict[str, Any]]] = {}

    @property
    def reads_files(self) -> bool:
        return self.offer.reads_files

    @property
    def writes_files(self) -> bool:
        return self.offer.writes_files

    @property
    def runs_commands(self) -> bool:
        return self.offer.runs_commands

    async def approve(self, approval: Approval) -> bool:
        change = approval.change
        fields: dict[str, Any] = {"tool": approval.tool, "title": approval.title, "command": approval.command}
        if change is not None:
            fields["change"] = {"path": str(change.path), "old_text": change.old_text, "new_text": change.new_text}
        return bool(await self._request("approve", **fields))

    async def read_text(self, path: Path) -> str:
        return str(await self._request("read", path=str(path)))

    async def write_text(self, path: Path, content: str) -> None:
        await self._request("write", path=str(path), content=content)

    async def run_command(self, args: Sequence[str], cwd: Path, timeout: float, max_bytes: int) -> CommandOutput:
        ran = await self._request("run", args=list(args), cwd=str(cwd), timeout=timeout, max_bytes=max_bytes)
        return CommandOutput(str(ran["output"]), ran["exit_code"], bool(ran.get("truncated")))

    async def elicit(self, server: str, params: mcp_types.ElicitRequestParams) -> mcp_types.ElicitResult:
        """An MCP server's form, filled in the client's editor (declined there when it shows no forms)."""
        import mcp_types

        dumped = params.model_dump(by_alias=True, mode="json", exclude_none=True)
        try:
            answer = await self._request("elicit", server=server, params=dumped)
        except ToolError as exc:
            return mcp_types.ElicitResult(action="decline", _meta={"reason": str(exc)})
        return mcp_types.ElicitResult.model_validate(answer)

    async def confirm(self, question: str) -> bool:
        """An MCP server's yes or no (its sampling, a sign-in), asked in the client's editor."""
        try:
            return bool(await self._request("confirm", question=question))
        except ToolError:
            return False

    async def _request(self, op: str, **fields: Any) -> Any:
        if self.writer.is_closing():
            raise ToolError(GONE)
        ref = current_call.get()
        n = next(self._ids)
        self._open[n] = answer = asyncio.get_running_loop().create_future()
        call = [ref.label, ref.turn, ref.id] if ref is not None else None
        send(self.writer, {"editor": op, "id": n, "call": call, **fields})
        try:
            done = await answer
        finally:
            self._open.pop(n, None)
        if "error" in done:
            if done.get("missing"):
                raise FileNotFoundError(str(done["error"]))
            raise ToolError(str(done["error"]))
        return done.get("value")

    def answered(self, message: dict[str, Any]) -> None:
        answer = self._open.get(message.get("edited"))  # type: ignore[arg-type]
        if answer is not None and not answer.done():
            answer.set_result(message)

    def gone(self) -> None:
        for answer in self._open.values():
            if not answer.done():
                answer.set_result({"error": GONE})
