"""The prefix store: the disk tier under the shared prefixes, so a new process starts warm.

A shared prefix (an agent's system prompt and tools) that a process prefilled is written to
`$MLX_SUBAGENTS_HOME/cache/prefixes/` as a safetensors file in mlx-lm's prompt-cache format, sliced to
the tokens it holds (quantized caches as they are: `--kv-bits` is part of the cache kind). A later
process whose prompt begins with the same token ids loads it and prefills only the rest. Besides an
agent's prefix, a conversation that asks for it (the chat endpoints') is stored up to the end of its
last message (`PrefillStage.store_prompt`), so a restarted server's first request goes on from it:
every file ends at a message boundary, and a prompt finds the longest file it starts with through the
lengths the folder holds (`longest`: one hash per stored length, no scan of the files). A conversation's
new file replaces the one it wrote at its turn before (`save(..., replaces=)`, deleted once the new one
is in place): the folder holds one file per conversation, not one per turn. The file
name is a hash of everything the cache's values depend on (the model's files, mlx and mlx-lm, the
device, the prefill step, the cache kind with its bits and group size, and the exact ids), and
the file records that key and a checksum of its arrays, so a stale, foreign or damaged file is never
used: it is deleted with one warning and the prefix is prefilled again.

Writes never wait on the disk, nor on a copy, in a decode step: the mlx thread hands the writer
thread evaluated views of the cache's buffers, cut to its tokens (`_held`: nothing copied; mlx copies a
buffer a view still holds before the session writes into it), and the writer makes them contiguous
(the one copy), writes a temporary file and renames it (a reader never sees half a file), then deletes
the least recently used files past the bound. A folder that cannot be written turns
the tier off with one warning; the run goes on.

Only files this store wrote are ever deleted (by eviction or `cache clear`): a name it gives
(`<40 hex digits>.safetensors`, or its temporary `tmp-<pid>-<thread>-<that>.safetensors`) and, for a
finished file, its own header (`format` and `key` in the metadata). A folder that is a symbolic link,
or lies under one in the state folder, is never used: its files might be a model's weights. A header
is read through the guarded reader (a FIFO named like a prefix file never blocks), and a damaged one
is one line naming the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import shutil
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ByteSize, TypeAdapter, ValidationError

from ...errors import DamagedStateError, RequestError
from ...home import state_home
from ...userfiles import linked_part, open_regular

if TYPE_CHECKING:
    from .kinds import CacheKind

log = logging.getLogger("mlx_subagents.prefix_cache")

FORMAT_VERSION = "1"
SUFFIX = ".safetensors"
TEMP_PREFIX = "tmp-"
# The names this store gives its files (`path_for`, `_write`): nothing else is ever deleted.
PREFIX_NAME = re.compile(r"[0-9a-f]{40}\.safetensors")
TEMP_NAME = re.compile(r"tmp-\d+-\d+-[0-9a-f]{40}\.safetensors")
MAX_HEADER_BYTES = 2**24
# Prefixes shorter than this prefill in well under the time a file costs to find and read.
DEFAULT_MIN_PREFIX_TOKENS = 256
# The default bound: this share of the free disk where the folder is, at most DEFAULT_MAX_BYTES.
DEFAULT_DISK_SHARE = 0.05
DEFAULT_MAX_BYTES = 4 * 2**30
# Temporary files older than this are left over from a process that died mid-write.
STALE_TEMP_S = 600.0
# How long a stopping host waits for its queued writes (a prefix file is written in well under a second).
WRITER_DRAIN_S = 30.0
# Files read in full (and hashed) for the model's identity; weights are named by name, size and mtime.
_SMALL_FILE_BYTES = 64 * 2**20
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".npz")
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


def model_identity(model_path: Path) -> str:
    """A hash of the model folder: weights by name, size, mtime and blob name; the rest by content.

    Hashing gigabytes of weights at every start would cost more than the prefill it saves; a file
    that changes in place changes its size or mtime, and a hub cache's files are links to blobs named
    by their own hash.
    """
    digest = hashlib.sha256()
    for path in sorted(p for p in model_path.iterdir() if p.is_file()):
        stat = path.stat()
        digest.update(path.name.encode() + b"\0")
        if path.name.endswith(_WEIGHT_SUFFIXES) or stat.st_size > _SMALL_FILE_BYTES:
            digest.update(f"{stat.st_size}:{stat.st_mtime_ns}:{path.resolve().name}".encode())
        else:
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def cache_kind(cache: list[Any]) -> str | None:
    """The layer kinds of a fresh cache as stored (`CacheKind.stored_as`: a sliding window's size, a
    quantized layer's bits and group size); None if one cannot be stored (a kind the host does not know)."""
    from .kinds import kind_of

    kinds = [kind_of(layer) for layer in cache]
    if any(kind is None for kind in kinds):
        return None
    return ",".join(kind.stored_as(layer) for kind, layer in zip(kinds, cache, strict=True))  # type: ignore[union-attr]


def _checksum(cache: list[Any]) -> str:
    """CRC32 of every array of the cache's state, in order (detects a damaged file, fast)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    crc = 0
    for _, value in tree_flatten([c.state for c in cache]):
        if isinstance(value, mx.array):
            crc = zlib.crc32(f"{value.shape}{value.dtype}".encode(), crc)
            crc = zlib.crc32(memoryview(value), crc) if value.size else crc  # contiguous: as written or loaded
    return f"{crc:08x}"


# What a cache holds, as the mlx thread hands it to the writer: each layer's kind and its state, as views.
Held = list[tuple["CacheKind", list[Any]]]


def _upto(tensor: Any, n: int) -> Any:
    """`tensor` cut to its first `n` tokens (quantized: packed values, scales and biases each cut alike)."""
    import mlx.core as mx

    return tensor[..., :n, :] if isinstance(tensor, mx.array) else tuple(p[..., :n, :] for p in tensor)


def _contiguous(values: list[Any]) -> list[Any]:
    import mlx.core as mx

    return [mx.contiguous(v) if isinstance(v, mx.array) else v for v in values]


def _held(cache: list[Any]) -> Held:
    """What the cache holds, for the writer thread (mlx thread): each layer's kind and state, its buffers
    cut to their offset, as views of the cache's own buffers, evaluated here (a slice shares its buffer:
    nothing is copied). The session writes its buffers in place after this (mlx-lm's slice assignment),
    but mlx writes in place only into a buffer no other array holds: while a view holds it, the write
    copies it first (the session's, on this thread), so a view keeps what it saw."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map

    from .kinds import kind_of

    def length(tensor: Any) -> int:
        return int((tensor if isinstance(tensor, mx.array) else tensor[0]).shape[2])

    held = []
    for layer in cache:
        # Its own lists: a recurrent layer's state is the list the layer itself goes on writing.
        state = list(tree_map(lambda v: v, list(layer.state)))
        kind = kind_of(layer)
        assert kind is not None  # a stored cache's kinds are known (`cache_kind`)
        # A dense buffer grows in steps past its offset; a sliding window's too until it first wraps.
        if kind.grows(layer) and layer.keys is not None and layer.offset < length(layer.keys):
            state[0], state[1] = _upto(layer.keys, layer.offset), _upto(layer.values, layer.offset)
        held.append((kind, state))
    mx.eval([v for _, v in tree_flatten([state for _, state in held]) if isinstance(v, mx.array)])
    return held


def _copied(held: Held) -> list[Any]:
    """The layers `_held` gave, holding exactly what they held, contiguous and evaluated (writer thread:
    the one copy a stored prefix costs, made here from arrays the mlx thread evaluated, never from one
    it left pending, which another thread cannot evaluate)."""
    import mlx.core as mx

    out = []
    for kind, views in held:
        state = _contiguous(views)
        if kind.packed:  # its tensors (and a shared prefix's after them) are triples
            state = [tuple(_contiguous(list(v))) if isinstance(v, (tuple, list)) else v for v in state]
        if kind.size == "fixed":  # its state is (the list of recurrent arrays, padding, lengths)
            state[0] = _contiguous(state[0])
        out.append(kind.cls.from_state(state))
    mx.eval([c.state for c in out])
    return out


def read_header(path: Path) -> dict[str, str]:
    """A prefix file's own metadata, read from its safetensors header without mlx, through the guarded
    reader; a `DamagedStateError` line naming the file when it is not one this store wrote (damaged,
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
    """`(path, stat, temporary)` of each file in `folder` this store wrote: named as it names them and,
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
class StoredPrompt:
    """What a session last stored of its conversation (`PrefillStage.store_prompt`): its file, its tokens,
    the text they are the tokens of, and whether they are all of that text's tokens as a new process
    tokenizes it (`whole`): the next turn then tokenizes only the text after it, and its file replaces
    this one."""

    path: Path
    n_tokens: int
    text: str
    whole: bool


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
    """Delete every prefix file this store wrote (and leftover temporary file); (files, bytes) freed.
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
    """Delete least recently used prefix files (this store's own) until the folder holds at most
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


class PrefixStore:
    """The disk tier of one host: finds, loads and (through its writer thread) saves prefix files.

    `load` and `save` run on the mlx thread; the writer thread copies and writes arrays it evaluated.

    Args:
        identity: what every key of this host shares besides the cache kind (model files, versions,
            device, prefill step).
        kind: the model's cache kind (`cache_kind`): part of the key, and what a loaded file must hold.
        model: the model's name, recorded for `subagent cache`.
    """

    def __init__(
        self,
        folder: Path,
        max_bytes: int,
        identity: str,
        kind: str,
        model: str,
        *,
        min_tokens: int = DEFAULT_MIN_PREFIX_TOKENS,
    ) -> None:
        self.folder = folder
        self.max_bytes = max_bytes
        self.identity = f"{identity}|{kind}"
        self.layers = [k.split(":")[0] for k in kind.split(",")]
        self.model = model
        self.min_tokens = min_tokens
        self.enabled = max_bytes > 0
        self.loads = self.writes = self.rejected = 0
        self._queue: queue.SimpleQueue[tuple[Path, Held | None, dict[str, str], Path | None] | None] = (
            queue.SimpleQueue()
        )
        self._pending = 0
        self._idle = threading.Condition()
        self._writer: threading.Thread | None = None
        self._lengths: tuple[int, frozenset[int]] = (-1, frozenset())  # (the folder's mtime, its files' lengths)
        if self.enabled and (problem := folder_problem(folder)):
            self._disable(problem)
        if self.enabled:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                if not os.access(folder, os.W_OK):
                    raise PermissionError("permission denied")
                evict(folder, max_bytes)  # a bound lowered since the last run holds from the start
            except OSError as exc:
                self._disable(f"cannot write the prefix cache folder {folder}: {exc.strerror or exc}")

    # -- keys -------------------------------------------------------------------

    def key(self, ids: list[int]) -> str:
        digest = hashlib.sha256(f"{FORMAT_VERSION}\0{self.identity}\0".encode())
        digest.update(struct.pack(f"<{len(ids)}q", *ids))
        return digest.hexdigest()

    def path_for(self, ids: list[int]) -> Path:
        return self.folder / f"{self.key(ids)[:40]}{SUFFIX}"

    def wants(self, ids: list[int]) -> bool:
        return self.enabled and len(ids) >= self.min_tokens

    # -- mlx thread ---------------------------------------------------------------

    def load(self, ids: list[int]) -> list[Any] | None:
        """The cache holding exactly `ids`, from its file; None when there is none or it is bad (then deleted)."""
        from .kv_bits import load_prompt_cache

        if not self.wants(ids):
            return None
        path = self.path_for(ids)
        if path.is_symlink() or not path.is_file():  # never a link (this store writes none) nor a FIFO
            return None
        try:
            cache, meta = load_prompt_cache(str(path), return_metadata=True)
            problem = self._check(cache, meta, ids)
        except Exception:  # a truncated or foreign file: mx.load and from_state raise many kinds
            if not path.exists():  # another process evicted it after we looked: simply not stored
                return None
            problem = "it cannot be read (truncated, or not a prefix file)"
        if problem:
            self.rejected += 1
            log.warning(f"prefix cache: deleted {path} because {problem}; the prefix is prefilled again")
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # last used: eviction goes by mtime
        except OSError:
            pass
        self.loads += 1
        return cache

    def longest(self, ids: list[int], above: int = 0, lengths: tuple[int, ...] = ()) -> tuple[int, list[Any]] | None:
        """The longest stored prefix of `ids` (all but the last token at most) longer than `above` tokens,
        of the lengths stored and `lengths`: its length and its cache, loaded; None when none is stored."""
        if not self.enabled:
            return None
        candidates = self.stored_lengths() | set(lengths)
        for n in sorted((n for n in candidates if above < n < len(ids)), reverse=True):
            cache = self.load(ids[:n])
            if cache is not None:
                return n, cache
        return None

    def stored_lengths(self) -> frozenset[int]:
        """The token counts of the prefix files in the folder (any model's: a key tells them apart), read
        again only when the folder changed (a file written, renamed or deleted changes its mtime)."""
        try:
            stamp = self.folder.stat().st_mtime_ns
        except OSError:
            return frozenset()
        if stamp != self._lengths[0]:
            try:
                self._lengths = (stamp, frozenset(p.n_tokens for p in list_prefixes(self.folder)))
            except (OSError, RequestError):
                return frozenset()
        return self._lengths[1]

    def _check(self, cache: list[Any], meta: dict[str, str], ids: list[int]) -> str | None:
        from .kinds import kind_of

        if meta.get("key") != self.key(ids):
            return "it was written for another model, version or prompt"
        if [type(c).__name__ for c in cache] != self.layers:
            return "its layers disagree with the model's cache"
        if int(meta.get("n_tokens", -1)) != len(ids) or any(
            c.offset != len(ids) for c in cache if (kind := kind_of(c)) is not None and kind.dense
        ):
            return "its shapes disagree with the tokens it records"
        if meta.get("checksum") != _checksum(cache):
            return "its checksum disagrees (the file is damaged)"
        return None

    def save(self, ids: list[int], cache: list[Any], replaces: Path | None = None) -> None:
        """Queue what `cache` holds (exactly `ids`) for the writer, as views of its buffers: the mlx thread
        copies nothing, the writer makes the one copy it writes (`_held`, `_copied`). `replaces`: a file of this store the new one supersedes (a conversation's at its turn before),
        deleted once the new file is in place (or at once, when the new one is stored already)."""
        if not self.wants(ids):
            return
        path = self.path_for(ids)
        held = None if path.exists() else _held(cache)
        if held is None and replaces is None:
            return
        meta = {"key": self.key(ids), "model": self.model, "n_tokens": str(len(ids)), "format": FORMAT_VERSION}
        with self._idle:
            self._pending += 1
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="prefix-writer", daemon=True)
            self._writer.start()
        self._queue.put((path, held, meta, replaces))

    # -- writer thread ------------------------------------------------------------

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                path, held, meta, replaces = item
                if self.enabled and held is not None:
                    self._write(path, _copied(held), meta)
                if replaces is not None and replaces != path and path.exists() and self._owns(replaces):
                    replaces.unlink(missing_ok=True)
            except Exception as exc:
                self._disable(f"cannot write the prefix cache in {self.folder}: {exc}")
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _write(self, path: Path, cache: list[Any], meta: dict[str, str]) -> None:
        from mlx_lm.models.cache import save_prompt_cache

        meta = {**meta, "checksum": _checksum(cache)}
        if sum(c.nbytes for c in cache) > self.max_bytes:
            return  # larger than the whole bound: keeping it would evict everything else
        temp = self.folder / f"{TEMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{path.name}"
        try:
            save_prompt_cache(str(temp), cache, metadata=meta)
            os.replace(temp, path)  # atomic: a reader sees the old name absent or the whole file
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        self.writes += 1
        evict(self.folder, self.max_bytes)

    def _owns(self, path: Path) -> bool:
        """Whether `path` is a finished file of this store's folder, by its name (never anything else)."""
        return path.parent == self.folder and PREFIX_NAME.fullmatch(path.name) is not None

    def flush(self, timeout: float = WRITER_DRAIN_S) -> None:
        """Wait (at most `timeout`) for queued writes: a process that ends right after its run keeps them."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout=1.0)
            self._writer = None

    def _disable(self, reason: str) -> None:
        if self.enabled:
            self.enabled = False
            log.warning(f"prefix cache off: {reason}; the run goes on without it (see `subagent cache`)")
