"""Landlock for the bash sandbox: inside bubblewrap, before the command starts, the kernel is told that
nothing may be opened for writing, created, removed, renamed or truncated outside the writable folders.

A read-only mount stops writes to regular files only: a FIFO, a socket or a device node outside the
workspace still opens for writing on one (`echo x > outside/ctl.fifo` reaches whoever reads it).
Landlock checks every open for writing, whatever the file is, against the folders it was given, so the
wall holds by construction: a path is writable only beneath a folder named here (the workspace, the
sandbox's own `/tmp` and `/dev`). Its rules stay on every process the command starts and cannot be
dropped, also by a process that makes a user namespace of its own.

This file is run as a script (`python -I -S -c <this file's text> FOLDER... -- COMMAND...`) in the
sandbox, after bubblewrap has built it (a Landlock domain may not mount), with the standard library
only: nothing from the workspace or the environment is imported. `sandbox.py` passes its text, so it
needs no path the sandbox can see. Where the kernel has no Landlock, it exits 126 with one line, and
the sandbox's probe turns that into the tool's one-line refusal (it never runs the command without).
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys

# linux/landlock.h; the syscall numbers are the same on every architecture.
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_WRITE_FILE, _REMOVE_DIR, _REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
_MAKE = (
    (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10) | (1 << 11) | (1 << 12)
)  # char dir reg sock fifo block sym
_REFER, _TRUNCATE = 1 << 13, 1 << 14  # ABI 2 and 3
EXIT_NO_LANDLOCK = 126
SEPARATOR = "--"


def write_rights(abi: int) -> int:
    """Every right that changes the file system, as far as Landlock ABI `abi` knows them."""
    rights = _WRITE_FILE | _REMOVE_DIR | _REMOVE_FILE | _MAKE
    if abi >= 2:
        rights |= _REFER
    if abi >= 3:
        rights |= _TRUNCATE
    return rights


def restrict_writes(folders: list[str]) -> None:
    """Allow this process and its children to change the file system only beneath `folders`; raises
    `OSError` where the kernel cannot (no Landlock, or it is turned off)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long

    def call(number: int, *args: object) -> int:
        result = libc.syscall(ctypes.c_long(number), *args)
        if result < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        return result

    abi = call(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    rights = write_rights(abi)
    attr = ctypes.create_string_buffer(struct.pack("<Q", rights))  # struct landlock_ruleset_attr, fs only
    ruleset = call(_CREATE_RULESET, attr, ctypes.c_size_t(8), ctypes.c_uint32(0))
    for folder in folders:
        fd = os.open(folder, os.O_PATH | os.O_CLOEXEC)
        try:
            beneath = ctypes.create_string_buffer(struct.pack("<Qi", rights, fd))  # packed landlock_path_beneath_attr
            call(_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH), beneath, ctypes.c_uint32(0))
        finally:
            os.close(fd)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    call(_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0))
    os.close(ruleset)


def main(argv: list[str]) -> None:
    """`FOLDER... -- COMMAND...`: restrict writes to the folders, then become the command."""
    split = argv.index(SEPARATOR)
    folders, command = argv[:split], argv[split + 1 :]
    try:
        restrict_writes(folders)
    except OSError as exc:
        sys.stderr.write(f"this kernel cannot keep the sandbox's writes in the workspace (Landlock: {exc.strerror})\n")
        sys.exit(EXIT_NO_LANDLOCK)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
