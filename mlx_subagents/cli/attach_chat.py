"""`subagent chat` attached to `subagent serve`: the chat runs there (`serve.remote_chat.RemoteChat`),
the terminal stays here: its events rendered, its consent questions asked at the terminal."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from ..events import EventSink
from ..serve.remote_chat import RemoteChat
from .attach import on_message, server_for
from .flags import Shared
from .terminal import drive_chat


def chat_on_server(
    shared: Shared,
    *,
    agent: str,
    once: str | None,
    resume: str | None,
    cwd: Path | None,
    plan: bool,
    out: Any,
    err: Any,
    wake: bool = True,
) -> int | None:
    """`subagent chat` on the running server: its exit code; None when it runs here instead."""
    from ..serve.client import make_hello
    from ..serve.protocol import ChatRequest

    info = server_for(shared)
    if info is None:
        return None
    hello = make_hello(
        "chat",
        options=dataclasses.replace(shared.options(), plan=plan),
        workspace=str(Path(cwd or shared.cwd).resolve()),
        interactive=sys.stdin.isatty(),
        chat=ChatRequest(agent=agent, resume=resume),
    )

    def start(sink: EventSink, on_text: Any) -> tuple[Any, Any]:
        remote = RemoteChat(info, hello, on_text, lambda connection, message: on_message(connection, message, sink))
        return Disconnect(remote), remote.start()

    return drive_chat(start, once=once, wake=wake, out=out, err=err)


class Disconnect:
    """What the terminal closes when the chat is over: the connections to the server."""

    def __init__(self, remote: RemoteChat) -> None:
        self.remote = remote

    async def close(self) -> None:
        await self.remote.disconnect()
