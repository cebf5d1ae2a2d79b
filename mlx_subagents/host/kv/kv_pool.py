"""The bounded KV pool: the one owner of the KV bytes held, accounted against one budget.

Every cache registers with the pool when it is made (a session's, idle or in a turn, a shared prefix's
entry, a snapshot, a restored spill; a batch or a prefill group as the holder of its rows) and leaves
it when it is freed: the pool keeps weak references, so a cache nothing holds any more is gone from its
count at once, and one still held anywhere stays counted (`held_bytes`, the one read of the bytes held:
the pool's peak and `memory_stats`). A cache handed to a batch leaves (`leave`): the batch counts it.
Admission asks the pool to reserve a turn's worst case (`reserve`) and gets a yes or a no.

Under pressure, idle sessions' caches are evicted least-recently-used first:
spilled to disk as safetensors and restored on their next turn, or dropped
(and re-prefilled) when they are small enough that recomputing is cheaper
than the disk round trip. New work that would overflow the budget waits
(admission control) instead of overflowing it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .prefix_store import StoredPrompt

# Below this many held tokens a cache is dropped rather than spilled.
DEFAULT_DROP_BELOW_TOKENS = 256
KV_STEP = 256  # mlx-lm's KVCache grows its buffers in steps of this many tokens


@dataclass
class CacheState:
    """A session's cache and the ids it holds; written only on the mlx thread (a turn's prompt is made
    from a read of it elsewhere, checked there at submit: `TurnPrompt.fits`)."""

    prompt_cache: list[Any] | None = None
    token_ids: list[int] = field(default_factory=list)
    render: Any = None
    # Non-trimmable (hybrid) caches: a copy taken where the reply opens.
    snapshot: tuple[int, list[Any]] | None = None
    spill_path: Path | None = None
    # The shared prefix a spilled cache started from (weakly: it may be dropped meanwhile), so that it
    # comes back over that prefix, holding only its tail, while the prefix is still held.
    spilled_over: weakref.ref[Any] | None = None
    dropped: bool = False
    kv_bytes: int = 0
    n_tool_calls: int = 0  # numbers this session's tool-call ids (call_0, call_1, ...)
    stored: StoredPrompt | None = None  # its conversation as last stored on disk (`PrefillStage.store_prompt`)

    def reset(self) -> None:
        if self.spill_path is not None:
            self.spill_path.unlink(missing_ok=True)
        self.__dict__.update(CacheState().__dict__)

    def measure(self) -> int:
        self.kv_bytes = cache_nbytes(self.prompt_cache) + (cache_nbytes(self.snapshot[1]) if self.snapshot else 0)
        return self.kv_bytes


@dataclass
class PoolCounters:
    evictions: int = 0
    spills: int = 0
    restores: int = 0
    drops: int = 0
    reprefilled_tokens: int = 0
    admission_waits: int = 0
    peak_bytes: int = 0
    peak_sessions: int = 0  # the most sessions whose caches were in memory at once (idle or in a turn)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def cache_nbytes(cache: list[Any] | None) -> int:
    return sum(c.nbytes for c in cache) if cache else 0


def shared_of(cache: list[Any]) -> Any:
    """The `SharedPrefix` (`prefixed_cache.py`) a cache's layers start from; None: it holds all it holds itself."""
    return next((c.shared for c in cache if getattr(c, "shared", None) is not None), None)


def shared_prefix_of(cache: list[Any] | None) -> tuple[int, Any]:
    """The shared prefix a cache starts from: its length in tokens and its `SharedPrefix` ((0, None): none)."""
    shared = shared_of(cache) if cache else None
    return (0, None) if shared is None else (shared.length, shared)


