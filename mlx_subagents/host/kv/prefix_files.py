"""The prefix folder's files: where they live, how big the folder may grow, and which files are its own.

A prefix file (`PrefixStore` writes them) lives in `$MLX_SUBAGENTS_HOME/cache/prefixes/`. Only files
the store wrote are ever deleted (by eviction or `cache clear`): a name it gives (`<40 hex
digits>.safetensors`, or its temporary `tmp-<pid>-<thread>-<that>.safetensors`) and, for a finished
file, its own header (`format` and `key` in the metadata). A folder that is a symbolic link, or lies
under one in the state folder, is never used: its files might be a model's weights. A header is read
through the guarded reader (a FIFO named like a prefix file never blocks), and a damaged one is one
line naming the file.

Nothing here imports mlx: `subagent cache` and `subagent doctor` read the folder without it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import ByteSize, TypeAdapter, ValidationError

from ...errors import DamagedStateError, RequestError
from ...home import state_home
from ...userfiles import linked_part, open_regular

SUFFIX = ".safetensors"
TEMP_PREFIX = "tmp-"
# The names the store gives its files (`PrefixStore.path_for`, `_write`): nothing else is ever deleted.
PREFIX_NAME = re.compile(r"[0-9a-f]{40}\.safetensors")
TEMP_NAME = re.compile(r"tmp-\d+-\d+-[0-9a-f]{40}\.safetensors")
MAX_HEADER_BYTES = 2**24
# The default bound: this share of the free disk where the folder is, at most DEFAULT_MAX_BYTES.
DEFAULT_DISK_SHARE = 0.05
DEFAULT_MAX_BYTES = 4 * 2**30
# Temporary files older than this are left over from a process that died mid-write.
STALE_TEMP_S = 600.0
_BYTE_SIZE = TypeAdapter(ByteSize)
_BINARY = {"k": "KiB", "m": "MiB", "g": "GiB", "t": "TiB"}


def prefix_cache_dir() -> Path:
    """Where prefix files live: `cache/prefixes` in the state folder."""
    return state_home() / "cache" / "prefixes"


def parse_prefix_cache(text: str | int | None) -> int | None:
    """`--prefix-cache`: a size (`2GB`, `512MiB`, `512m`), `off` (or 0) for no disk tier, None for the default."""
    if text is None or isinstance(text, int):
        return text
    size = text.strip()
    if size.lower() in ("off", "0", "no", "false"):
        return 0
    if size[-1:].lower() in _BINARY:
        size = size[:-1] + _BINARY[size[-1].lower()]
    try:
        return int(_BYTE_SIZE.validate_python(size))
    except ValidationError:
        raise RequestError(f"--prefix-cache {text!r} is not a size; use e.g. 2GB, 512MiB or off") from None


def default_max_bytes(folder: Path) -> int:
    """A small share of the free disk under `folder`: DEFAULT_DISK_SHARE of it, at most DEFAULT_MAX_BYTES."""
    where = folder
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return 0
    return min(DEFAULT_MAX_BYTES, int(free * DEFAULT_DISK_SHARE))


def read_header(path: Path) -> dict[str, str]:
    """A prefix file's own metadata, read from its safetensors header without mlx, through the guarded
    reader; a `DamagedStateError` line naming the file when it is not one the store wrote (damaged,
    not a regular file, not a prefix file)."""
    fix = "delete it (subagent cache clear deletes only the files it wrote)"
    try:
        with open_regular(path, "prefix file", DamagedStateError, None, text=False) as file:
            (size,) = struct.unpack("<Q", file.read(8))
            if size > MAX_HEADER_BYTES:
                raise ValueError(f"a header of {size:,} bytes")
            header = json.loads(file.read(size))
    except (OSError, ValueError, struct.error, RecursionError) as exc:
        raise DamagedStateError(f"{path}: not a readable prefix file ({type(exc).__name__}); {fix}") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    # save_prompt_cache flattens [metadata, classes, scalars]: ours is under "0.".
    ours = {k[2:]: v for k, v in meta.items() if k.startswith("0.")} if isinstance(meta, dict) else {}
    if not all(isinstance(v, str) for v in ours.values()) or not {"key", "format"} <= ours.keys():
        raise DamagedStateError(f"{path}: not a prefix file this tool wrote (no key and format in its header); {fix}")
    if not ours.get("n_tokens", "0").isdigit():
        raise DamagedStateError(f"{path}: a damaged prefix file (its token count is {ours['n_tokens']!r}); {fix}")
    return ours


def folder_problem(folder: Path) -> str | None:
    """Why prefix files must not be kept in (or deleted from) `folder`: it is a symbolic link, or lies
    under one in the state folder, so its files could be anything (a model's weights); None if fine."""
    home = state_home()
    link = linked_part(home, folder.relative_to(home)) if folder.is_relative_to(home) else None
    if link is None and folder.is_symlink():
        link = folder
    if link is None:
        return None
    return f"{link} is a symbolic link; make {folder} a real folder (the prefix cache never follows a link)"


def _own_files(folder: Path, warn: Callable[[str], None] | None = None) -> list[tuple[Path, os.stat_result, bool]]:
    """`(path, stat, temporary)` of each file in `folder` the store wrote: named as it names them and,
    for a finished file, with its header; each other file named like one is a `warn` line."""
    found = []
    for path in folder.glob(f"*{SUFFIX}"):
        temporary = TEMP_NAME.fullmatch(path.name) is not None
        if not temporary and PREFIX_NAME.fullmatch(path.name) is None:
            continue
        try:
            info = path.lstat()
            if not temporary:
                read_header(path)
        except DamagedStateError as exc:
            if warn is not None:
                warn(f"skipped {exc}")
            continue
        except OSError:
            continue  # deleted meanwhile (another process evicted it)
        found.append((path, info, temporary))
    return found


@dataclass(frozen=True)
class StoredPrefix:
    """One prefix file as `subagent cache` lists it."""

    path: Path
    model: str
    n_tokens: int
    nbytes: int
    last_used: float


def list_prefixes(folder: Path | None = None, warn: Callable[[str], None] | None = None) -> list[StoredPrefix]:
    """The prefix files in `folder` (default the state folder's), most recently used first; a file that
    is not one (damaged, a FIFO) is one `warn` line, and a linked folder is one `RequestError` line."""
    folder = folder or prefix_cache_dir()
    if not folder.is_dir():
        return []
    if problem := folder_problem(folder):
        raise RequestError(problem)
    found = []
    for path, info, temporary in _own_files(folder, warn):
        if temporary:
            continue
        try:
            meta = read_header(path)
        except DamagedStateError:
            continue  # changed since it was checked
        found.append(
            StoredPrefix(path, meta.get("model", "?"), int(meta.get("n_tokens", "0")), info.st_size, info.st_mtime)
        )
    return sorted(found, key=lambda p: p.last_used, reverse=True)


def clear_prefixes(folder: Path | None = None, warn: Callable[[str], None] | None = None) -> tuple[int, int]:
    """Delete every prefix file the store wrote (and leftover temporary file); (files, bytes) freed.
    Other files are left where they are (`warn`: one line each); a linked folder is refused in one line."""
    folder = folder or prefix_cache_dir()
    if not folder.is_dir():
        return 0, 0
    if problem := folder_problem(folder):
        raise RequestError(f"the prefix cache was not cleared: {problem}")
    n = freed = 0
    for path, info, _ in _own_files(folder, warn):
        try:
            path.unlink()
        except OSError:
            continue
        n, freed = n + 1, freed + info.st_size
    return n, freed


def evict(folder: Path, max_bytes: int, now: float | None = None) -> int:
    """Delete least recently used prefix files (the store's own) until the folder holds at most
    `max_bytes`; files deleted."""
    now = time.time() if now is None else now
    entries = []
    for path, info, temporary in _own_files(folder):
        if temporary:
            if now - info.st_mtime > STALE_TEMP_S:
                path.unlink(missing_ok=True)
            continue
        entries.append((info.st_mtime, info.st_size, path))
    total = sum(size for _, size, _ in entries)
    deleted = 0
    for _, size, path in sorted(entries):
        if total <= max_bytes:
            break
        path.unlink(missing_ok=True)
        total, deleted = total - size, deleted + 1
    return deleted
