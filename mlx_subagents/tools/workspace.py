"""Path confinement: every path a tool touches resolves inside one workspace root.

Paths are checked after resolving symlinks (for a file that does not exist yet, its existing
parents are resolved), so `..`, absolute paths and symlinks cannot reach outside the root.
Also the walking and glob matching shared by `grep` and `find`.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

from wcmatch import glob as wcglob

from ..errors import ToolError, WorkspaceEscapeError
from .threads import checkpoint

BINARY_SNIFF_BYTES = 8192
# rg's glob rules on `/` paths, case-sensitive on every platform (wcmatch follows the OS by default).
GLOB_FLAGS = wcglob.GLOBSTAR | wcglob.BRACE | wcglob.DOTGLOB | wcglob.CASE | wcglob.FORCEUNIX
# wcmatch makes a reversed range like `[z-a]` match nothing; rg refuses the glob, and so do we.
BRACKET = re.compile(r"(?<!\\)\[[!^]?(\]?[^\]]*)\]")
RANGE = re.compile(r"(.)-(.)")


@dataclass(frozen=True)
class Workspace:
    """The folder a session's tools may read and write; `root` is stored resolved."""

    root: Path
    # An agent's memory folder, the one place outside the root its tools may reach (`agents/memory.py`).
    memory: Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root).expanduser().resolve())
        if self.memory is not None:
            object.__setattr__(self, "memory", Path(self.memory).expanduser().resolve())

    def resolve(self, path: str) -> Path:
        """The real absolute path for `path` (relative to root); raises if it leaves the root."""
        try:
            requested = self.root / Path(path).expanduser()
            real = requested.resolve()  # `..` after a symlink climbs from its target, like the OS
        except (ValueError, RuntimeError) as exc:  # NUL byte, symlink loop, unknown ~user
            raise ToolError(f"invalid path {path!r}: {exc}; use a plain path inside {self.root}") from None
        if real.is_relative_to(self.root) or (self.memory is not None and real.is_relative_to(self.memory)):
            return real
        lexical = Path(os.path.normpath(requested))
        via = f" (it is a symlink to {real})" if lexical.is_relative_to(self.root) else ""
        raise WorkspaceEscapeError(f"path {path!r} is outside the workspace {self.root}{via}; use a path inside it")

    def existing(self, path: str, kind: Literal["file", "directory"] | None = None) -> Path:
        """Resolve `path` and check that it exists (as a file or directory when `kind` says so)."""
        real = self.resolve(path)
        if not real.exists():
            raise ToolError(f"path {path!r} does not exist in the workspace; use ls or find to see what is there")
        if kind == "file" and real.is_dir():
            raise ToolError(f"{path!r} is a directory, not a file; use ls to list it")
        if kind == "file" and not real.is_file():
            raise ToolError(f"{path!r} is not a regular file")
        if kind == "directory" and not real.is_dir():
            raise ToolError(f"{path!r} is a file, not a directory; use read to read it")
        return real

    def walk(self, directory: Path, glob: str | None, *, skip_hidden: bool) -> Iterator[Path]:
        """Files under `directory` whose path from the root (as shown) matches `glob`, like rg.

        A bad glob raises `ToolError` here, before the walk starts."""
        files = walk_files(directory, skip_hidden=skip_hidden)
        if glob is None:
            return files
        matcher = glob_matcher(glob)
        return (file for file in files if matcher(self.relative(file)))

    def relative(self, path: Path | str) -> str:
        """`path` as shown to the model: relative to root with `/`, `.` for the root itself."""
        path = Path(path)
        if not path.is_absolute() or not path.is_relative_to(self.root):
            return str(path)
        return path.relative_to(self.root).as_posix() or "."


def walk_files(directory: Path, *, skip_hidden: bool) -> Iterator[Path]:
    """Files under `directory` in name order per folder (like `rg --sort path`).

    Never enters `.git` and never follows or yields symlinks, so a link cannot lead the walk
    outside the workspace; unreadable folders are skipped. A stopped tool call stops here.
    """
    checkpoint()
    try:
        with os.scandir(directory) as scan:
            entries = sorted(scan, key=lambda entry: entry.name)
    except OSError:
        return
    for entry in entries:
        hidden = entry.name.startswith(".")
        if entry.name == ".git" or (skip_hidden and hidden) or entry.is_symlink():
            continue
        if entry.is_dir(follow_symlinks=False):
            yield from walk_files(Path(entry.path), skip_hidden=skip_hidden)
        elif entry.is_file(follow_symlinks=False):
            yield Path(entry.path)


def open_regular(path: Path, shown: str, *, write: bool = False) -> BinaryIO:
    """Open a regular file for reading, or for writing (created if missing, then emptied).

    A FIFO, device or socket is refused before anything blocks on it: the open does not wait
    (O_NONBLOCK) and the opened file is checked, so a swap after an earlier check changes nothing.
    """
    flags = (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY) | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # ENXIO: a FIFO with no reader, opened for writing
            raise
        fd = None
    if fd is None or not stat.S_ISREG(os.fstat(fd).st_mode):
        if fd is not None:
            os.close(fd)
        raise ToolError(f"{shown!r} is not a regular file (a FIFO, device or socket); tools only use regular files")
    os.set_blocking(fd, True)
    if write:
        os.ftruncate(fd, 0)
    return os.fdopen(fd, "wb" if write else "rb")


@functools.lru_cache(maxsize=64)
def glob_matcher(pattern: str) -> Callable[[str], bool]:
    """A test for `/`-separated relative paths against a glob, the way `rg --glob` matches.

    A pattern without `/` matches the file name at any depth (`*.py`); otherwise it matches the
    whole path, where `**` spans folders (`src/**/*.py`), `*` and `?` stay within one, `[abc]` and
    `{py,md}` work as in the shell, and dot files are not special. A pattern that cannot match as
    written (a reversed range, too many brace alternatives) raises `ToolError`.
    """
    pattern = pattern.removeprefix("./").lstrip("/")
    for members in BRACKET.findall(pattern):
        for low, high in RANGE.findall(members):
            if low > high:
                raise ToolError(f"invalid glob {pattern!r}: the range '{low}-{high}' is reversed; write '{high}-{low}'")
    try:
        matcher = wcglob.compile(pattern, flags=GLOB_FLAGS)
    except Exception as exc:  # e.g. wcmatch's PatternLimitException (not exported) for `{1..100000}`
        raise ToolError(f"invalid glob {pattern!r}: {exc}; use a simpler pattern") from None
    if "/" in pattern:
        return matcher.match
    return lambda path: matcher.match(path.rsplit("/", 1)[-1])
