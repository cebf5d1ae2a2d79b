"""The bash sandbox: a sandboxed `bash` call reads what the user can, writes only in its workspace and
a private temp folder, sees no other process, opens no unix socket, and has no network unless its
agent is allowed it. It holds for root too: every capability is dropped.

Linux wraps the command in bubblewrap (`bwrap`):

- the whole file system bound read-only, the workspace bound writable and its `.git` bound read-only
  again (so nothing the command writes runs later in the tool's own git calls: hooks, config);
- a private `/tmp` (a tmpfs, `TMPDIR=/tmp`; the Python environment the tool runs from, when it lives
  under `/tmp`, bound read-only over it), a private `/dev` and SysV IPC;
- a PID namespace: no process outside it is visible (`/proc/<pid>/root`, `nsenter`, signals reach
  none); the sweep, time-outs and cancellation of `command.py` still reach the command, since the
  wrapper keeps the call's process group and mark, and the namespace's first process is in that
  group: when it is killed the kernel kills every process in the namespace, even one that left the
  group and wiped its environment;
- the kernel's interfaces read-only: its own `/proc` remounted read-only whole (`/proc/sys`,
  `/proc/sysrq-trigger`: root's sysctl writes are checked against its uid, not its capabilities),
  `/sys` with `/`, a private `/dev`, a UTS and a cgroup namespace (`bwrap_args`);
- Landlock (`landlock.py`, run inside before the command): nothing outside the writable folders opens
  for writing, FIFOs, sockets and device nodes included, which a read-only mount does not stop;
- `--cap-drop ALL` (bubblewrap sets no-new-privs, so nothing regains one through exec);
- a seccomp filter: `socket(AF_UNIX, ...)` fails with EPERM (a docker socket, an agent's socket,
  wherever they live; `socketpair` still works), and so do `io_uring_setup` (its requests would
  pass the filter) and the keyrings;
- a network namespace of its own unless the agent is allowed the network.

macOS wraps it in `sandbox-exec` with a profile made here (`seatbelt_profile`): writes only in the
workspace and a private temp folder (`TMPDIR`, removed when the command ends), `.git` read-only, the
system's and the user's temp folders unreadable, unix sockets only inside the workspace, signals and
process inspection only within the sandbox; no network unless allowed.

Where neither works, a call fails closed with one line saying how to install it or how to turn the
sandbox off; it never runs unsandboxed.
"""

from __future__ import annotations

import functools
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import ToolError
from . import landlock

INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap)"
OFF_HINT = "or run this agent unsandboxed with --sandbox off (or 'sandbox: off' in a user agent's file)"
LEAD = "bash is sandboxed for this agent but "  # each refusal's first words; the reason and its fix follow
PROBE_TIMEOUT = 10.0
GIT_DIR = ".git"
SANDBOX_TMP = "/tmp"
FILTER_FD = "3"


@dataclass(frozen=True)
class Sandbox:
    """What a sandboxed `bash` may do besides reading: write in `writable`, reach the network or not.

    Args:
        writable: the folders it may write: its tool's workspace (`within`; `make_tools` binds it, so the
            folder follows a task into its worktree).
        network: whether it keeps the network (a coarse switch: all of it or none, no allow-list).
    """

    writable: tuple[Path, ...] = ()
    network: bool = False

    def within(self, root: Path) -> Sandbox:
        """This sandbox for a tool working in `root`: `root` is the folder it writes."""
        return replace(self, writable=(root,))

    def folders(self) -> list[Path]:
        """The writable folders, resolved, each once."""
        return list(dict.fromkeys(Path(p).resolve() for p in self.writable))

    def record(self) -> dict[str, bool]:
        """What a transcript keeps of it, so a continued task runs in the same sandbox (`from_record`)."""
        return {"network": self.network}

    @staticmethod
    def from_record(data: Any) -> Sandbox | None:
        """The sandbox a transcript's `sandbox` record names; None for none (or not a record)."""
        if not isinstance(data, Mapping):
            return None
        return Sandbox(network=data.get("network") is True)


def sandboxed(args: Sequence[str], sandbox: Sandbox) -> list[str]:
    """`args` wrapped in this platform's sandbox; raises `ToolError` (one line) where none works."""
    if sys.platform == "darwin":
        return _seatbelt(args, sandbox)
    return _bubblewrap(args, sandbox)


def sandbox_problem() -> str:
    """Why no sandboxed `bash` can run on this machine and how to fix it, "" where one can: said when a
    server starts (`subagent serve`), so that a person reads it there and not only in a project agent's
    refused tool call. Asked as a call would be (bubblewrap's probe runs once per process)."""
    try:
        sandboxed(["true"], Sandbox())
    except ToolError as exc:
        return str(exc).removeprefix(LEAD)
    return ""


def protected(folder: Path) -> list[Path]:
    """What stays read-only inside a writable folder: its `.git` (a repository's folder, or a worktree's
    file), if it has one. A folder that is not a repository has none to protect (docs/agents.md)."""
    git = folder / GIT_DIR
    return [git] if git.exists() and not git.is_symlink() else []


