"""The sandbox's walls on real bubblewrap, as root and as an ordinary user: no capability, no other
process, a private /tmp, no unix socket, `.git` read-only, the kernel's interfaces read-only (root's
sysctl writes are checked against its uid, not its capabilities), nothing outside the workspace opened
for writing (FIFOs and device nodes included), no keyring; and the sweep still reaches the command."""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import socket
import stat
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
from mlx_subagents.tools.sandbox import python_under_tmp, sandboxed, seatbelt_profile, seccomp_filter
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


def python_for(user: str) -> str:
    """A Python `user` may run: this one for root; for the ordinary user the system's (this one may live
    in root's home, which the user cannot enter)."""
    if user == "root" or os.geteuid() != 0:
        return sys.executable
    if not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("no /usr/bin/python3 (Debian: python3) for the ordinary user to run")
    return "/usr/bin/python3"


@pytest.fixture(autouse=True)
def helper_python_for_nobody(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """As the ordinary user, the sandbox's Landlock step runs on a Python that user can run (in use, the
    user who runs the sandbox is the one who runs this Python; here root builds it for another user)."""
    user = getattr(request.node, "callspec", None) and request.node.callspec.params.get("user")
    if user == "nobody" or (user is None and os.geteuid() != 0):
        monkeypatch.setattr("mlx_subagents.tools.sandbox.helper_python", lambda: python_for("nobody"))


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
        f"{shlex.quote(sys.executable)} -c \"import socket,sys\ntry:\n socket.socket(socket.AF_UNIX).connect(sys.argv[1]); print('REACHED')"
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
    # `env -i setsid -f` escapes both the group kill and the sweep (docs/agents.md; unsandboxed on Linux the
    # tether still kills it); in the sandbox's PID namespace it dies with the namespace's first process,
    # which is in the call's group.
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
    _, alive = psutil.wait_procs(list(found.values()), timeout=15)  # a wait for the kills; they sleep 1,000 s+
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


def test_the_seccomp_filter_is_written_for_the_machines_it_knows() -> None:
    # Fifteen BPF instructions of 8 bytes; a machine it does not know gets none (the call fails closed).
    assert len(seccomp_filter("x86_64") or b"") == len(seccomp_filter("aarch64") or b"") == 15 * 8
    assert seccomp_filter("riscv64") is None


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


# --- the kernel's interfaces, and writes outside the workspace whatever the file is -------------------------

# Each opened for writing (never written): a write that got through would change the machine.
KERNEL_KNOBS = [
    "/proc/sys/kernel/core_pattern",  # a pipe here runs a program as the kernel's root at the next crash
    "/proc/sys/kernel/hostname",
    "/proc/sys/vm/drop_caches",
    "/proc/sys/fs/protected_fifos",
    "/proc/sysrq-trigger",
    "/proc/pressure/cpu",
    "/proc/self/oom_score_adj",
    "/proc/self/attr/current",
    "/sys/kernel/mm/transparent_hugepage/enabled",
    "/sys/power/state",
    "/sys/fs/cgroup/cgroup.procs",
]
OPEN_FOR_WRITING = """
import errno, os, sys
for path in sys.argv[1:]:
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY))
        print(path, "OPENED")
    except OSError as exc:
        print(path, errno.errorcode[exc.errno])
"""


def open_for_writing(user: str, workspace: Path, paths: list[str]) -> dict[str, str]:
    """Each path's fate when the sandbox opens it for writing as `user`: `OPENED` or the errno's name."""
    command = shlex.join([python_for(user), "-I", "-c", OPEN_FOR_WRITING, *paths])
    return dict(line.rsplit(" ", 1) for line in run_in_sandbox(user, workspace, command).splitlines())


@needs_bwrap
@pytest.mark.process  # python inside the sandbox
@pytest.mark.parametrize("user", ["root", "nobody"])
def test_the_kernels_interfaces_refuse_a_write_from_the_sandbox(user: str, workspace: Path) -> None:
    if user == "root":  # outside the sandbox, root opens them: the knobs are real
        os.close(os.open("/proc/sys/kernel/core_pattern", os.O_WRONLY))
    fates = open_for_writing(user, workspace, KERNEL_KNOBS)
    assert sorted(fates) == sorted(KERNEL_KNOBS)
    for path in KERNEL_KNOBS:  # one this kernel lacks (sysrq-trigger, say) is absent inside too
        refused = ("ENOENT",) if not os.path.exists(path) else ("EROFS", "EACCES", "EPERM")
        assert fates[path] in refused, (path, fates[path])
    assert [p for p, fate in fates.items() if fate == "OPENED"] == []


@needs_bwrap
def test_the_sandbox_has_its_own_host_name_and_no_way_to_change_the_machines(workspace: Path) -> None:
    user = "root" if os.geteuid() == 0 else "nobody"
    probe = "readlink /proc/self/ns/uts; hostname sandboxed 2>/dev/null || echo REFUSED; uname -n"
    lines = run_in_sandbox(user, workspace, probe).splitlines()
    assert lines[0] != os.readlink("/proc/self/ns/uts")  # a UTS namespace of its own
    assert lines[1:] == ["REFUSED", socket.gethostname()]
    assert socket.gethostname() != "sandboxed"


@needs_bwrap
@pytest.mark.process
@pytest.mark.parametrize("user", ["root", "nobody"])
def test_the_kernels_keyrings_are_out_of_reach(user: str, workspace: Path) -> None:
    # keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_USER_KEYRING): the user's keyring is shared with every process
    # of that uid, root's included; request_key would start /sbin/request-key outside every namespace.
    probe = (
        "import ctypes, platform; libc = ctypes.CDLL(None, use_errno=True)\n"
        "nr = {'x86_64': 250, 'aarch64': 219}[platform.machine()]\n"
        "print(libc.syscall(nr, 0, -4, 0), ctypes.get_errno())"
    )
    assert run_in_sandbox(user, workspace, shlex.join([python_for(user), "-I", "-c", probe])) == "-1 1\n"  # EPERM


@needs_bwrap
@pytest.mark.slow
def test_no_kernel_interface_anywhere_opens_for_writing_as_root(workspace: Path) -> None:
    """Every file under `/proc` (but the processes'), `/sys` and `/dev`, opened for writing as root in the
    sandbox: only bubblewrap's own harmless devices open."""
    walk = """
import os, stat
for top in ("/proc", "/sys", "/dev"):
    for folder, dirs, files in os.walk(top):
        if folder == "/proc":
            dirs[:] = [d for d in dirs if not d.isdigit() and d not in ("self", "thread-self")]
        for name in files:
            path = os.path.join(folder, name)
            try:
                if stat.S_ISLNK(os.lstat(path).st_mode):
                    continue
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY))
                print(path)
            except OSError:
                pass
"""
    opened = run_in_sandbox("root", workspace, shlex.join([sys.executable, "-I", "-c", walk])).split()
    assert sorted(opened) == ["/dev/full", "/dev/null", "/dev/pts/ptmx", "/dev/random", "/dev/urandom", "/dev/zero"]


@needs_bwrap
@pytest.mark.parametrize("user", ["root", "nobody"])
def test_nothing_outside_the_workspace_opens_for_writing_fifos_and_devices_included(user: str, workspace: Path) -> None:
    """A read-only mount stops regular files only: a FIFO a process of the user reads, and a device node,
    outside the workspace, refuse the sandbox too; its own FIFOs in the workspace and in its /tmp work."""
    outside = Path(tempfile.mkdtemp(prefix="mlx-subagents-outside-", dir="/var/tmp"))
    try:
        fifo, device = outside / "ctl.fifo", outside / "null"
        os.mkfifo(fifo, 0o666)
        os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
        if user == "nobody":
            os.chown(outside, NOBODY, NOBODY)
            os.chown(fifo, NOBODY, NOBODY)  # the user's own FIFO: its mode lets the user write it
        outside.chmod(0o755)
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the process of the user that reads it
        try:
            probe = "; ".join(
                [
                    f"(echo pwned > {fifo}) 2>/dev/null && echo FIFO-WRITTEN || echo FIFO-REFUSED",
                    f"(echo pwned > {device}) 2>/dev/null && echo DEVICE-WRITTEN || echo DEVICE-REFUSED",
                    f"mkfifo {outside}/new 2>/dev/null && echo MADE-OUTSIDE || echo MAKE-REFUSED",
                    "mkfifo own.fifo /tmp/own.fifo && (cat own.fifo & echo inside > own.fifo; wait)",
                    "(cat /tmp/own.fifo & echo in-tmp > /tmp/own.fifo; wait)",
                ]
            )
            lines = run_in_sandbox(user, workspace, probe).splitlines()
            assert os.read(reader, 100) == b""  # nothing arrived (a write that got through would wait here)
        finally:
            os.close(reader)
        assert lines == ["FIFO-REFUSED", "DEVICE-REFUSED", "MAKE-REFUSED", "inside", "in-tmp"]
        assert sorted(p.name for p in outside.iterdir()) == ["ctl.fifo", "null"]
    finally:
        shutil.rmtree(outside, ignore_errors=True)
