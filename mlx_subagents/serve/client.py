"""The front ends' side of the server's socket: find the server, say hello, read its answer.

`subagent mcp` (relaying), the attached commands, `serve --status` and `--stop` all start here.
A server that cannot be reached (it died a moment ago, its socket is stale) is `ServerGone`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import SubagentError
from ..runs.jobs import Job
from ..runs.options import RunOptions
from ..runs.tasks import MODEL_ENV, absolute_model
from .protocol import Hello
from .state import ServerInfo
from .wire import MAX_LINE_BYTES, Oversized, dump, load, read_lines

# How long a quick request (status, stop, a chat's control call) waits for its answer.
QUICK_TIMEOUT_S = 30.0


class ServerGone(SubagentError):
    """The server of the state folder went away during a request."""


class ServerUnreachable(ServerGone):
    """The server of the state folder cannot be reached (it died a moment ago; its socket is stale)."""


def make_hello(kind: str, *, options: RunOptions | None = None, job: Job | None = None, **fields: Any) -> Hello:
    """A hello from this process: its pid, working directory, `$MLX_SUBAGENTS_MODEL`, options and job,
    every model path in them made absolute here (the server's folder is its own: a relative path there
    would name another file, or none)."""
    here = Path.cwd()
    given = dataclasses.asdict(options) if options is not None else {}
    given.pop("api_key", None)  # never sent: an engine run does not attach
    if given.get("model"):
        given["model"] = absolute_model(given["model"], here)
    given["allow_models"] = [absolute_model(name, here) for name in given.get("allow_models", ())]
    if job is not None:
        tasks = [replace(t, model=absolute_model(t.model, here) if t.model else None) for t in job.tasks]
        job = job.model_copy(update={"tasks": tasks})
    env_model = os.environ.get(MODEL_ENV)
    return Hello(
        hello=kind,  # type: ignore[arg-type]
        version=__version__,
        pid=os.getpid(),
        cwd=str(here.resolve()),
        options=given,
        env_model=absolute_model(env_model, here) if env_model else None,
        job=job,
        **fields,
    )


@dataclass
class Connection:
    """An open connection whose hello the server accepted: its lines in, a writer out, the answer."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    lines: Any
    ok: Any

    def send(self, message: Any) -> None:
        self.writer.write(dump(message))

    async def next(self) -> dict[str, Any] | None:
        """The next message from the server; None at its end (a malformed line is skipped)."""
        async for line in self.lines:
            if isinstance(line, Oversized):
                continue
            message = load(line)
            if message is not None:
                return message
        return None

    def close(self) -> None:
        self.writer.close()


async def connect(info: ServerInfo, hello: Hello) -> Connection:
    """Connect to the server and say hello; its refusal is raised as the one line it gave."""
    try:
        reader, writer = await asyncio.open_unix_connection(info.socket, limit=MAX_LINE_BYTES)
    except OSError as exc:
        raise ServerUnreachable(
            f"the server (pid {info.pid}) cannot be reached at {info.socket}: {exc.strerror}"
        ) from None
    writer.write(dump(hello.model_dump(mode="json", by_alias=True, exclude_none=True)))
    connection = Connection(reader, writer, read_lines(reader), None)
    first = await connection.next()
    if first is None:
        writer.close()
        raise ServerUnreachable(f"the server (pid {info.pid}) closed the connection at once")
    if "error" in first:
        writer.close()
        raise SubagentError(f"the server (pid {info.pid}) refused: {first['error']}")
    connection.ok = first.get("ok", first)
    return connection


def quick(info: ServerInfo, hello: Hello, timeout: float = QUICK_TIMEOUT_S) -> dict[str, Any]:
    """One request, one answer, on a blocking socket (`status`, `stop`)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(info.socket)
            sock.sendall(dump(hello.model_dump(mode="json", by_alias=True, exclude_none=True)))
            return read_answer(sock.makefile("rb"), info)
        except OSError as exc:
            raise ServerGone(f"the server (pid {info.pid}) did not answer at {info.socket}: {exc}") from None


def read_answer(file: Any, info: ServerInfo) -> dict[str, Any]:
    """The next message on a blocking connection's file; the server's end is `ServerGone`."""
    line = file.readline(MAX_LINE_BYTES + 1)
    message = load(line.decode("utf-8", errors="replace")) if line else None
    if message is None:
        raise ServerGone(f"the server (pid {info.pid}) went away without answering")
    return message
