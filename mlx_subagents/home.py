"""The state folder, `$MLX_SUBAGENTS_HOME` (default `~/.mlx-subagents`): saved runs, user agents, workflows.

One place reads the environment variable, so every module agrees on where the folder is, and one
place creates folders in it, so a home that is a file or read-only is one line, not a traceback, and
the home is the user's alone (0700) whatever the umask (`keep_private`).
Small files that other processes read while they change (`write_whole`) are written whole.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
from pathlib import Path

from .errors import StateHomeError
from .userfiles import os_reason

HOME_ENV = "MLX_SUBAGENTS_HOME"
DEFAULT_HOME = "~/.mlx-subagents"
# The longest name a person or a model may give (an agent, a task label, an imported model): every
# name that reaches the disk stays far inside a file system's 255-byte limit, prefixes included.
MAX_NAME_CHARS = 64
# The longest part of a file name made from a name (`file_name`); the rest of 255 is for prefixes.
MAX_FILE_NAME_CHARS = 80
_UNSAFE_IN_NAMES = re.compile(r"[^A-Za-z0-9_.-]+")


def state_home() -> Path:
    """`$MLX_SUBAGENTS_HOME`, default `~/.mlx-subagents`."""
    return Path(os.environ.get(HOME_ENV) or DEFAULT_HOME).expanduser()


def write_whole(path: Path, text: str, *, private: bool = False) -> None:
    """Write `path` whole: a `.part` file beside it, renamed over it, so a reader (another process)
    never sees half of it. `private`: the user's alone (0600) from its creation, never readable by
    others for a moment. An `OSError` is the caller's to handle."""
    partial = path.with_suffix(".part")
    mode = 0o600 if private else 0o666  # 0o666: the umask decides, as for any new file
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        if private:
            os.fchmod(fd, 0o600)  # a `.part` left behind keeps its mode through O_CREAT: set it
        out.write(text)
    os.replace(partial, path)


def make_state_dir(path: Path, *, home: Path | None = None, exist_ok: bool = True) -> Path:
    """Create `path` (and its parents) inside the state folder; one `StateHomeError` line if that fails.

    Args:
        home: the state folder `path` lies in, named in the error (default `state_home()`).
    """
    where = home or state_home()
    try:
        if path.absolute().is_relative_to(where.absolute()):
            keep_private(where)
        path.mkdir(parents=True, exist_ok=exist_ok)
    except OSError as exc:
        raise StateHomeError(
            f"cannot save in the state folder {where}: {os_reason(exc)}; set {HOME_ENV} to a writable folder"
        ) from None
    return path


def keep_private(home: Path) -> None:
    """Make the state folder the user's alone (0700) before anything is put in it: made so if missing,
    closed if the umask or an older version left it open. What the agents saw (transcripts, logs,
    worktrees, the server's files) is reached only through it, so no other user reads any of it,
    whatever the files' own modes. A folder another user owns is left as it is."""
    if home.exists() and not home.is_dir():  # mkdir would say "File exists" of a file in the way
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(home))
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(home)
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        os.chmod(home, st.st_mode & 0o700)  # others lose every right; the owner keeps theirs


def file_name(name: str, default: str = "task") -> str:
    """The one rule for a name that becomes part of a file name: ASCII letters, digits, `_`, `.`, `-`
    (any other run of characters is `_`; no leading or trailing `.` or `_`), at most
    `MAX_FILE_NAME_CHARS`; a longer name is cut and ends in 8 hex digits of its hash, so two long
    names stay two files. `default` when nothing is left.
    """
    safe = _UNSAFE_IN_NAMES.sub("_", name).strip("._") or default
    if len(safe) <= MAX_FILE_NAME_CHARS:
        return safe
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{safe[: MAX_FILE_NAME_CHARS - 9].rstrip('._')}-{digest}"


def long_name_problem(name: str, what: str) -> str | None:
    """`what 'xxxxxxxx...' is N characters, over the limit of 64; shorten it`, or None for a short name."""
    if len(name) <= MAX_NAME_CHARS:
        return None
    return f"{what} '{name[:MAX_NAME_CHARS]}...' is {len(name):,} characters, over the limit of {MAX_NAME_CHARS}; shorten it"
