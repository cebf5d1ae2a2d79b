"""The sandbox's walls on real bubblewrap, as root and as an ordinary user: no capability, no other
process, a private /tmp, no unix socket, `.git` read-only; and the sweep still reaches the command."""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from mlx_subagents.tools import Sandbox, Workspace
from mlx_subagents.tools.bash import BashTool
from mlx_subagents.tools.sandbox import python_under_tmp, sandboxed, seatbelt_profile, socket_filter
from tests.helpers import needs_bwrap

NOBODY = 65534


def as_user(user: str) -> list[str]:
    """The prefix that runs a command as `user` ("root": as this process, which must be root; "nobody": an
    unprivileged user: through setpriv when this process is root, else as this process, already one)."""
    if user == "root":
        if os.geteuid() != 0:
            pytest.skip("the root case needs a root test process")
        return []
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("setpriv (util-linux) is needed to run the sandbox as an ordinary user")
        pytest.skip("no setpriv to run the sandbox as an ordinary user")
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]


@pytest.fixture
def workspace() -> Iterator[Path]:
    """A workspace any user can reach (pytest's own folders are root's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="mlx-subagents-walls-", dir="/var/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def run_in_sandbox(user: str, workspace: Path, command: str, network: bool = False) -> str:
    """The standard output of `command` run sandboxed in `workspace` (made `user`'s own) as `user`."""
    prefix = as_user(user)
    if prefix:
        subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(workspace)], check=True)
    args = sandboxed(["bash", "-c", command], Sandbox(writable=(workspace,), network=network))
    done = subprocess.run(
        [*prefix, *args], cwd=workspace, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
    )
    return done.stdout


@needs_bwrap
@pytest.mark.parametrize("user", ["root", "nobody"])
def test_the_sandbox_holds_for_root_and_for_an_ordinary_user(user: str, workspace: Path) -> None:
    outside = Path("/var/tmp") / f"mlx-subagents-outside-{uuid.uuid4().hex}"
    host_temp = Path(tempfile.gettempdir()) / f"mlx-subagents-host-{uuid.uuid4().hex}"
    host_temp.write_text("the host's temp file\n")
    inside_temp = f"mlx-subagents-inside-{uuid.uuid4().hex}"
    me = os.getpid()
    probe = "; ".join(
        [
            "grep CapEff /proc/self/status",
            "mount -o remount,rw / 2>/dev/null && echo REMOUNTED || echo NO-REMOUNT",
            f"echo x > {outside} 2>/dev/null && echo WROTE-OUTSIDE || echo WRITE-REFUSED",
            f"ls /proc/{me}/root >/dev/null 2>&1 && echo SEES-HOST || echo HOST-HIDDEN",
            f"nsenter --net=/proc/{me}/ns/net true 2>/dev/null && echo NSENTER || echo NO-NSENTER",
            "ls /proc | grep -c '^[0-9]'",
            f"cat {host_temp} 2>/dev/null || echo HOST-TEMP-HIDDEN",
            f"echo t > $TMPDIR/{inside_temp} && echo TMPDIR=$TMPDIR",
            "echo w > in.txt && echo WROTE-WORKSPACE",
        ]
    )
    try:
        lines = run_in_sandbox(user, workspace, probe).splitlines()
    finally:
        host_temp.unlink()
    assert lines[0] == "CapEff:\t0000000000000000"
    assert lines[1:6] == ["NO-REMOUNT", "WRITE-REFUSED", "HOST-HIDDEN", "NO-NSENTER", lines[5]]
    assert int(lines[5]) <= 5  # bubblewrap's two, bash, and what it runs: no process outside
    assert lines[6:] == ["HOST-TEMP-HIDDEN", "TMPDIR=/tmp", "WROTE-WORKSPACE"]
    assert not outside.exists() and not (Path(tempfile.gettempdir()) / inside_temp).exists()
    assert (workspace / "in.txt").read_text() == "w\n"


@needs_bwrap
@pytest.mark.process  # python inside the sandbox
def test_no_unix_socket_is_reachable_from_the_sandbox_with_or_without_network(workspace: Path) -> None:
    # A listening socket outside the workspace, like a docker or agent socket; and one inside it.
    sockets = []
    for folder in (Path("/var/tmp"), workspace):
        path = folder / f"s-{uuid.uuid4().hex[:8]}.sock"
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        server.listen(1)
        sockets.append((server, path))
    connect = (
        f"{sys.executable} -c \"import socket,sys\ntry:\n socket.socket(socket.AF_UNIX).connect(sys.argv[1]); print('REACHED')"
        f"\nexcept OSError as e: print(e)\na, b = socket.socketpair(); print('PAIR')\" "
    )
    try:
        for network in (False, True):
            for _, path in sockets:
                out = run_in_sandbox("root" if os.geteuid() == 0 else "nobody", workspace, connect + str(path), network)
                assert out.splitlines() == ["[Errno 1] Operation not permitted", "PAIR"]
    finally:
        for server, path in sockets:
            server.close()
            path.unlink()


