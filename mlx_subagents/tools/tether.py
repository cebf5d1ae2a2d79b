"""The tether: every command a tool starts dies with the process that started it, however that dies.

The tool kills a command's process group (and the processes carrying its mark) when the command
ends, times out or is cancelled, and on Ctrl-C, SIGTERM and SIGHUP. A process killed with SIGKILL (or
crashing) runs no handler: its commands used to live on, adopted by init, with no timeout left. So
each command starts under this small supervisor (`command.py`), which holds the read end of a pipe
whose write end only the tool's process holds (`processes.lifeline`). When that process dies, however
it dies, the kernel closes the write end and the supervisor reads end-of-file: it kills its process
group, and on Linux, where it is a child subreaper (orphans are given to it, not to init), every
process that descends from it, also one that left the group with `setsid` and wiped its environment.
The supervisor exits with its command's status, and its process group is the command's, so the
tool's own kills, the sweep and the time-outs work as before. On Linux it also kills what its command
left (every descendant) when the command ends, and when the tool asks it to (`SWEEP_SIGNAL`, before a
timeout's or a cancel's group kill, which would kill the supervisor first): a process that left the
group and wiped its mark (`env -i setsid -f`) dies with the call, not only with the tool's process.

Run as a script (`python -I -S -c <this file's text> FD -- COMMAND...`) with the standard library only,
so it needs no path a sandbox can see and imports nothing from the environment.
"""

from __future__ import annotations

import ctypes
import os
import resource
import select
import signal
import sys
import time

_PR_SET_CHILD_SUBREAPER = 36
_ROUNDS = 200  # of find-and-kill, for processes forking while they are being killed
SEPARATOR = "--"
SWEEP_SIGNAL = signal.SIGUSR1  # the tool asks: kill everything, then this process


def main(argv: list[str]) -> None:
    """`FD -- COMMAND...`: run the command; kill it and all it started once FD reads end-of-file."""
    lifeline, command = int(argv[0]), argv[argv.index(SEPARATOR) + 1 :]
    os.set_inheritable(lifeline, False)
    subreaper = sys.platform == "linux" and _become_subreaper()
    woken_r, woken_w = os.pipe()
    os.set_blocking(woken_w, False)
    signal.set_wakeup_fd(woken_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    asked: list[int] = []
    signal.signal(SWEEP_SIGNAL, lambda *_: asked.append(1))
    child = os.fork()
    if child == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(woken_r)
        os.close(woken_w)
        try:
            os.execvp(command[0], command)
        except OSError as exc:
            sys.stderr.write(f"{command[0]}: {exc.strerror}\n")
            os._exit(127)
    _let_go_of_output()
    while True:
        ready, _, _ = select.select([lifeline, woken_r], [], [])
        if asked or (lifeline in ready and not os.read(lifeline, 1)):
            _kill_everything(subreaper)
        if woken_r in ready:
            os.read(woken_r, 512)
        if (status := _reap(child)) is not None:
            if subreaper:
                _kill_descendants()  # what the command left behind dies with it
            _exit_as(status)


def _become_subreaper() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _let_go_of_output() -> None:
    """Hold none of the command's pipes: the tool sees their end when the command's processes close them."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def _reap(child: int) -> int | None:
    """Reap every child that ended (orphans given to us too); the command's status once it ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return None
        if pid == 0:
            return None
        if pid == child:
            return status


def _exit_as(status: int) -> None:
    """Exit as the command did: its exit code, or killed by its signal (no core file left behind)."""
    if os.WIFSIGNALED(status):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _kill_everything(subreaper: bool) -> None:
    """The tool's process died, or asks: kill the group, and (a subreaper) every descendant, then this
    process."""
    if subreaper:
        _kill_descendants()
    os.killpg(0, signal.SIGKILL)


def _kill_descendants() -> None:
    """Kill every process of the group and every child (orphans are given to a subreaper, so each
    descendant is one once its parent is killed), round after round until none is left."""
    me, group = os.getpid(), os.getpgid(0)
    for _ in range(_ROUNDS):
        victims = [pid for pid, ppid, pgrp in _processes() if pid != me and (ppid == me or pgrp == group)]
        if not victims:
            break
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        _reap(-1)
        time.sleep(0.01)


def _processes() -> list[tuple[int, int, int]]:
    """`(pid, ppid, pgrp)` of every live process (`/proc/<pid>/stat`); zombies are dead."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields and fields[0] != b"Z":
            found.append((int(name), int(fields[1]), int(fields[2])))
    return found


if __name__ == "__main__":
    main(sys.argv[1:])
