"""A connection answered before its request's body was read closes without losing the answer.

The chat endpoints (32 MiB) and the MCP SDK's transport (4 MiB) refuse a body over their limit (413)
before reading it. Kept alive, the connection
would still owe that body: a client that sent none (it waited for `100 Continue`, or lied in its
Content-Length) would have its next request read as body and never answered. So the answer says
`Connection: close`, and uvicorn closes the transport after it. Closed at once, though, a client
still sending the body (most do: http.client, requests, httpx) has its writes refused and reads a
reset, not the 413, since a socket closed with unread data sends RST. Here the close of such a
connection lingers as web servers' does (nginx's lingering_close, Go's closeWriteAndWait): the server
ends its side (FIN, after the answer), discards whatever arrives for at most `LINGER_S`, and closes
when the client does or at the limit. Nothing that arrives meanwhile is read as a request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

# How long a connection refused mid-body goes on discarding what its client sends: enough for a client
# on this machine to send the rest of a 32 MiB body and read the answer, bounded so that none holds on.
LINGER_S = 2.0


class LingeringTransport:
    """A transport whose close, while `body_unread()` says the client may still be sending a request body
    that will never be read, ends the server's side and lingers (`LINGER_S`) before closing; any other
    close is at once. Everything else is the wrapped transport's."""

    def __init__(self, transport: asyncio.Transport, body_unread: Callable[[], bool]) -> None:
        self._transport = transport
        self._body_unread = body_unread
        self.lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        transport = self._transport
        if self.lingering or transport.is_closing():
            return
        if not (self._body_unread() and transport.can_write_eof()):
            transport.close()
            return
        self.lingering = True
        transport.write_eof()  # after what is buffered: the answer
        transport.resume_reading()  # a body paused at uvicorn's high-water mark flows again, to be discarded
        asyncio.get_running_loop().call_later(LINGER_S, transport.close)