@needs_bwrap
@pytest.mark.slow
def test_a_command_that_leaves_its_group_and_wipes_its_mark_still_dies_with_the_call(tmp_path: Path) -> None:
    # Unsandboxed, `env -i setsid -f` escapes both the group kill and the sweep (docs/agents.md); in the
    # sandbox's PID namespace it dies with the namespace's first process, which is in the call's group.
    tool = BashTool(Workspace(tmp_path), Sandbox(writable=(tmp_path,)))
    tag = uuid.uuid4().int % 1000 + 1000
    command = f"setsid sleep {tag}.1 & env -i setsid -f sleep {tag}.2; echo started > started; sleep {tag}.3"

    def sleepers() -> dict[str, psutil.Process]:
        """The sleepers the command started (outside the namespace they have other pids), by argument."""
        found = {}
        for proc in psutil.process_iter():
            try:
                cmdline = proc.cmdline()
            except psutil.Error:
                continue
            if cmdline[:1] == ["sleep"] and cmdline[1:2] and cmdline[1].startswith(f"{tag}."):
                found[cmdline[1]] = proc
        return found

    async def cancel_midway() -> dict[str, psutil.Process]:
        task = asyncio.create_task(tool.call({"command": command}))
        deadline = time.monotonic() + 20
        while len(found := sleepers()) < 3:
            assert time.monotonic() < deadline, "the sandboxed command never started its sleepers"
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return found

    found = asyncio.run(cancel_midway())
    assert sorted(found) == [f"{tag}.1", f"{tag}.2", f"{tag}.3"]
    _, alive = psutil.wait_procs(list(found.values()), timeout=3)
    assert alive == []
    timed_out = asyncio.run(tool.call({"command": "echo started; sleep 30", "timeout": 1}))
    assert timed_out.output == "Error: command timed out after 1s; its process group was killed\nstarted"


@needs_bwrap
@pytest.mark.parametrize("user", ["root", "nobody"])
def test_git_metadata_is_read_only_in_the_sandbox(user: str, workspace: Path) -> None:
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(workspace)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "base"], check=True)
    config = (workspace / ".git" / "config").read_bytes()
    probe = "; ".join(
        [
            "printf '#!/bin/sh\\ntouch /var/tmp/pwned\\n' > .git/hooks/pre-commit 2>/dev/null || echo HOOK-REFUSED",
            "git config core.fsmonitor 'touch /var/tmp/pwned' 2>/dev/null || echo CONFIG-REFUSED",
            "rm -rf .git 2>/dev/null; mv .git moved 2>/dev/null || echo GIT-STAYS",
            "echo code > code.txt && echo WROTE-WORKSPACE",
        ]
    )
    assert run_in_sandbox(user, workspace, probe).splitlines() == [
        "HOOK-REFUSED",
        "CONFIG-REFUSED",
        "GIT-STAYS",
        "WROTE-WORKSPACE",
    ]
    assert (workspace / ".git" / "config").read_bytes() == config
    assert not (workspace / ".git" / "hooks" / "pre-commit").exists()


def test_the_socket_filter_is_written_for_the_machines_it_knows() -> None:
    # Twelve BPF instructions of 8 bytes; a machine it does not know gets none (the call fails closed).
    assert len(socket_filter("x86_64") or b"") == len(socket_filter("aarch64") or b"") == 12 * 8
    assert socket_filter("riscv64") is None


def test_the_macos_profile_says_each_wall(tmp_path: Path) -> None:
    (tmp_path / ".git").mkdir()
    temp = tmp_path / "private-temp"
    profile = seatbelt_profile(Sandbox(writable=(tmp_path,)), temp).splitlines()
    shared = " ".join(f'(subpath "{p}")' for p in dict.fromkeys([Path("/private/tmp"), Path(tempfile.gettempdir())]))
    ws, tmp = f'(subpath "{tmp_path}")', f'(subpath "{temp}")'
    assert profile == [
        "(version 1)",
        "(allow default)",
        "(deny file-write*)",
        f'(allow file-write* {ws} {tmp} (literal "/dev/null") (literal "/dev/tty") (regex #"^/dev/fd/"))',
        f"(deny file-read* file-write* {shared})",
        f"(allow file-read* file-write* {tmp})",
        f'(deny file-write* (subpath "{tmp_path}/.git"))',
        "(deny process-info*)",
        "(allow process-info* (target same-sandbox))",
        "(deny signal)",
        "(allow signal (target same-sandbox))",
        "(deny network-outbound (remote unix-socket))",
        "(deny network-bind (local unix-socket))",
        "(deny network*)",
        f"(allow network-outbound (remote unix-socket {ws}) (remote unix-socket {tmp}))",
        f"(allow network-bind (local unix-socket {ws}) (local unix-socket {tmp}))",
    ]
    online = seatbelt_profile(Sandbox(writable=(tmp_path,), network=True), temp)
    assert "(deny network*)" not in online
    assert '(remote unix-socket (path-literal "/private/var/run/mDNSResponder"))' in online


@needs_bwrap
def test_a_workspace_under_tmp_stays_writable_over_the_private_tmp(tmp_path: Path) -> None:
    assert str(tmp_path).startswith(tempfile.gettempdir())  # pytest's folders are under /tmp
    tool = BashTool(Workspace(tmp_path), Sandbox(writable=(tmp_path,)))
    result = asyncio.run(tool.call({"command": "echo kept > kept.txt; ls /tmp"}))
    assert (tmp_path / "kept.txt").read_text() == "kept\n"
    # the one folder leading to the workspace (and to this Python, if it lives under /tmp), nothing else
    leading = {
        p.relative_to(Path(tempfile.gettempdir()).resolve()).parts[0] for p in [tmp_path.resolve(), *python_under_tmp()]
    }
    assert result.output.split() == sorted(leading)


@needs_bwrap
def test_the_python_the_tool_runs_from_stays_usable_and_read_only(tmp_path: Path) -> None:
    tool = BashTool(Workspace(tmp_path), Sandbox(writable=(tmp_path,)))
    probe = f"{shlex.quote(sys.executable)} -c 'import sys; print(sys.prefix)'; touch {shlex.quote(sys.prefix)}/x 2>&1"
    result = asyncio.run(tool.call({"command": probe}))
    assert result.output.splitlines()[0] == sys.prefix
    assert "Read-only file system" in result.output and not Path(sys.prefix, "x").exists()
