"""An editor for the tests: the ACP SDK's own client side, driving `subagent acp` over stdio.

`EditorClient` records every session update in order, answers permission requests with a chosen
option, serves `fs/*` from an in-memory set of open buffers (falling back to the disk) and runs
`terminal/*` commands as real processes, as an editor does.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import acp
from acp.schema import (
    AcceptElicitationResponse,
    AllowedOutcome,
    ClientCapabilities,
    CreateTerminalResponse,
    DeniedOutcome,
    ElicitationCapabilities,
    ElicitationFormCapabilities,
    FileSystemCapabilities,
    KillTerminalResponse,
    ReadTextFileResponse,
    ReleaseTerminalResponse,
    RequestPermissionResponse,
    TerminalOutputResponse,
    WaitForTerminalExitResponse,
    WriteTextFileResponse,
)

from tests.helpers import REPO

SHUTDOWN = {"shutdown_timeout": 20.0}
# What `subagent acp` imports, for the preloaded process `editor` forks the agent from (about 2 s of CPU an
# agent otherwise): `preloaded_agent` in conftest.py holds one for each test file here.
PRELOAD = [
    "mlx_subagents.cli", "mlx_subagents.cli.commands.acp", "mlx_subagents.cli.attach", "mlx_subagents.acp.stdio",
    "mlx_subagents.acp.agent", "mlx_subagents.acp.session", "mlx_subagents.runs.runner",
    "mlx_subagents.runs.execution", "mlx_subagents.runs.prepare", "mlx_subagents.host.scripted",
    "mlx_subagents.tools.mcp", "acp",
]  # fmt: skip
# What stands for `python` when `editor` starts `subagent acp` (a preloaded process's command while
# `preloaded_agent` holds one).
AGENT_PYTHON = [sys.executable]


def agent_env() -> dict[str, str]:
    names = ("HOME", "MLX_SUBAGENTS_HOME", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PATH")
    return {**{n: os.environ[n] for n in names if n in os.environ}, "PYTHONPATH": str(REPO)}


@dataclass
class EditorClient:
    """The client: what it offers, how it answers, and what it saw."""

    answer: str | None = "allow_once"  # the permission option chosen; None: the question is cancelled
    buffers: dict[str, str] = field(default_factory=dict)  # open buffers by absolute path (unsaved text)
    fs: bool = False
    terminal: bool = False
    form: dict[str, Any] | None = None  # what the person fills in the forms (None: the client offers none)
    updates: list[Any] = field(default_factory=list)
    questions: list[Any] = field(default_factory=list)
    calls: list[tuple[str, Any]] = field(default_factory=list)  # fs and terminal requests, in order
    seen: asyncio.Event = field(default_factory=asyncio.Event)
    _terminals: dict[str, Any] = field(default_factory=dict)
    _ids: Any = field(default_factory=lambda: itertools.count(1))

    def capabilities(self) -> ClientCapabilities:
        fs = FileSystemCapabilities(read_text_file=self.fs, write_text_file=self.fs)
        forms = ElicitationCapabilities(form=ElicitationFormCapabilities()) if self.form is not None else None
        return ClientCapabilities(fs=fs, terminal=self.terminal, elicitation=forms)

    async def create_elicitation(self, message: str, mode: Any, **_: Any) -> Any:
        self.calls.append(("form", (message, mode)))
        return AcceptElicitationResponse(action="accept", content=self.form)

    def on_connect(self, conn: Any) -> None:
        pass

    async def session_update(self, session_id: str, update: Any, **_: Any) -> None:
        self.updates.append(update)
        self.seen.set()

    async def request_permission(self, session_id: str, tool_call: Any, options: Any, **_: Any) -> Any:
        self.questions.append((tool_call, [o.option_id for o in options]))
        if self.answer is None:
            return RequestPermissionResponse(outcome=DeniedOutcome(outcome="cancelled"))
        return RequestPermissionResponse(outcome=AllowedOutcome(outcome="selected", option_id=self.answer))

    async def read_text_file(self, session_id: str, path: str, **_: Any) -> Any:
        self.calls.append(("read", path))
        if path in self.buffers:
            return ReadTextFileResponse(content=self.buffers[path])
        if not Path(path).is_file():
            raise acp.RequestError(-32002, f"Resource not found: {path}")
        return ReadTextFileResponse(content=Path(path).read_text())

    async def write_text_file(self, session_id: str, path: str, content: str, **_: Any) -> Any:
        self.calls.append(("write", path))
        self.buffers[path] = content  # the buffer changes; the editor saves when the person does
        return WriteTextFileResponse()

    async def create_terminal(self, session_id: str, command: str, args: Any = None, cwd: Any = None, **_: Any) -> Any:
        terminal = f"term-{next(self._ids)}"
        self.calls.append(("terminal", [command, *(args or [])]))
        process = await asyncio.create_subprocess_exec(
            command, *(args or []), cwd=cwd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        self._terminals[terminal] = process
        return CreateTerminalResponse(terminal_id=terminal)

    async def wait_for_terminal_exit(self, session_id: str, terminal_id: str, **_: Any) -> Any:
        process = self._terminals[terminal_id]
        await process.wait()
        return WaitForTerminalExitResponse(exit_code=process.returncode)

    async def terminal_output(self, session_id: str, terminal_id: str, **_: Any) -> Any:
        process = self._terminals[terminal_id]
        output = (await process.stdout.read()).decode() if process.returncode is not None else ""
        return TerminalOutputResponse(output=output, truncated=False)

    async def kill_terminal(self, session_id: str, terminal_id: str, **_: Any) -> Any:
        self._terminals[terminal_id].kill()
        return KillTerminalResponse()

    async def release_terminal(self, session_id: str, terminal_id: str, **_: Any) -> Any:
        self.calls.append(("release", terminal_id))
        return ReleaseTerminalResponse()

    def kinds(self) -> list[str]:
        return [u.session_update for u in self.updates]

    def tool_updates(self) -> list[Any]:
        return [u for u in self.updates if u.session_update in ("tool_call", "tool_call_update")]

    def text(self, kind: str = "agent_message_chunk") -> str:
        return "".join(u.content.text for u in self.updates if u.session_update == kind)

    async def wait_for(self, kind: str, timeout: float = 30) -> None:
        await self.wait_until(lambda: kind in self.kinds(), timeout)

    async def wait_until(self, check: Any, timeout: float = 30) -> None:
        async def seen() -> None:
            while not check():
                self.seen.clear()
                await self.seen.wait()

        await asyncio.wait_for(seen(), timeout)


@asynccontextmanager
async def editor(client: EditorClient, *args: str, command: list[str] | None = None) -> AsyncIterator[Any]:
    """`subagent acp ARGS` (in a fork of the preloaded process, if any), or `python COMMAND`, started and
    initialized; the connection."""
    python, *first = [sys.executable] if command else AGENT_PYTHON
    argv = [*first, *(command or ["-m", "mlx_subagents.cli", "acp", *args])]
    # The agent saves and closes what runs when its stdin closes: under load that takes more than the
    # SDK's 2 s before it terminates the process (and may race its exit: ProcessLookupError).
    # The SDK (0.12.1) still calls elicitation/create unstable; ACP made it stable in 2026-07.
    spawn = acp.spawn_agent_process(
        client, python, *argv, env=agent_env(), transport_kwargs=SHUTDOWN, use_unstable_protocol=True
    )
    async with spawn as (conn, _process):
        conn.initialized = await conn.initialize(protocol_version=1, client_capabilities=client.capabilities())
        yield conn


async def worker_turn(conn: Any, cwd: Path, text: str) -> Any:
    """A new session in `cwd` with the worker (it writes; the orchestrator does not), and one turn of it."""
    session = await conn.new_session(cwd=str(cwd), mcp_servers=[])
    await conn.set_config_option(config_id="agent", session_id=session.session_id, value="worker")
    return await conn.prompt(session_id=session.session_id, prompt=[acp.text_block(text)])


def run(main: Any) -> Any:
    return asyncio.run(main())
