"""Lines of JSON over a stream: the framing of the server's unix socket, both ways.

Every message is one JSON object on one line. A line is at most `MAX_LINE_BYTES` (the SDK's limit
for an HTTP request body): a longer one is read to its end and dropped, and the reader says so
(`Oversized`), so that the server answers it and reads on, and no client can make it hold an
unbounded buffer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

MAX_LINE_BYTES = 4 * 2**20  # the mcp SDK's DEFAULT_MAX_REQUEST_BODY_SIZE (not imported: the CLI loads no mcp)
READ_SIZE = 1 << 16


@dataclass(frozen=True)
class Oversized:
    """A line over `MAX_LINE_BYTES`, dropped: how long it was."""

    n_bytes: int


async def read_lines(reader: asyncio.StreamReader, max_bytes: int = MAX_LINE_BYTES) -> AsyncIterator[str | Oversized]:
    """The lines `reader` gives until its end (a last line without a newline counts), decoded as UTF-8
    (bytes that are not become U+FFFD); a line over `max_bytes` is an `Oversized` in its place."""
    pending = bytearray()
    dropping = 0  # bytes of an oversized line dropped so far (0: none being dropped)
    while chunk := await reader.read(READ_SIZE):
        while chunk:
            end = chunk.find(b"\n")
            piece, chunk = (chunk, b"") if end < 0 else (chunk[:end], chunk[end + 1 :])
            if dropping or len(pending) + len(piece) > max_bytes:
                dropping += len(pending) + len(piece)
                pending.clear()
            else:
                pending += piece
            if end < 0:
                break
            if dropping:
                yield Oversized(dropping)
                dropping = 0
            else:
                yield pending.decode("utf-8", errors="replace")
                pending.clear()
    if dropping:
        yield Oversized(dropping)
    elif pending:
        yield pending.decode("utf-8", errors="replace")


def dump(message: Any) -> bytes:
    """One line: compact JSON and a newline."""
    return json.dumps(message, separators=(",", ":"), default=str).encode() + b"\n"


def load(line: str) -> dict[str, Any] | None:
    """The JSON object on a line, or None when it is not one."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return message if isinstance(message, dict) else None


def send(writer: asyncio.StreamWriter, message: Any) -> None:
    """Queue one message on `writer`; a peer that has gone is ignored (it reads nothing more)."""
    if not writer.is_closing():
        writer.write(dump(message))
