"""The server's side of stdio: requests read off stdin, malformed ones answered, the stop signals.

The SDK's `stdio_server` writes every answer (it keeps stdout for the protocol); the lines it
reads come from `StdinLines`, which reads a private copy of fd 0 with `os.read` in a daemon thread:

- a line that is not a JSON-RPC message gets a JSON-RPC error when it carries an id (the SDK
  drops it unseen), with id null when it is not JSON at all or its id is not one; a request whose
  params do not fit its method gets what is wrong (the SDK says only "Invalid request
  parameters"); each is a warning in the log;
- ending the input (`end`) stops the server as a client closing stdin does, and nothing waits for
  a read that blocks (the SDK's own reader thread kept the process alive after SIGINT).

`stop_signals` wires SIGINT, SIGTERM and SIGHUP as `subagent run` does: the first kills every tool
process and calls `stop(signal)`; a second exits at once with 128 + its number.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mcp_types as types
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from ..tools import kill_all_processes

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
READ_SIZE = 1 << 16

log = logging.getLogger("mlx_subagents.mcp")


class StdinLines:
    """The protocol's input lines, for `stdio_server(stdin=...)`; see the module docstring.

    Create it in the event loop that serves, set `answers` to the transport's write stream before
    the first line is read, and call `restore()` when the server has stopped.
    """

    def __init__(self, fd: int = 0) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.answers: Any = None  # the transport's write stream: where a malformed request's error goes
        self._fd, self._private = fd, os.dup(fd)
        # Children read EOF, as under the SDK's own claim of fd 0; the private copy is never closed
        # under the reader thread.
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, fd)
        os.close(null)
        threading.Thread(target=self._read, daemon=True, name="mcp-stdin").start()

    def end(self) -> None:
        """End the input now: the server stops as when the client closes stdin."""
        self._queue.put_nowait(None)

    def restore(self) -> None:
        os.dup2(self._private, self._fd)

    def _read(self) -> None:
        pending = b""
        try:
            while chunk := os.read(self._private, READ_SIZE):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self._put(line.decode("utf-8", errors="replace"))
            if pending:
                self._put(pending.decode("utf-8", errors="replace"))
        except OSError as exc:
            log.warning("stdin: %s; stopping", exc)
        self._put(None)

    def _put(self, line: str | None) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, line)
        except RuntimeError:  # the loop has closed: the server has stopped
            pass

    def __aiter__(self) -> AsyncIterator[str]:
        return self._lines()

    async def _lines(self) -> AsyncIterator[str]:
        while (line := await self._queue.get()) is not None:
            if not line.strip():
                continue
            found = malformed(line)
            if found is None:
                yield line
                continue
            request_id, error = found
            if error is None:
                log.warning("malformed notification from the client, not answered: %s", _brief(line))
                continue
            which = f"request {request_id!r}" if request_id is not None else "message (answered with id null)"
            log.warning("malformed %s from the client: %s: %s", which, error.message, _brief(line))
            if self.answers is not None:
                reply = types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error)
                await self.answers.send(SessionMessage(reply))


def malformed(line: str) -> tuple[str | int | None, types.ErrorData | None] | None:
    """None for a well-formed message (or a request for a method this checks nothing of: the SDK
    answers it); else the id to answer and the error, None for a notification (never answered)."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        return None, types.ErrorData(code=types.PARSE_ERROR, message="Parse error: the line is not valid JSON")
    if not isinstance(message, dict):
        what = "an array (batches are not supported)" if isinstance(message, list) else f"a {type(message).__name__}"
        return None, _invalid(f"a message is one JSON object, got {what}")
    request_id = message.get("id")
    if "id" in message and (not isinstance(request_id, (str, int)) or isinstance(request_id, bool)):
        return None, _invalid("'id' must be a string or an integer")
    try:
        types.jsonrpc_message_adapter.validate_python(message, by_name=False)
    except ValidationError:
        return (request_id, _invalid(_problem(message))) if "id" in message else (None, None)
    if "id" not in message or not isinstance(message.get("method"), str):
        return None  # a notification or a response: the SDK's own
    problem = params_problem(message["method"], message.get("params"))
    if problem is None:
        return None
    return request_id, types.ErrorData(code=types.INVALID_PARAMS, message=f"Invalid params: {problem}")


def params_problem(method: str, params: Any) -> str | None:
    """What is wrong with a known method's params, in one line; None when they fit or the method is
    unknown (the SDK answers "Method not found")."""
    request = {"method": method} if params is None else {"method": method, "params": params}
    try:
        types.client_request_adapter.validate_python(request, by_name=False)
        return None
    except ValidationError as exc:
        errors = exc.errors()
    # The union tries every request type: keep the errors of the one whose `method` matched.
    other = {e["loc"][0] for e in errors if e["loc"][1:2] == ("method",)}
    own = [e for e in errors if e["loc"] and e["loc"][0] not in other]
    if not own:
        return None
    first = own[0]
    where = ".".join(str(part) for part in first["loc"][1:]) or "params"
    more = f" (and {len(own) - 1} more)" if len(own) > 1 else ""
    return f"{method}: {where}: {first['msg']}{more}"


def _problem(message: dict[str, Any]) -> str:
    if message.get("jsonrpc") != "2.0":
        return "'jsonrpc' must be \"2.0\""
    if "method" in message and not isinstance(message["method"], str):
        return "'method' must be a string"
    if "params" in message and not isinstance(message["params"], dict):
        return "'params' must be an object"
    return "a request needs 'method' (a string) and may have 'params' (an object)"


def _invalid(problem: str) -> types.ErrorData:
    return types.ErrorData(code=types.INVALID_REQUEST, message=f"Invalid request: {problem}")


def _brief(line: str) -> str:
    return line if len(line) <= 200 else line[:200] + "..."


@contextmanager
def stop_signals(stop: Callable[[signal.Signals], None]) -> Iterator[None]:
    """While the block runs, the first SIGINT, SIGTERM or SIGHUP kills every tool process and calls
    `stop(signal)`; a second one exits at once with 128 + its number."""
    loop = asyncio.get_running_loop()
    seen: list[signal.Signals] = []

    def on_signal(signum: signal.Signals) -> None:
        kill_all_processes()
        if seen:
            os._exit(128 + signum)
        seen.append(signum)
        stop(signum)

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        yield
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)