# --- Linux: bubblewrap ---------------------------------------------------------------------------------


def _bubblewrap(args: Sequence[str], sandbox: Sandbox) -> list[str]:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise ToolError(f"{LEAD}'bwrap' is not on PATH; {INSTALL_HINT}, {OFF_HINT}")
    rules = seccomp_filter(platform.machine())
    if rules is None:
        raise ToolError(
            f"{LEAD}this machine ({platform.machine()}) has no seccomp filter here (x86_64 and arm64 do); {OFF_HINT}"
        )
    if problem := _bwrap_problem(bwrap, rules):
        raise ToolError(f"{LEAD}bubblewrap cannot run here ({problem}); {OFF_HINT}")
    return with_filter(bwrap_args(bwrap, sandbox), rules, landlocked(args, sandbox))


def bwrap_args(bwrap: str, sandbox: Sandbox) -> list[str]:
    """bubblewrap's arguments for `sandbox` (the command and the filter's fd come after them).

    The kernel's interfaces are the sandbox's to read, never to write: the whole `/proc` (its own, for
    its PID namespace) is mounted read-only, so `/proc/sys` (`kernel.core_pattern` runs a program as
    the kernel's root at the next crash), `/proc/sysrq-trigger`, `/proc/pressure` and every process
    file refuse a write, which for root is checked against its uid and not its capabilities; `/sys` is
    read-only with the rest of `/` (bubblewrap binds submounts read-only too, and without devices);
    `/dev` is bubblewrap's own (null, zero, random, a private pty and `/dev/shm`); the host name is
    the sandbox's own (`--unshare-uts`), and so is its cgroup view."""
    wrapped = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--remount-ro", "/proc"]
    wrapped += ["--tmpfs", SANDBOX_TMP]
    for folder in python_under_tmp():
        wrapped += ["--ro-bind", str(folder), str(folder)]
    for folder in sandbox.folders():  # after /tmp's tmpfs: a workspace under /tmp is bound over it
        wrapped += ["--bind", str(folder), str(folder)]
        for inside in protected(folder):
            wrapped += ["--ro-bind", str(inside), str(inside)]
    wrapped += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    wrapped += ["--die-with-parent", "--cap-drop", "ALL", "--setenv", "TMPDIR", SANDBOX_TMP, "--seccomp", FILTER_FD]
    if not sandbox.network:
        wrapped.append("--unshare-net")
    return wrapped


def landlocked(args: Sequence[str], sandbox: Sandbox) -> list[str]:
    """`args` started by `landlock.py` (run from its text by this Python, the standard library only),
    which lets them write only in the sandbox's folders, its `/tmp` and its `/dev`: a FIFO, a socket
    or a device outside opens for reading at most."""
    writable = [*(str(f) for f in sandbox.folders()), SANDBOX_TMP, "/dev"]
    return [helper_python(), "-I", "-S", "-c", _landlock_code(), *writable, landlock.SEPARATOR, *args]


def helper_python() -> str:
    """The interpreter that runs `landlock.py` in the sandbox: this one (the user's own)."""
    return sys.executable


@functools.cache
def _landlock_code() -> str:
    return Path(landlock.__file__).read_text(encoding="utf-8")


def python_under_tmp() -> list[Path]:
    """The Python environments this process runs from that live under `/tmp` (a CI job's virtual
    environment, say): bound read-only over the private `/tmp`, so a sandboxed command still finds the
    interpreter and packages the user runs, and nothing else of the host's temp folder."""
    tmp = Path(SANDBOX_TMP).resolve()
    found = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    return sorted(p for p in found if p != tmp and p.is_relative_to(tmp))


def with_filter(wrapped: Sequence[str], rules: bytes, args: Sequence[str]) -> list[str]:
    """`wrapped -- args` started by bash with the seccomp program on fd 3: bash writes it into a pipe
    (`printf %b` of octal escapes) and execs bubblewrap in its own place (the same process, so the same
    group), which reads it; no file holds it, nothing is left behind."""
    escaped = "".join(f"\\0{byte:03o}" for byte in rules)
    return ["bash", "-c", f'exec "$@" {FILTER_FD}< <(printf "%b" "$0")', escaped, *wrapped, "--", *args]


@functools.cache
def _bwrap_problem(bwrap: str, rules: bytes) -> str:
    """Why this `bwrap` cannot make the sandbox (no user or PID namespaces, say), "" when it can; asked
    once, with the very arguments a call gets."""
    probe = with_filter(bwrap_args(bwrap, Sandbox()), rules, ["true"])
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=PROBE_TIMEOUT, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if done.returncode == 0:
        return ""
    return (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]


# Classic BPF for seccomp (linux/filter.h, linux/seccomp.h, linux/audit.h).
_LD_ABS, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06
_ALLOW, _ERRNO, _KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
_EPERM, _AF_UNIX, _X32_BIT = 1, 1, 0x40000000
_IO_URING_SETUP = 425  # the same number on every architecture since Linux 5.1


@dataclass(frozen=True)
class _Arch:
    """One machine's numbers: its AUDIT_ARCH_* and the system calls the filter names."""

    audit: int
    socket: int
    keys: tuple[int, int, int]  # add_key, request_key, keyctl


