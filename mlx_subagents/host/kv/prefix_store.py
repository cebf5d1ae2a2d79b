"""The prefix store: the disk tier under the shared prefixes, so a new process starts warm.

A shared prefix (an agent's system prompt and tools) that a process prefilled is written to
`$MLX_SUBAGENTS_HOME/cache/prefixes/` (`prefix_files.py`: the folder, its bound, the files it owns) as
a safetensors file in mlx-lm's prompt-cache format, sliced to the tokens it holds (quantized caches as
they are: `--kv-bits` is part of the cache kind). A later process whose prompt begins with the same
token ids loads it and prefills only the rest. Besides an agent's prefix, a conversation that asks for
it (the chat endpoints') is stored up to the end of its last message (`PrefillStage.store_prompt`), so
a restarted server's first request goes on from it: every file ends at a message boundary, and a
prompt finds the longest file it starts with through the lengths the folder holds (`longest`: one hash
per stored length, no scan of the files). A conversation's new file replaces the one it wrote at its
turn before (`save(..., replaces=)`, deleted once the new one is in place): the folder holds one file
per conversation, not one per turn. The file name is a hash of everything the cache's values depend on
(the model's files, mlx and mlx-lm, the device, the prefill step, the cache kind with its bits and
group size, and the exact ids), and the file records that key and a checksum of its arrays, so a
stale, foreign or damaged file is never used: it is deleted with one warning and the prefix is
prefilled again.

Writes never wait on the disk, nor on a copy, in a decode step: the mlx thread hands the writer
thread evaluated views of the cache's buffers, cut to its tokens (`cache_handoff.held`: nothing
copied), and the writer makes them contiguous (the one copy), writes a temporary file and renames it
(a reader never sees half a file), then deletes the least recently used files past the bound. A
folder that cannot be written turns the tier off with one warning; the run goes on.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import RequestError
from .cache_handoff import Held, copied, held
from .prefix_files import PREFIX_NAME, SUFFIX, TEMP_PREFIX, evict, folder_problem, list_prefixes

log = logging.getLogger("mlx_subagents.prefix_cache")

FORMAT_VERSION = "1"
# Prefixes shorter than this prefill in well under the time a file costs to find and read.
DEFAULT_MIN_PREFIX_TOKENS = 256
# How long a stopping host waits for its queued writes (a prefix file is written in well under a second).
WRITER_DRAIN_S = 30.0
# Files read in full (and hashed) for the model's identity; weights are named by name, size and mtime.
_SMALL_FILE_BYTES = 64 * 2**20
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".npz")


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
        copies nothing, the writer makes the one copy it writes (`cache_handoff`). `replaces`: a file of
        this store the new one supersedes (a conversation's at its turn before), deleted once the new file
        is in place (or at once, when the new one is stored already)."""
        if not self.wants(ids):
            return
        path = self.path_for(ids)
        views = None if path.exists() else held(cache)
        if views is None and replaces is None:
            return
        meta = {"key": self.key(ids), "model": self.model, "n_tokens": str(len(ids)), "format": FORMAT_VERSION}
        with self._idle:
            self._pending += 1
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="prefix-writer", daemon=True)
            self._writer.start()
        self._queue.put((path, views, meta, replaces))

    # -- writer thread ------------------------------------------------------------

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                path, views, meta, replaces = item
                if self.enabled and views is not None:
                    self._write(path, copied(views), meta)
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
