"""The bash sandbox: a sandboxed `bash` call reads what the user can and writes only in its workspace
and the temp folder, without network unless the agent allows it.

Linux wraps the command in bubblewrap (`bwrap`: the whole file system bound read-only, the workspace
and the temp folder bound writable, a network namespace of its own); macOS in `sandbox-exec` with a
profile made here. The wrapped command keeps its process group and the call's mark in its environment
(no PID namespace of its own), so the sweep, time-outs, output caps and cancellation of `command.py`
reach it as they reach an unsandboxed call. Where neither tool works, a call fails closed with one
line saying how to install it or how to turn the sandbox off; it never runs unsandboxed.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ToolError

INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap)"
OFF_HINT = "or run this agent unsandboxed with --sandbox off (or 'sandbox: off' in a user agent's file)"
PROBE_TIMEOUT = 10.0


@dataclass(frozen=True)
class Sandbox:
    """What a sandboxed `bash` may do besides reading: write in `writable`, reach the network or not.

    Args:
        writable: the folders it may write (the workspace root; the temp folder is always added).
        network: whether it keeps the network (a coarse switch: all of it or none, no allow-list).
    """

    writable: tuple[Path, ...]
    network: bool = False

    def folders(self) -> list[Path]:
        """The writable folders, resolved, the temp folder among them, each once."""
        found = [*self.writable, Path(tempfile.gettempdir())]
        return list(dict.fromkeys(Path(p).resolve() for p in found))


def sandboxed(args: Sequence[str], sandbox: Sandbox) -> list[str]:
    """`args` wrapped in this platform's sandbox; raises `ToolError` (one line) where none works."""
    if sys.platform == "darwin":
        return _seatbelt(args, sandbox)
    return _bubblewrap(args, sandbox)


def _bubblewrap(args: Sequence[str], sandbox: Sandbox) -> list[str]:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise ToolError(f"bash is sandboxed for this agent but 'bwrap' is not on PATH; {INSTALL_HINT}, {OFF_HINT}")
    if problem := _bwrap_problem(bwrap):
        raise ToolError(f"bash is sandboxed for this agent but bubblewrap cannot run here ({problem}); {OFF_HINT}")
    wrapped = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--die-with-parent"]
    for folder in sandbox.folders():
        wrapped += ["--bind", str(folder), str(folder)]
    if not sandbox.network:
        wrapped.append("--unshare-net")
    return [*wrapped, "--", *args]


@functools.cache
def _bwrap_problem(bwrap: str) -> str:
    """Why this `bwrap` cannot make a sandbox (no user namespaces, say), "" when it can; asked once."""
    probe = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-net", "true"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=PROBE_TIMEOUT, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if done.returncode == 0:
        return ""
    return (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]


def seatbelt_profile(sandbox: Sandbox) -> str:
    """The `sandbox-exec` profile: everything allowed but writes outside the folders (and the network)."""
    folders = [*sandbox.folders(), Path("/private/tmp"), Path("/private/var/folders")]
    allowed = " ".join(f'(subpath "{_quoted(folder)}")' for folder in dict.fromkeys(folders))
    lines = [
        "(version 1)",
        "(allow default)",
        "(deny file-write*)",
        f'(allow file-write* {allowed} (literal "/dev/null") (literal "/dev/tty") (regex #"^/dev/fd/"))',
    ]
    if not sandbox.network:
        lines += ["(deny network*)", '(allow network* (remote unix-socket (path-regex #"^/")))']
    return "\n".join(lines) + "\n"


def _seatbelt(args: Sequence[str], sandbox: Sandbox) -> list[str]:
    tool = shutil.which("sandbox-exec") or ("/usr/bin/sandbox-exec" if Path("/usr/bin/sandbox-exec").exists() else None)
    if tool is None:
        raise ToolError(
            f"bash is sandboxed for this agent but 'sandbox-exec' is missing (it ships with macOS); {OFF_HINT}"
        )
    return [tool, "-p", seatbelt_profile(sandbox), *args]


def _quoted(path: Path) -> str:
    return str(path).replace("\\", "\\\\").replace('"', '\\"')