@dataclass(frozen=True)
class KVShape:
    """Bytes a cache costs: a fixed part (recurrent state) plus a per-token part."""

    fixed: int
    per_token: int
    # An unquantized cache's element type (`float16`, `bfloat16`; `float32` on CPU models); not compared.
    dtype: str = field(default="", compare=False)

    def bytes_for(self, n_tokens: int) -> int:
        steps = -(-max(n_tokens, 1) // KV_STEP)
        return self.fixed + self.per_token * steps * KV_STEP


def kv_shape_of(cache: list[Any]) -> KVShape | None:
    """The shape of a cache holding at least one token, read off its layers' kinds (`kinds.py`): a layer
    that grows by tokens costs its bytes over the tokens its buffers hold room for (a sliding window
    counted as if unbounded), a recurrent state its fixed size. A layer of a kind the host does not know,
    or one holding nothing yet, gives None: measure it instead."""
    from .kinds import kind_of

    fixed = per_token = 0
    dtype = ""
    for layer in cache:
        kind = kind_of(layer)
        if kind is None or (kind.size == "tokens" and layer.keys is None):
            return None
        if kind.size == "fixed":
            fixed += layer.nbytes
            continue
        per_token += kind.per_token(layer)
        if not kind.packed:
            dtype = str(layer.keys.dtype).removeprefix("mlx.core.")
    return KVShape(fixed=fixed, per_token=per_token, dtype=dtype)


@dataclass(frozen=True)
class TurnSize:
    """A turn as admission control counts it: its final and prompt lengths in tokens, and the shared
    prefix it starts from (`shared` tokens of `prefix`, held once for all its sessions and counted
    there: the turn holds only what follows)."""

    final: int
    prompt: int
    shared: int = 0
    prefix: object = None


def admission_bytes(
    shape: KVShape,
    turns: Sequence[TurnSize],
    *,
    batched: bool,
    trimmable: bool,
    new_prefixes: Sequence[int] = (),
) -> int:
    """Worst-case KV bytes of turns running together, as admission control counts them.

    Args:
        turns: each turn's lengths and the shared prefix it starts from.
        batched: a batch pads every member to its longest: the tails, when every member starts from one
            shared prefix, else the whole sequences (the batch then holds each row whole).
        trimmable: False for hybrid caches, whose sessions also hold a snapshot of their prompt.
        new_prefixes: lengths of shared prefixes these turns will add.
    """
    if not turns:
        return 0
    # A cache grows by whole KV steps past what it holds: allow one step of slack.
    if batched:
        one_prefix = len({t.prefix for t in turns}) == 1
        longest = max(t.final - (t.shared if one_prefix else 0) for t in turns)
        total = len(turns) * shape.bytes_for(longest + KV_STEP)
    else:
        total = sum(shape.bytes_for(t.final - t.shared + KV_STEP) for t in turns)
    if not trimmable:  # a snapshot copies the cache as allocated: up to a step past the tokens it holds
        total += sum(shape.bytes_for(t.prompt - t.shared + KV_STEP) for t in turns)
    return total + sum(shape.bytes_for(n) for n in new_prefixes)


def tokens_that_fit(shape: KVShape, per_session_bytes: int, trimmable: bool = True) -> int:
    """The longest window (whole KV steps) whose one-session `admission_bytes` stays within `per_session_bytes`."""
    if shape.per_token <= 0:
        return 0

    def fits(steps: int) -> bool:
        n = steps * KV_STEP
        return admission_bytes(shape, [TurnSize(n, n)], batched=False, trimmable=trimmable) <= per_session_bytes

    low, high = 0, max(0, (per_session_bytes - shape.fixed) // (shape.per_token * KV_STEP))  # high: an upper bound
    while low < high:  # bisect for the largest number of steps that fits
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return int(low) * KV_STEP


class KVPool:
    """LRU accounting of idle session caches against a byte budget (None = unbounded)."""

    def __init__(
        self, budget: int | None, *, spill_dir: Path | None = None, drop_below_tokens: int = DEFAULT_DROP_BELOW_TOKENS
    ) -> None:
        self.budget = budget
        self.drop_below_tokens = drop_below_tokens
        self._spill_dir = spill_dir
        self._own_dir = False  # True once it made its own temporary folder (`close` removes it)
        self._idle: OrderedDict[str, CacheState] = OrderedDict()
        self.counters = PoolCounters()
        # What is held, weakly: cache layers, the shared prefixes they start from, holders of rows (a batch).
        self._layers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._shared: weakref.WeakSet[Any] = weakref.WeakSet()
        self._holders: weakref.WeakKeyDictionary[Any, Callable[[Any], int]] = weakref.WeakKeyDictionary()

    # -- what is held -----------------------------------------------------------

    def register(self, cache: Iterable[Any] | None) -> Any:
        """Count a cache's layers (and the shared prefix they start from, once) as held until they are
        freed; the cache, for chaining. Registering a layer twice counts it once."""
        for layer in cache or ():
            self._layers.add(layer)
            shared = getattr(layer, "shared", None)
            if shared is not None:
                self._shared.add(shared)
        return cache

    def hold(self, holder: Any, nbytes: Callable[[Any], int]) -> None:
        """Count `nbytes(holder)` as held while `holder` lives: a batch or a prefill group, whose rows'
        caches it merged (the rows it was given leave: `leave`)."""
        self._holders[holder] = nbytes

    def leave(self, cache: Iterable[Any] | None) -> None:
        """A cache handed to a holder (a batch) that counts it from now on."""
        for layer in cache or ():
            self._layers.discard(layer)

    def held_bytes(self) -> int:
        """The KV bytes held right now, in one read: every live cache registered (idle, in a turn, shared
        prefixes' entries, snapshots), each shared prefix once, and the holders' rows."""
        layers = sum(layer.nbytes for layer in list(self._layers))
        shared = sum(prefix.nbytes for prefix in list(self._shared))
        return layers + shared + sum(nbytes(holder) for holder, nbytes in list(self._holders.items()))

    # -- accounting -------------------------------------------------------------

    def idle_bytes(self) -> int:
        return sum(s.kv_bytes for s in self._idle.values())

    def park(self, name: str, state: CacheState) -> None:
        """A session's turn ended: its cache is idle (and most recently used)."""
        self.register(state.prompt_cache)
        self.register(state.snapshot[1] if state.snapshot else None)
        state.measure()
        self._idle[name] = state
        self._idle.move_to_end(name)

    def idle(self, name: str) -> CacheState | None:
        """The session's state while no turn of it runs (its cache and ids agree), else None."""
        return self._idle.get(name)

    def in_memory(self) -> list[CacheState]:
        """The idle sessions' states whose caches are in memory (not spilled, not dropped)."""
        return [state for state in self._idle.values() if state.prompt_cache and state.token_ids]

    def claim(self, name: str) -> None:
        """A session's turn starts: its cache is in use, not evictable."""
        self._idle.pop(name, None)

    def forget(self, name: str) -> None:
        state = self._idle.pop(name, None)
        if state is not None and state.spill_path is not None:
            state.spill_path.unlink(missing_ok=True)

    def close(self) -> None:
        """Delete the spill files of the sessions still idle, and the temporary folder it made: a host that
        stops leaves nothing behind in /tmp (a given `spill_dir` stays; only its files go)."""
        for name in list(self._idle):
            self.forget(name)
        if self._own_dir and self._spill_dir is not None:
            shutil.rmtree(self._spill_dir, ignore_errors=True)
            self._spill_dir, self._own_dir = None, False

    def resident(self, active_sessions: int = 0) -> int:
        """Sessions whose caches are in memory: the idle ones not evicted, and `active_sessions` in a turn."""
        return active_sessions + sum(1 for s in self._idle.values() if s.prompt_cache is not None)

    def observe(self, total_bytes: int, resident_sessions: int = 0) -> None:
        """Keep the peaks of the bytes and of the sessions held in memory at once."""
        self.counters.peak_bytes = max(self.counters.peak_bytes, total_bytes)
        self.counters.peak_sessions = max(self.counters.peak_sessions, resident_sessions)

    def fits(self, needed: int, other_bytes: int = 0, keep: str | None = None) -> bool:
        if self.budget is None:
            return True
        own = self._idle[keep].kv_bytes if keep in self._idle else 0
        return self.idle_bytes() - own + other_bytes + needed <= self.budget

    def reserve(self, needed: int, other_bytes: int = 0, keep: str | None = None) -> bool:
        """Yes or no: whether `needed` more bytes (the worst case of the work in flight and of a turn to
        start) fit beside the idle caches, evicting idle caches (LRU first) until they do; False if they
        cannot (as vLLM's `allocate_slots` returns None).

        `keep`: the session about to start, whose turn `needed` counts: its idle cache is part of that,
        and is never the one evicted (spilled, then restored at once, and whole: a cache over a shared
        prefix comes back holding it, more than it was counted for)."""
        while not self.fits(needed, other_bytes, keep):
            victim = next((n for n, s in self._idle.items() if s.kv_bytes > 0 and n != keep), None)
            if victim is None:
                return False
            self.evict(self._idle[victim])
        return True

    def release(self) -> bool:
        """Last resort of admission: evict every idle cache still in memory, those of no bytes of their own
        included (a cache holding nothing but a shared prefix keeps that prefix in use); False when none was."""
        held = [state for state in self._idle.values() if state.prompt_cache is not None]
        for state in held:
            self.evict(state)
        return bool(held)

    # -- eviction and restore ---------------------------------------------------

    def evict(self, state: CacheState) -> None:
        """Spill a cache to disk, or drop it when re-prefilling is cheaper."""
        from mlx_lm.models.cache import save_prompt_cache

        self.counters.evictions += 1
        state.snapshot = None
        if state.prompt_cache is not None and len(state.token_ids) >= self.drop_below_tokens:
            fd, name = tempfile.mkstemp(suffix=".safetensors", dir=self._spill_root())
            os.close(fd)
            save_prompt_cache(name, state.prompt_cache)  # whole: the prefix may be gone when it comes back
            state.spill_path = Path(name)
            shared = shared_of(state.prompt_cache)
            state.spilled_over = None if shared is None else weakref.ref(shared)
            self.counters.spills += 1
        else:
            state.dropped = True
            self.counters.drops += 1
        state.prompt_cache = None
        state.kv_bytes = 0

    def restore(self, state: CacheState) -> None:
        """Bring a spilled cache back before its session's next turn (quantized as it was spilled)."""
        from .kv_bits import load_prompt_cache

        if state.spill_path is None:
            return
        state.prompt_cache = self.register(load_prompt_cache(str(state.spill_path)))
        state.spill_path.unlink(missing_ok=True)
        state.spill_path = None
        self.counters.restores += 1

    def _spill_root(self) -> str:
        if self._spill_dir is None:
            self._spill_dir = Path(tempfile.mkdtemp(prefix="mlx-subagents-kv-"))
            self._own_dir = True
        self._spill_dir.mkdir(parents=True, exist_ok=True)
        return str(self._spill_dir)
