"""Where `subagent serve` keeps its files, and how a process finds the server of its state folder.

One server per state folder (`$MLX_SUBAGENTS_HOME/serve/`):

- `serve.lock`: the running server holds an exclusive `flock` on it for its whole life, so a second
  server is refused at once and a crashed one (the kernel drops its lock) is never mistaken for a
  running one;
- `server.json`: what it is (pid, socket, URL, log), written once it listens, removed when it ends;
- `serve.sock`: the unix socket (0600) the project's own front ends speak to (a path too long for a
  unix socket is moved to the temp folder, named by a hash of the state folder);
- `token`: the bearer token HTTP clients send (0600), new at each start, so that a token that leaked
  while no server ran (to another user listening on the port) is good only for a server that is gone;
- the socket, when its path is too long, in `$TMPDIR/mlx-subagents-<uid>/`, a folder the user's
  alone (`private_folder`); a client sends nothing to a socket whose owner it cannot check
  (`owned_listener`). The state folder itself is the user's alone (`home.keep_private`).

Files a dead server left (a socket nobody listens on, a `server.json` whose lock nobody holds) are
stale: the next server replaces them, and clients take them for no server.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import secrets
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ValidationError

from ..errors import SubagentError
from ..home import HOME_ENV, make_state_dir, state_home, write_whole
from ..userfiles import read_text

SERVE_DIR = "serve"
LOG_FILE = "serve.log"
# Unix socket paths are at most 104 (macOS) or 108 (Linux) bytes, the final NUL included.
MAX_SOCKET_PATH = 100
TOKEN_BYTES = 32
# How long a client waits for a server that holds the lock to say where it listens (it is starting).
STARTING_WAIT_S = 10.0


class ServerRunning(SubagentError):
    """A server already runs for this state folder."""


@dataclass(frozen=True)
class ServePaths:
    """The server's files for one state folder."""

    home: Path
    folder: Path
    lock: Path
    info: Path
    token: Path
    socket: Path
    log: Path


def serve_paths(home: Path | None = None) -> ServePaths:
    """The files of the server of `home` (default: this process's state folder)."""
    home = (home or state_home()).expanduser().resolve()
    folder = home / SERVE_DIR
    socket = folder / "serve.sock"
    if len(os.fsencode(socket)) > MAX_SOCKET_PATH:
        digest = hashlib.sha256(os.fsencode(home)).hexdigest()[:16]
        socket = Path(tempfile.gettempdir()) / f"mlx-subagents-{os.getuid()}" / f"{digest}.sock"
    return ServePaths(
        home=home,
        folder=folder,
        lock=folder / "serve.lock",
        info=folder / "server.json",
        token=folder / "token",
        socket=socket,
        log=home / "logs" / LOG_FILE,
    )


class ServerInfo(BaseModel):
    """`server.json`: how to reach the running server."""

    pid: int
    version: str
    home: str
    socket: str
    url: str | None  # the streamable-HTTP endpoint; None when serving only on the socket
    log: str
    started: float

    def where(self) -> str:
        """`pid 123, http://127.0.0.1:8421/mcp and /home/u/.mlx-subagents/serve/serve.sock`."""
        places = " and ".join(p for p in (self.url, self.socket) if p)
        return f"pid {self.pid}, {places}"


# -- the lock: one server per state folder -------------------------------------------------------------


def lock_held(paths: ServePaths) -> bool:
    """Whether a process holds the server lock of this state folder (a server runs or starts)."""
    try:
        fd = os.open(paths.lock, os.O_RDONLY)
    except OSError:  # no lock file (or no state folder): no server
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock we took
    return False


@contextmanager
def claim(paths: ServePaths) -> Iterator[None]:
    """Hold the server lock while the block runs; a second server is refused in one line naming the first.

    Stale files of a server that died are removed here, before the new one writes its own.
    """
    make_state_dir(paths.folder, home=paths.home)
    os.chmod(paths.folder, 0o700)
    private_folder(paths.socket.parent)
    fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        info = read_info(paths)
        first = info.where() if info is not None else "it is starting"
        raise ServerRunning(
            f"a server already runs for {paths.home} ({first}); use it, or stop it with: subagent serve --stop"
        ) from None
    try:
        for stale in (paths.info, paths.socket):
            stale.unlink(missing_ok=True)
        yield
    finally:
        for mine in (paths.info, paths.socket):
            mine.unlink(missing_ok=True)
        os.close(fd)


def private_folder(folder: Path) -> None:
    """Make sure `folder` (the socket's) is this user's alone: made 0700 if missing; one line if another
    user made it first (a shared temp folder), or others may write it, since whoever can write there
    could put a socket of theirs in the server's place."""
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(folder)
    except OSError as exc:
        raise SubagentError(f"{folder}: cannot make the server's socket folder ({exc.strerror}); {_SHORTER}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise SubagentError(f"{folder}: not a folder of yours (another user made it first); {_SHORTER}")
    if st.st_mode & 0o022:
        raise SubagentError(f"{folder}: others may write in it, so a socket there could be theirs; chmod 700 it")


def owned_listener(socket: Path) -> bool:
    """Whether `socket` and its folder are this user's and no one else may write the folder: a client
    sends nothing (its options, its consent) to a socket whose owner it cannot check."""
    try:
        st, parent = os.lstat(socket), os.lstat(socket.parent)
    except OSError:
        return False
    mine = st.st_uid == parent.st_uid == os.getuid()
    return mine and stat.S_ISSOCK(st.st_mode) and not parent.st_mode & 0o022


_SHORTER = f"remove it, or set {HOME_ENV} to a shorter path (the socket then lives in the state folder)"


# -- server.json ------------------------------------------------------------------------------------------


def write_info(paths: ServePaths, info: ServerInfo) -> None:
    """Write `server.json` whole (a reader never sees half of it)."""
    write_whole(paths.info, info.model_dump_json(indent=2) + "\n", private=True)


def read_info(paths: ServePaths) -> ServerInfo | None:
    try:
        return ServerInfo.model_validate_json(read_text(paths.info, "server file", SubagentError))
    except (SubagentError, ValueError, ValidationError):
        return None


def running_server(paths: ServePaths | None = None, *, wait: float = STARTING_WAIT_S) -> ServerInfo | None:
    """The server running for the state folder, or None; one that holds the lock but has not yet
    written where it listens is waited for, up to `wait` seconds."""
    paths = paths or serve_paths()
    deadline = time.monotonic() + wait
    while lock_held(paths):
        info = read_info(paths)
        if info is not None and owned_listener(Path(info.socket)):
            return info
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    return None


# -- the token ---------------------------------------------------------------------------------------------


def new_token(paths: ServePaths) -> str:
    """A new bearer token for this server, written to `token` (0600, the user's own): one that leaked
    while no server ran (another user listening on the port got it from a client) is good for nothing
    once the server starts again. Clients read the file at each connection (serve.md)."""
    token = secrets.token_urlsafe(TOKEN_BYTES)
    paths.token.unlink(missing_ok=True)
    fd = os.open(paths.token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(token + "\n")
    return token


def status_line(paths: ServePaths) -> str:
    """One line for `doctor`: whether a server runs for this state folder, and where."""
    info = running_server(paths, wait=0)
    if info is None:
        return f"server: none for {paths.home} (subagent serve starts one)"
    return f"server: {info.where()}; log {info.log}"
