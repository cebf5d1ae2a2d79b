"""What the editor shows of a session's turn: its events as ACP `session/update` notifications, in order.

The agent's reply streams as message chunks and its reasoning as thought chunks, each reply's chunks
under one message id (a new reply, after its tool calls, is a new message); each tool call is a
tool call of the editor's (its kind, its title, the files it touches with their line, `in_progress`,
then `completed` or `failed` with its output, an edit's diff); a `subagent` call's tasks are the plan,
each entry's status following its sub-agent; a sub-agent's own tool calls are tool calls too, titled
with its id (`scout#1: read app.py`), their `_meta` naming the call that started it, and a line of
each goes into that call's content, so the sub-agents' work shows under it; each reply's usage is a
`usage_update` (the context used and its size); a background call's notice and a sub-agent's message
to the agent (`parent_send`) are thought chunks, as the agent reads them.

Events arrive synchronously from the runner; `Updates` queues what they become and one task sends it,
so the notifications keep the events' order, and a request about a call (a permission) waits for
`flush()`, which lets the call's own update go first.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import acp
from acp.schema import (
    AgentPlanUpdate,
    ContentToolCallContent,
    FileEditToolCallContent,
    PlanEntry,
    TerminalToolCallContent,
    TextContentBlock,
    ToolCallLocation,
    ToolCallProgress,
    ToolCallStart,
    UsageUpdate,
)

from ..events import (
    ChildMessageData,
    CompactionData,
    Event,
    HookWarningData,
    ReasoningData,
    TaskEndData,
    TaskNoticeData,
    TaskStartData,
    TextData,
    ToolCallData,
    ToolResultData,
    UsageData,
)
from ..text import one_line
from ..tools.editor import CallRef, FileChange

log = logging.getLogger("mlx_subagents.acp")

KINDS: dict[str, acp.schema.ToolKind] = {
    "read": "read",
    "skill": "read",
    "grep": "search",
    "find": "search",
    "ls": "search",
    "edit": "edit",
    "write": "edit",
    "bash": "execute",
}
DELEGATION = ("subagent",)
# Lines of the sub-agents' work kept in the content of the call that started them (the newest).
MAX_WORK_LINES = 40

Update = Any  # one of the SDK's session updates


def tool_kind(name: str) -> acp.schema.ToolKind:
    """The editor's kind of a tool (its icon): read, search, edit, execute; `other` for the rest."""
    return KINDS.get(name, "other")


def locations(name: str, arguments: dict[str, Any], root: Path) -> list[ToolCallLocation] | None:
    """The file (and line) a call touches, as an absolute path, for the editor to follow."""
    path = arguments.get("path")
    if name not in KINDS or not isinstance(path, str) or not path:
        return None
    line = arguments.get("offset") if name == "read" and isinstance(arguments.get("offset"), int) else None
    return [ToolCallLocation(path=str(root / path), line=line)]


def diff_content(change: FileChange) -> FileEditToolCallContent:
    return FileEditToolCallContent(
        type="diff", path=str(change.path), old_text=change.old_text, new_text=change.new_text
    )


def text_content(text: str) -> ContentToolCallContent:
    return ContentToolCallContent(type="content", content=TextContentBlock(type="text", text=text))


def terminal_content(terminal_id: str) -> TerminalToolCallContent:
    return TerminalToolCallContent(type="terminal", terminal_id=terminal_id)


@dataclass
class OpenCall:
    """A tool call the editor was told of and that has not returned."""

    acp_id: str
    name: str
    parent: str | None  # the call that started its session (a sub-agent's), its ACP id
    diff: FileEditToolCallContent | None = None
    terminal: str | None = None
    work: list[str] = field(default_factory=list)  # a delegating call's lines of its sub-agents' work


@dataclass
class Entry:
    """One entry of the plan: a delegated task, and the sub-agent that runs it once it started."""

    agent: str
    task: str
    status: acp.schema.PlanEntryStatus = "pending"
    label: str = ""


