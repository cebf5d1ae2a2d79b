"""`subagent serve` on a machine other users share: the state folder is the owner's alone whatever the
umask, the socket's folder is the owner's or the server says so in one line, a client sends nothing to
a socket whose owner it cannot check, the HTTP token is good only for the server that made it, and
another user's idle connections never starve the owner's socket clients."""

from __future__ import annotations

import os
import resource
import select
import selectors
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlx_subagents.errors import SubagentError
from mlx_subagents.home import make_state_dir
from mlx_subagents.serve.http_app import MAX_HTTP_CONNECTIONS
from mlx_subagents.serve.state import claim, new_token, owned_listener, running_server, serve_paths
from tests.helpers import Terminal, spawn_cli

NOBODY = 65534
# Giving a file to another user (chown) takes root: as an ordinary user these cases cannot be staged.
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs a root test process to give files to another user")


def as_nobody() -> list[str]:
    """The prefix that runs a command as an ordinary other user (this process must be root)."""
    if os.geteuid() != 0:
        pytest.skip("needs a root test process to act as another user")
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv (util-linux) to act as another user")
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]


@pytest.fixture
def open_folder() -> Iterator[Path]:
    """A folder every user may enter (pytest's own temp folders are 0700: they would hide the home)."""
    folder = Path(tempfile.mkdtemp(prefix="shared-machine-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def test_the_state_folder_is_the_owners_alone_whatever_the_umask(open_folder: Path) -> None:
    home = open_folder / "home"
    old = os.umask(0o022)
    try:
        runs = make_state_dir(home / "runs", home=home)  # the home made first, 0700
        assert home.stat().st_mode & 0o777 == 0o700
        (runs / "transcript.jsonl").write_text("what the agents saw\n")  # 0644 under this umask
        home.chmod(0o755)  # a folder an older version (or the umask) left open
        make_state_dir(home / "logs", home=home)
        assert home.stat().st_mode & 0o777 == 0o700
    finally:
        os.umask(old)
    read = subprocess.run([*as_nobody(), "cat", str(runs / "transcript.jsonl")], capture_output=True, text=True)
    assert read.returncode == 1 and read.stderr.endswith("Permission denied\n") and read.stdout == ""


@as_root
@pytest.mark.slow
@pytest.mark.process
def test_a_socket_folder_another_user_made_first_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The socket of a long state folder goes to the temp folder: one squatted by another user, or open to
    others, stops `subagent serve` in one line (it was a traceback); the owner's own folder serves."""
    long_home = tmp_path / ("h" * 120)  # too long for a unix socket: it moves to the temp folder
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    paths = serve_paths(long_home)
    folder = shared / f"mlx-subagents-{os.getuid()}"
    assert paths.socket.parent == folder
    folder.mkdir()
    os.chown(folder, NOBODY, NOBODY)  # squatted by another user
    serve = spawn_cli("serve", "--no-http", env={"MLX_SUBAGENTS_HOME": str(long_home), "TMPDIR": str(shared)})
    out, err = serve.communicate(timeout=60)
    assert (serve.returncode, out) == (2, "")
    assert err == (
        f"error: {folder}: not a folder of yours (another user made it first); remove it, or set "
        "MLX_SUBAGENTS_HOME to a shorter path (the socket then lives in the state folder)\n"
    )
    os.chown(folder, os.getuid(), os.getgid())
    folder.chmod(0o777)
    with pytest.raises(SubagentError) as refused, claim(paths):
        pass
    assert str(refused.value) == f"{folder}: others may write in it, so a socket there could be theirs; chmod 700 it"
    folder.chmod(0o700)
    with claim(paths):  # the owner's own folder: fine
        pass


@as_root
def test_a_client_sends_nothing_to_a_socket_whose_owner_it_cannot_check(tmp_path: Path) -> None:
    folder = tmp_path / "sock"
    folder.mkdir(mode=0o700)
    path = folder / "serve.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    try:
        assert owned_listener(path)
        os.chown(path, NOBODY, NOBODY)  # another user's socket in its place
        assert not owned_listener(path)
        os.chown(path, os.getuid(), os.getgid())
        folder.chmod(0o733)  # others could have put it there
        assert not owned_listener(path)
    finally:
        listener.close()


def test_the_http_token_is_new_at_each_start_and_the_owners_alone(tmp_path: Path) -> None:
    paths = serve_paths(tmp_path / "home")
    paths.folder.mkdir(parents=True)
    first, second = new_token(paths), new_token(paths)
    assert first != second and paths.token.read_text() == second + "\n"  # a leaked one is good for nothing
    assert paths.token.stat().st_mode & 0o777 == 0o600


@pytest.mark.slow
@pytest.mark.process
def test_what_other_users_send_neither_reaches_the_terminal_raw_nor_starves_the_socket(tmp_path: Path) -> None:
    """A server in the foreground, as its owner runs it. Any local process may send it a request: the log
    line that quotes its path shows it on the terminal, never obeyed (a window title, a cleared screen),
    the log file keeps it as it came. Then 1,100 idle TCP connections (past the 1,024 descriptors a
    server starts with): it closes those past its cap as they come, and `--status` over the socket
    answers (without the cap the server ran out of descriptors and `--status` hung)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this process may open only {hard} files")
    terminal = Terminal(["serve", "--port", "0", "--model", "scripted:none.json", "-C", str(tmp_path)])
    held: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 60
        while (info := running_server(wait=0)) is None or info.url is None:
            assert time.monotonic() < deadline, "the server did not listen"
            time.sleep(0.05)
        port = int(info.url.rsplit(":", 1)[1].split("/")[0])
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"GET /%1b]0;owned%07%1b[2J HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert conn.recv(4096).startswith(b"HTTP/1.1 404")
        shown = b""
        while b"refused (404)" not in shown:
            assert select.select([terminal.fd], [], [], max(0.0, deadline - time.monotonic()))[0], shown
            shown += os.read(terminal.fd, 4096)

        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))  # the server keeps 1,024
        for _ in range(1100):
            held.append(socket.create_connection(("127.0.0.1", port)))
        status = spawn_cli("serve", "--status")
        out, err = status.communicate(timeout=60)
        closed = closed_by_peer(held, at_least=len(held) - MAX_HTTP_CONNECTIONS)
        n_open = len(os.listdir(f"/proc/{info.pid}/fd"))
    finally:
        for conn in held:
            conn.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        terminal.close()
    assert b"HTTP GET /\\x1b]0;owned\\x07\\x1b[2J refused (404)" in shown and b"\x1b]0;owned" not in shown
    assert "HTTP GET /\x1b]0;owned\x07\x1b[2J refused (404)" in serve_paths().log.read_text()  # as it came
    assert status.returncode == 0 and out.startswith("server  pid"), err
    assert closed >= len(held) - MAX_HTTP_CONNECTIONS
    assert n_open < MAX_HTTP_CONNECTIONS + 100  # the connections it keeps, and its own few


def closed_by_peer(conns: list[socket.socket], at_least: int, timeout: float = 60) -> int:
    """How many of `conns` the other end closed, waiting (up to `timeout`) until `at_least` are."""
    selector = selectors.DefaultSelector()
    for conn in conns:
        selector.register(conn, selectors.EVENT_READ)
    closed = 0
    deadline = time.monotonic() + timeout
    while closed < at_least and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=1):
            selector.unregister(key.fileobj)
            closed += 1  # readable while idle: its end (EOF or a reset)
    selector.close()
    return closed
