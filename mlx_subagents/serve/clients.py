"""The clients of `subagent serve`: who is connected, in which workspace, and what their tasks are doing.

A client is one connection: an MCP session over HTTP, a `subagent mcp` relayed over the unix socket,
or an attached command (`subagent run`, `parallel`, `chain`, `workflow`, `resume`, `chat`). Each has
runners of its own over the server's shared hosts, so its consent, board, ids, sandbox and
transcripts are its own; the server sees every client's tasks through their events (`TaskTally`),
for `subagent serve --status`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from pydantic import BaseModel, Field

from ..events import DecodeData, Event, TaskEndData, UsageData
from ..mcp_server.server import AgentsServer
from ..runs.options import RunOptions
from ..runs.runner import Runner

# `openai` and `anthropic`: a tool calling the chat endpoints (`endpoints.py`), one per User-Agent.
ClientKind = Literal["http", "relay", "cli", "chat", "openai", "anthropic"]
# Why a client's foreground tasks stopped when it went away (their transcripts and results say so).
DISCONNECTED = "the client disconnected"
# The tasks a client's tally keeps, newest last: every running one, and the latest that ended.
MAX_TALLIED = 32


class TaskLine(BaseModel):
    """One task of a client, as its events told it."""

    label: str
    agent: str
    status: str
    turn: int = 0
    output_tokens: int = 0  # over the whole task, the reply decoding now included
    replied_tokens: int = Field(0, exclude=True)  # its ended replies' (`usage`); a decode adds its own count
    prefill_wait_s: float = 0.0  # its replies' time behind other sessions' prefills (`Usage.prefill_wait_seconds`)
    started: float = 0.0


class TaskTally:
    """A client's tasks by label, from its runners' events: started, turns, tokens (as they decode, as the
    live lines count them: a task's first reply is not "0 tokens" until it ends), ended."""

    def __init__(self) -> None:
        self.tasks: OrderedDict[str, TaskLine] = OrderedDict()

    def handle(self, event: Event) -> None:
        line = self.tasks.get(event.label)
        if event.kind == "task_start" or line is None:
            if event.kind not in ("task_start", "turn_start"):
                return
            line = self.tasks[event.label] = TaskLine(
                label=event.label, agent=event.agent, status="running", started=time.time()
            )
            self.tasks.move_to_end(event.label)
            self._trim()
        if event.kind == "turn_start":
            line.turn = event.turn
        elif event.kind == "decode":
            line.output_tokens = line.replied_tokens + cast(DecodeData, event.data)["tokens"]
        elif event.kind == "usage":
            usage = cast(UsageData, event.data)
            line.replied_tokens = line.output_tokens = usage["output_tokens"]
            line.prefill_wait_s = usage["prefill_wait_s"]
        elif event.kind == "task_end":
            line.status = cast(TaskEndData, event.data)["status"]

    def running(self) -> list[TaskLine]:
        return [t for t in self.tasks.values() if t.status == "running"]

    def _trim(self) -> None:
        ended = [label for label, t in self.tasks.items() if t.status != "running"]
        for label in ended[: max(0, len(self.tasks) - MAX_TALLIED)]:
            del self.tasks[label]


_ids = itertools.count(1)


@dataclass
class Client:
    """One connection and what runs for it.

    Args:
        options: the client's run options (its own flags over the server's host settings).
        name: what the client says it is (an MCP client's name, an attached command's).
    """

    kind: ClientKind
    options: RunOptions
    pid: int | None = None
    name: str = ""
    id: str = field(default_factory=lambda: f"c{next(_ids)}")
    since: float = field(default_factory=time.time)
    workspace: Path | None = None
    connected: bool = True
    agents: AgentsServer | None = None  # an MCP client's tools
    runners: list[Runner] = field(default_factory=list)
    tally: TaskTally = field(default_factory=TaskTally)
    work: asyncio.Task[Any] | None = None  # an attached command's request, while it runs
    notify: Any = None  # a relayed client's line to the relay itself (the server's stop notice)
    serving: int = 0  # a chat endpoint client's requests being answered now

    def background_alive(self) -> bool:
        """Whether tasks it started in the background still run (an MCP client's `start_agents`)."""
        tasks = self.agents.tasks if self.agents is not None else None
        return tasks is not None and bool(tasks.board.alive())

    def cancel(self, reason: str, *, background: bool = True) -> None:
        """Abort what runs for it: its foreground runs, and with `background` its started tasks too."""
        tasks = self.agents.tasks if self.agents is not None else None
        if background and tasks is not None:
            tasks.board.cancel_all(reason)
        for runner in self.runners:
            runner.cancel(background=background, reason=reason)

    def summary(self) -> dict[str, Any]:
        """Its line in `subagent serve --status --json`."""
        return {
            "id": self.id,
            "kind": self.kind,
            "name": self.name,
            "pid": self.pid,
            "workspace": str(self.workspace) if self.workspace else None,
            "since": round(self.since, 3),
            "connected": self.connected,
            "running": len(self.tally.running()) + self.serving,
        }


class Clients:
    """Every client of the server, connected or still finishing its background tasks."""

    def __init__(self) -> None:
        self.all: dict[str, Client] = {}

    def add(self, client: Client) -> Client:
        self.all[client.id] = client
        return client

    def remove(self, client: Client) -> None:
        self.all.pop(client.id, None)

    def __iter__(self) -> Any:
        return iter(list(self.all.values()))

    def tasks(self) -> list[dict[str, Any]]:
        """Every client's tasks the tallies hold, for `--status`."""
        return [{"client": c.id, **t.model_dump()} for c in self for t in c.tally.tasks.values()]