class Updates:
    """The session updates of one ACP session, sent in order by one task.

    Args:
        send: sends one update to the client (`conn.session_update` for this session).
        label: the label of the session's agent (its events are the agent's own; below it, sub-agents').
        root: the workspace, for the absolute paths of locations.
        window: the model's context window, for `usage_update`.
        ids: the numbers of the session's tool calls (kept when its chat is made again: a new mode).
    """

    def __init__(self, send: Any, label: str, root: Path, window: int, ids: Iterator[int] | None = None) -> None:
        self.send = send
        self.label = label
        self.root = root
        self.window = window
        self.calls: dict[tuple[str, int, str], OpenCall] = {}
        self.plan: list[Entry] = []
        self.messages: dict[str, str] = {}  # the message id of the reply being generated, by kind of chunk
        self.ids = ids or itertools.count(1)  # the session's: a call's id is never given twice in it
        self._queue: asyncio.Queue[Update] = asyncio.Queue()
        self._sender: asyncio.Task[None] | None = None

    # -- sending, in order --------------------------------------------------------------------------

    def put(self, update: Update) -> None:
        if self._sender is None or self._sender.done():
            self._sender = asyncio.ensure_future(self._send_all())
        self._queue.put_nowait(update)

    async def _send_all(self) -> None:
        while True:
            update = await self._queue.get()
            try:
                await self.send(update)
            except Exception as exc:  # a client gone: the turn goes on (and is saved) without it
                log.warning("a session update was not sent: %s", exc)
            finally:
                self._queue.task_done()

    async def flush(self) -> None:
        """Wait until every update queued so far is sent."""
        await self._queue.join()

    async def close(self) -> None:
        await self.flush()
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender

    # -- the events ---------------------------------------------------------------------------------

    def __call__(self, event: Event) -> None:
        """Turn one event of the runner into what the editor shows (nothing for the rest)."""
        own = event.label == self.label
        if own and event.kind == "text":
            self.put(self._chunk(acp.update_agent_message_text(cast(TextData, event.data)["text"])))
        elif own and event.kind == "reasoning":
            self.put(self._chunk(acp.update_agent_thought_text(cast(ReasoningData, event.data)["text"])))
        elif own and event.kind == "usage":  # a reply's end: its next chunks are the next message's
            self.messages.clear()
            used = cast(UsageData, event.data)["context_tokens"]
            self.put(UsageUpdate(session_update="usage_update", used=used, size=max(self.window, used)))
        elif event.kind == "tool_call":
            self._call(event, cast(ToolCallData, event.data))
        elif event.kind == "tool_result":
            self._result(event, cast(ToolResultData, event.data))
        elif event.kind in ("task_start", "task_end") and not own:
            self._sub_agent(event)
        elif own and event.kind == "hook_warning":
            self.put(
                self._chunk(acp.update_agent_thought_text(f"\n[hook] {cast(HookWarningData, event.data)['message']}\n"))
            )
        elif own and event.kind == "task_notice":  # a background call ended: its answers, as the agent reads them
            self.put(
                self._chunk(acp.update_agent_thought_text(f"\n[notice] {cast(TaskNoticeData, event.data)['text']}\n"))
            )
        elif own and event.kind == "child_message":  # a sub-agent said something while it works
            said = cast(ChildMessageData, event.data)
            self.put(self._chunk(acp.update_agent_thought_text(f"\n[message from {said['id']}] {said['message']}\n")))
        elif own and event.kind == "compaction":
            data = cast(CompactionData, event.data)
            line = f"\n[context compacted: {data['tokens_before']:,} -> {data['tokens_after']:,} tokens]\n"
            self.put(self._chunk(acp.update_agent_thought_text(line)))

    def _chunk(self, chunk: Any) -> Any:
        """A chunk of the reply being generated, with the message id its kind has in that reply."""
        chunk.message_id = self.messages.setdefault(chunk.session_update, str(uuid.uuid4()))
        return chunk

    def say(self, text: str) -> None:
        """A message of its own from the agent (a failed turn's error line), after the turn's replies."""
        self.messages.clear()
        self.put(self._chunk(acp.update_agent_message_text(text)))
        self.messages.clear()

    def _call(self, event: Event, data: ToolCallData) -> None:
        acp_id = f"{next(self.ids)}:{event.label}:{data.get('id', '')}"
        parent = self._starter(event.label)
        call = OpenCall(acp_id, data["name"], parent.acp_id if parent else None)
        self.calls[(event.label, event.turn, data.get("id", ""))] = call
        title = data["description"] if parent is None else f"{child_id(event.label)}: {data['description']}"
        meta = {"mlx_subagents": {"label": event.label, "parentToolCallId": parent.acp_id}} if parent else None
        self.put(
            ToolCallStart(
                session_update="tool_call",
                tool_call_id=acp_id,
                title=title,
                kind=tool_kind(data["name"]),
                status="in_progress",
                locations=locations(data["name"], data["arguments"], self.root),
                raw_input=data["arguments"],
                field_meta=meta,
            )
        )
        if parent is not None:
            self._work(parent, f"{child_id(event.label)}: {data['description']}")
        if event.label == self.label and data["name"] in DELEGATION:
            self._planned(data["arguments"])

    def _result(self, event: Event, data: ToolResultData) -> None:
        call = self.calls.pop((event.label, event.turn, data.get("id", "")), None)
        if call is None:  # a call that could not be parsed: shown failed, on its own
            call = OpenCall(f"{next(self.ids)}:{event.label}:?", data["name"], None)
            self.put(acp.start_tool_call(call.acp_id, "a malformed tool call", kind="other", status="failed"))
        content: list[Any] = [c for c in (call.diff,) if c is not None]
        if call.terminal is not None:
            content.append(terminal_content(call.terminal))
        if call.work:
            content.append(text_content("\n".join(call.work)))
        if data["output"]:
            content.append(text_content(data["output"]))
        status: acp.schema.ToolCallStatus = "failed" if data["is_error"] else "completed"
        self.put(
            ToolCallProgress(
                session_update="tool_call_update",
                tool_call_id=call.acp_id,
                status=status,
                content=content,
                raw_output={"output": data["output"], "is_error": data["is_error"]},
            )
        )

    def _sub_agent(self, event: Event) -> None:
        """A sub-agent starts or ends: its plan entry's status, and a line under the call that started it."""
        parent = self._starter(event.label)
        if event.kind == "task_start":
            task = cast(TaskStartData, event.data)["task"]
            entry = next((e for e in self.plan if e.status == "pending" and e.agent == event.agent), None)
            if entry is not None:
                entry.status, entry.label = "in_progress", event.label
                self._send_plan()
            line = f"{child_id(event.label)} started: {one_line(task, 120)}"
        else:
            end = cast(TaskEndData, event.data)
            for entry in self.plan:
                if entry.label == event.label and entry.status == "in_progress":
                    entry.status = "completed"
                    self._send_plan()
            line = f"{child_id(event.label)} {end['status']}" + (
                f": {one_line(end['error'], 120)}" if end["error"] else ""
            )
        if parent is not None:
            self._work(parent, line)

    # -- what ties them together --------------------------------------------------------------------

    def _starter(self, label: str) -> OpenCall | None:
        """The open delegating call of the session that started `label`'s session (None: the agent's own)."""
        if label == self.label or " > " not in label:
            return None
        above = label.rsplit(" > ", 1)[0]
        open_calls = [c for (lab, _, _), c in self.calls.items() if lab == above and c.name in DELEGATION]
        return open_calls[-1] if open_calls else None

    def _work(self, call: OpenCall, line: str) -> None:
        call.work = [*call.work, line][-MAX_WORK_LINES:]
        update = ToolCallProgress(
            session_update="tool_call_update", tool_call_id=call.acp_id, content=[text_content("\n".join(call.work))]
        )
        self.put(update)

    def _planned(self, arguments: dict[str, Any]) -> None:
        """A delegating call's tasks join the plan, pending until their sub-agents start."""
        items = arguments.get("tasks") or arguments.get("chain") or arguments.get("steps") or [arguments]
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict) and isinstance(item.get("agent"), str) and isinstance(item.get("task"), str):
                self.plan.append(Entry(item["agent"].strip().lower(), item["task"]))
        self._send_plan()

    def _send_plan(self) -> None:
        entries = [
            PlanEntry(content=f"{e.agent}: {one_line(e.task, 200)}", priority="medium", status=e.status)
            for e in self.plan
        ]
        if entries:
            self.put(AgentPlanUpdate(session_update="plan", entries=entries))

    # -- what the editor's side adds to a call ------------------------------------------------------

    def call_of(self, ref: CallRef | None) -> OpenCall | None:
        """The open call a tool runs for (`tools/editor.py`'s `current_call`)."""
        return self.calls.get((ref.label, ref.turn, ref.id)) if ref is not None else None

    def show_diff(self, call: OpenCall, change: FileChange) -> None:
        """An edit's diff on its call (the editor shows it; the call's end shows it again with the output)."""
        call.diff = diff_content(change)
        self.put(ToolCallProgress(session_update="tool_call_update", tool_call_id=call.acp_id, content=[call.diff]))

    def show_terminal(self, call: OpenCall, terminal_id: str) -> None:
        """The editor's terminal a command runs in, embedded in its call as it runs."""
        call.terminal = terminal_id
        content = [terminal_content(terminal_id)]
        self.put(ToolCallProgress(session_update="tool_call_update", tool_call_id=call.acp_id, content=content))


def child_id(label: str) -> str:
    """A sub-agent's id on its parent's board, from its label (`orchestrator > scout#1`: `scout#1`)."""
    return label.rsplit(" > ", 1)[-1]
