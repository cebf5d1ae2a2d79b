"""A task's agent session, made once for its handle (`TaskHandle`): its first messages, its tools (its
MCP servers', its board's) and who answers its servers' questions; and its conversation closed after
an abort, every tool call answered.

What the session needs of the runner is `SessionRuntime`; the handle's `TaskRuntime` extends it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from ..agents.compaction import CompactionSettings
from ..agents.inbox import Inbox
from ..agents.prompt import system_prompt
from ..agents.session import AgentSession
from ..host.protocol import Message, ModelHost, TextCallback
from ..tools import Tool, Workspace
from ..tools.delegation import ForkPoint
from ..tools.editor import Editor
from ..tools.mcp_requests import Person
from ..tools.parent_send import Send
from .board import TaskBoard
from .hosts import SessionNames
from .prepared import Parent, PreparedTask

INTERRUPTED_TOOL_RESULT = "Error: this tool call was interrupted before it finished."


class SessionRuntime(Protocol):
    """What a task's session needs of the runner that made its handle: compaction, host session names,
    the tools it gives a task on its board, and who answers its MCP servers' questions."""

    compaction: CompactionSettings
    session_names: SessionNames
    person: Person | None
    no_person: str
    editor: Editor | None

    def resident_hosts(self) -> list[ModelHost]: ...

    def board_tools(
        self,
        parent: Parent,
        workspace: Workspace,
        board: TaskBoard | None = None,
        *,
        forked: bool = False,
        speak_up: Send | None = None,
    ) -> dict[str, Tool]: ...


def make_session(
    runtime: SessionRuntime,
    prepared: PreparedTask,
    parent: Parent,
    board: TaskBoard,
    inbox: Inbox,
    messages: Sequence[Message] | None,
    *,
    session_name: str,
    fork_from: ForkPoint | None,
    on_text: TextCallback | None,
    to_parent: Callable[[str], str],
    person: Person | None,
    no_person: str,
) -> AgentSession:
    """A session holding `messages` (a new task's: its system prompt), with the tools of a task on
    `board` whose children have `parent` (the task, saved in its run's folder).

    Args:
        session_name: the host session name it asks for (claimed now, given back when it is let go).
        fork_from: a fork's start: its parent's host session and messages.
        to_parent: its message to its parent (`parent_send`).
        person, no_person: who answers its MCP servers' questions, or why nobody does.
    """
    spec = prepared.spec
    if messages is None:
        prompt = system_prompt(spec, prepared.context, prepared.skills, prepared.host.context_window)
        messages = [{"role": "system", "content": prompt}]
    return AgentSession(
        spec=spec,
        host=prepared.host,
        workspace=prepared.workspace,
        label=prepared.label,
        limits=prepared.limits,
        compaction=runtime.compaction,
        on_text=on_text,
        extra_tools={
            **prepared.mcp_tools,
            **runtime.board_tools(parent, prepared.workspace, board, forked=fork_from is not None, speak_up=to_parent),
        },
        denied=prepared.denied,
        project_context=prepared.context,
        skills=prepared.skills,
        messages=list(messages),
        inbox=inbox,
        session_name=runtime.session_names.claim(session_name),
        sandbox=prepared.sandbox,
        fork_of=fork_from.session if fork_from is not None else "",
        person=person,
        no_person=no_person,
        resident_hosts=runtime.resident_hosts,
        editor=runtime.editor,
    )


def close_open_tool_calls(messages: list[Message]) -> list[Message]:
    """Add an error result for each tool call at the end that never got one (an aborted task).

    Chat templates expect every tool call to be answered before the next user message.
    """
    messages = list(messages)
    last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "assistant"), None)
    if last is None or not messages[last].get("tool_calls"):
        return messages
    answered = {m.get("tool_call_id") for m in messages[last + 1 :] if m.get("role") == "tool"}
    for call in messages[last]["tool_calls"]:
        if call.get("id") not in answered:
            name = call.get("function", {}).get("name", "")
            messages.append(
                {"role": "tool", "tool_call_id": call.get("id"), "name": name, "content": INTERRUPTED_TOOL_RESULT}
            )
    return messages
