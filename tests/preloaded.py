"""A Python process that imports some modules once and forks a child per command, so that a test that
runs the same Python program many times pays its imports once (a zygote, as Android's or
multiprocessing's `forkserver`, for a program a tool runs by command line).

    with preloaded(["mlx_subagents.cli", "mcp"]) as python:  # `python` stands for `[sys.executable]`
        subprocess.run([*python, "driver.py", "URL"])  # driver.py runs in a fork of the preloaded process

The command is a small client (`python -S preloaded.py SOCKET SCRIPT ARGS...`, or `-m MODULE ARGS...`, or
`-c CODE ARGS...`, standard library only)
that hands its stdin, stdout and stderr, environment, folder and arguments to the preloaded process
over a Unix socket; that process forks, and the child runs SCRIPT as `__main__` on those streams, as
`python SCRIPT ARGS...` would, then sends back its exit code (a line), which the client exits with.
If the client ends first (killed), the child gets SIGTERM. The preloaded process starts no thread
(forking one with threads is unsafe); it waits for its children as they end, and for all of them when
it is stopped (SIGTERM), so that their CPU time counts as the test's.

What a module works out at its import is the preloaded process's, from its environment and streams
(rich's consoles: their width, whether to colour): use it for programs whose streams are pipes or
files, as its own are, never a terminal (the conformance driver's chats run `subagent` anew).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
import types
from collections.abc import Iterator

HEADER = struct.Struct("!Q")  # the length of the JSON that follows the streams
START_TIMEOUT_S = 120
NO_CODE = 70  # the child ended without sending its exit code (killed): EX_SOFTWARE


@contextlib.contextmanager
def preloaded(modules: list[str], env: dict[str, str] | None = None) -> Iterator[list[str]]:
    """The preloaded process, with `modules` imported, for the block: yields the command prefix that
    stands for `python` (`[*prefix, SCRIPT, ARGS...]`). `env`: its environment (by default ours), best
    the one its children will have, for what modules read at their import."""
    folder = tempfile.mkdtemp(prefix="preloaded-")  # short: a socket's path has at most 107 bytes
    path = os.path.join(folder, "socket")
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", path, *modules],
        stdout=subprocess.PIPE,
        env=os.environ if env is None else env,
    )
    try:
        assert server.stdout is not None
        ready = select.select([server.stdout], [], [], START_TIMEOUT_S)[0] and server.stdout.readline()
        assert ready == b"ready\n", f"the preloaded process did not start (exit {server.poll()}): {ready!r}"
        yield [sys.executable, "-S", __file__, path]
    finally:
        server.terminate()  # it waits for its children
        try:
            server.wait(START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        with contextlib.suppress(OSError):
            os.unlink(path)
            os.rmdir(folder)


def serve(path: str, modules: list[str]) -> None:
    """Import `modules`, then fork a child for each client that connects to `path`, forever."""
    if sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # tests/, where `acp` is tests/acp, not the ACP SDK
    for name in modules:
        __import__(name)
    assert threading.active_count() == 1, f"importing {modules} started threads: {threading.enumerate()}"
    signal.signal(signal.SIGCHLD, lambda *_: _reap(os.WNOHANG))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    try:
        while True:
            _fork_for(listener, *listener.accept())
    finally:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _reap(0)  # each child's CPU counts as ours, and so as the test's


def _fork_for(listener: socket.socket, conn: socket.socket, address: object) -> None:
    """Read a client's request and fork the child that runs it."""
    try:
        header, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
        (size,) = HEADER.unpack(header)
        request = json.loads(_receive(conn, size))
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            _child(conn, fds, request)
        for fd in fds:
            os.close(fd)
    finally:
        conn.close()


def _reap(options: int) -> None:
    """Wait for the children that ended (`os.WNOHANG`), or for all of them (0)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, options)[0]:
            pass


def _receive(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        assert chunk, "the client left before its request was read"
        data += chunk
    return data


def _child(conn: socket.socket, fds: list[int], request: dict[str, object]) -> None:
    """In the fork: the client's streams, environment, folder and arguments, its script as `__main__`;
    its exit code sent back. Never returns."""
    for name in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(name, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])  # type: ignore[arg-type]
    _new_stdio()
    os.chdir(request["cwd"])  # type: ignore[arg-type]
    argv: list[str] = request["argv"]  # type: ignore[assignment]
    threading.Thread(target=_end_with_the_client, args=(conn,), daemon=True).start()
    code = 0
    try:
        if argv[0] == "-m":  # `python -m MODULE ARGS`: the folder first on the path, argv[0] the module's file
            sys.argv, sys.path[0] = argv[1:], os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":  # `python -c CODE ARGS`: argv[0] is "-c", the folder ("") first on the path
            sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what the interpreter's exit runs
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError):
        conn.sendall(f"{code}\n".encode())  # a line: a fork of the child may hold the socket open
    os._exit(code)


def _new_stdio() -> None:
    """`sys.stdin`, `sys.stdout` and `sys.stderr` made anew for the client's streams, as Python makes
    them at its start (the inherited ones hold what they learnt of the server's: whether it seeks)."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "rb" if fd == 0 else "wb", closefd=False)
        buffer = io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(
            buffer,
            encoding=old.encoding,
            errors=old.errors,
            line_buffering=fd == 2 or os.isatty(fd),
            write_through=unbuffered and fd != 0,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _end_with_the_client(conn: socket.socket) -> None:
    """SIGTERM this child when its client is gone (it was killed) before the child sent its code."""
    with contextlib.suppress(OSError):
        while conn.recv(64):
            pass
    os.kill(os.getpid(), signal.SIGTERM)


def client(path: str, argv: list[str]) -> int:
    """Run `argv` (a script and its arguments, or `-m MODULE` or `-c CODE` and theirs) in a fork of the preloaded
    process at `path`."""
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        socket.send_fds(conn, [HEADER.pack(len(request))], [0, 1, 2])
        conn.sendall(request)
        code = b""
        while not code.endswith(b"\n") and (chunk := conn.recv(64)):
            code += chunk
    if not code.endswith(b"\n"):
        print(f"preloaded: {argv[0]} ended without an exit code (killed)", file=sys.stderr)
        return NO_CODE
    return int(code)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(client(sys.argv[1], sys.argv[2:]))
