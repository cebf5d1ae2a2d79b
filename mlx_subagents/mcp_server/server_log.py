"""The server's own log: where it goes (stderr and `$MLX_SUBAGENTS_HOME/logs/mcp.log`; never stdout,
the protocol channel) and how its lines look on a terminal.

Not a client's log messages: those are `notices.py`'s `ClientLog`.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from ..home import make_state_dir, state_home
from ..text import terminal_text

LOG_FILE = "mcp.log"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_path() -> Path:
    """The log this process writes (`setup_logging`'s), default `logs/mcp.log` in the state folder."""
    return _log_file[0] or state_home() / "logs" / LOG_FILE


_log_file: list[Path | None] = [None]


class TerminalFormatter(logging.Formatter):
    """Log lines for a terminal: what a line quotes from outside (a URL's path, a client's malformed
    line, a server's message: any local process can send `subagent serve` a request) is shown through
    `terminal_text` and never obeyed; the log file keeps it as it came."""

    def format(self, record: logging.LogRecord) -> str:
        return terminal_text(super().format(record))


def setup_logging(path: Path | None = None) -> Path:
    """Our log and the SDK's warnings to stderr and to the log file (default `logs/mcp.log`); nothing to stdout.
    A detached server's stderr is that file already (`start_detached`): each line is written once."""
    path = _log_file[0] = path or log_path()
    make_state_dir(path.parent)
    handlers: list[logging.Handler] = [logging.FileHandler(path, encoding="utf-8")]
    if not _same_file(sys.stderr, path):
        handlers.append(logging.StreamHandler(sys.stderr))
    for handler in handlers:
        on_terminal = isinstance(handler, logging.StreamHandler) and handler.stream.isatty()
        handler.setFormatter((TerminalFormatter if on_terminal else logging.Formatter)(LOG_FORMAT))
    for name, level in (("mlx_subagents", logging.INFO), ("mcp", logging.WARNING)):
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.propagate = False
        for handler in handlers:
            logger.addHandler(handler)
    return path


def _same_file(stream: Any, path: Path) -> bool:
    """Whether `stream` writes to the file at `path`."""
    try:
        mine, its = os.fstat(stream.fileno()), path.stat()
    except (OSError, ValueError, AttributeError):  # no file behind the stream (a test's capture)
        return False
    return (mine.st_dev, mine.st_ino) == (its.st_dev, its.st_ino)