_ARCHES = {
    "x86_64": _Arch(0xC000003E, 41, (248, 249, 250)),
    "aarch64": _Arch(0xC00000B7, 198, (217, 218, 219)),
    "arm64": _Arch(0xC00000B7, 198, (217, 218, 219)),
}


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)  # struct sock_filter


def seccomp_filter(machine: str) -> bytes | None:
    """The seccomp program: `socket(AF_UNIX, ...)`, `io_uring_setup` (its requests would pass the
    filter) and the kernel's keyrings (`add_key`, `request_key`, `keyctl`: shared by every process of
    a user, root's too, and `request_key` starts a helper outside the sandbox) fail with EPERM; a call
    of another ABI (32-bit, x32, whose numbers differ) kills the process; the rest is allowed. None for
    a machine it is not written for."""
    if machine not in _ARCHES:
        return None
    arch = _ARCHES[machine]
    denied = (_IO_URING_SETUP, *arch.keys)
    n = len(denied)
    return b"".join(
        [
            _op(_LD_ABS, 4),  # 0: seccomp_data.arch
            _op(_JEQ, arch.audit, 1, 0),  # 1
            _op(_RET, _KILL_PROCESS),  # 2: another ABI
            _op(_LD_ABS, 0),  # 3: seccomp_data.nr
            _op(_JGE, _X32_BIT, 0, 1),  # 4
            _op(_RET, _KILL_PROCESS),  # 5: x32
            *(_op(_JEQ, nr, 3 + n - i, 0) for i, nr in enumerate(denied)),  # 6..: -> EPERM
            _op(_JEQ, arch.socket, 0, 2),  # 6+n: not socket -> allow
            _op(_LD_ABS, 16),  # 7+n: args[0], its low 32 bits (little-endian)
            _op(_JEQ, _AF_UNIX, 1, 0),  # 8+n: AF_UNIX -> EPERM
            _op(_RET, _ALLOW),  # 9+n
            _op(_RET, _ERRNO | _EPERM),  # 10+n
        ]
    )


# --- macOS: sandbox-exec -----------------------------------------------------------------------------


def seatbelt_profile(sandbox: Sandbox, temp: Path) -> str:
    """The `sandbox-exec` profile: everything allowed but writes outside the workspace and `temp` (the
    call's private temp folder), `.git`, the shared temp folders, unix sockets outside the workspace,
    other processes, and (unless allowed) the network. Later rules win over earlier ones."""
    own = [*sandbox.folders(), temp]
    shared_temp = list(dict.fromkeys([Path("/private/tmp"), Path(tempfile.gettempdir()).resolve()]))
    lines = [
        "(version 1)",
        "(allow default)",
        "(deny file-write*)",
        f'(allow file-write* {_subpaths(own)} (literal "/dev/null") (literal "/dev/tty") (regex #"^/dev/fd/"))',
        f"(deny file-read* file-write* {_subpaths(shared_temp)})",
        f"(allow file-read* file-write* {_subpaths([temp])})",
    ]
    if gits := [git for folder in sandbox.folders() for git in protected(folder)]:
        lines.append(f"(deny file-write* {_subpaths(gits)})")
    lines += ["(deny process-info*)", "(allow process-info* (target same-sandbox))"]
    lines += ["(deny signal)", "(allow signal (target same-sandbox))"]
    sockets = " ".join(f'(remote unix-socket (subpath "{_quoted(f)}"))' for f in own)
    if sandbox.network:  # the DNS resolver is a unix socket on macOS
        sockets += ' (remote unix-socket (path-literal "/private/var/run/mDNSResponder"))'
    binds = " ".join(f'(local unix-socket (subpath "{_quoted(f)}"))' for f in own)
    lines += ["(deny network-outbound (remote unix-socket))", "(deny network-bind (local unix-socket))"]
    lines += [] if sandbox.network else ["(deny network*)"]
    lines += [f"(allow network-outbound {sockets})", f"(allow network-bind {binds})"]
    return "\n".join(lines) + "\n"


def _seatbelt(args: Sequence[str], sandbox: Sandbox) -> list[str]:
    tool = shutil.which("sandbox-exec") or ("/usr/bin/sandbox-exec" if Path("/usr/bin/sandbox-exec").exists() else None)
    if tool is None:
        raise ToolError(f"{LEAD}'sandbox-exec' is missing (it ships with macOS); {OFF_HINT}")
    temp = Path(tempfile.mkdtemp(prefix="mlx-subagents-sandbox-")).resolve()
    run_then_clean = 'TMPDIR="$0"; export TMPDIR; "$@"; status=$?; rm -rf "$0"; exit $status'
    return [tool, "-p", seatbelt_profile(sandbox, temp), "/bin/sh", "-c", run_then_clean, str(temp), *args]


def _subpaths(paths: Sequence[Path]) -> str:
    return " ".join(f'(subpath "{_quoted(path)}")' for path in dict.fromkeys(paths))


def _quoted(path: Path) -> str:
    return str(path).replace("\\", "\\\\").replace('"', '\\"')
