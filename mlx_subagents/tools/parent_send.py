"""`parent_send`: a child's message to the agent that started it, while it works.

The other way of `task_send`: a sub-agent tells its parent something it needs now (a finding, a
question, how far it got) instead of keeping it all for its final answer. The parent reads it at its
next turn (`[message from scout#1] ...`), its views and `--events` show it, and it may answer with
`task_send`, which the child reads before its next step. The runner offers it to every child that has
tools (never to a task a person started, nor a single-shot one) and binds where it goes (`send`: the
parent's board, `TaskBoard.message`), so this module never reaches up a layer. Messages are bounded:
each at most `MAX_CHILD_MESSAGE_CHARS`, and at most `MAX_CHILD_MESSAGES` of one child's wait unread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..caps import MAX_CHILD_MESSAGE_CHARS
from ..errors import SubagentError
from ..text import one_line
from .base import Tool, ToolResult, error_result
from .workspace import Workspace

# Sends a child's message to its parent; what happens, in words. Raises `SubagentError` when it cannot.
Send = Callable[[str], str]


class ParentSendParams(BaseModel):  # no docstring: pydantic would put it in the schema the model reads
    model_config = ConfigDict(extra="forbid")

    message: str = Field(description="What your parent should know now.")


class ParentSendTool(Tool):
    name = "parent_send"
    description = (
        "Tell the agent that started you something it needs now (a finding, a question); it may answer with a "
        "message you read before your next step. Your final answer still goes to it as usual."
    )
    Params = ParentSendParams
    read_only = True
    writes = False
    by_delegation = True

    def __init__(self, workspace: Workspace, send: Send | None = None) -> None:
        super().__init__(workspace)
        self.send = send

    async def run(self, params: ParentSendParams) -> ToolResult:
        text = params.message.strip()
        if not text:
            return error_result("the message is empty; say what your parent should know")
        if len(text) > MAX_CHILD_MESSAGE_CHARS:
            return error_result(
                f"the message is {len(text):,} characters, over the limit of {MAX_CHILD_MESSAGE_CHARS:,} for a "
                "message to your parent; shorten it, and keep the details for your final answer"
            )
        if self.send is None:
            return error_result("nobody reads your messages here; put what you found in your final answer")
        try:
            return ToolResult(self.send(text))
        except SubagentError as exc:  # too many unread: the child carries on
            return error_result(str(exc))

    def describe(self, arguments: dict[str, Any]) -> str:
        return f"{self.name}: {one_line(str(arguments.get('message', '')), 80)}"
