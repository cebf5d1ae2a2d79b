"""Process-wide slots: at most `concurrency` agent loops at once, and one writer per workspace.

Every session holds a `Lease` while it runs: one of the runner's slots and, for an agent that can
change files (`edit`, `write` or `bash`), its workspace's writer lease; the others run alongside.
The lease goes by the whole workspace, not by the folder a session works in: a worker at the root
can write into the `sub/` a child with `cwd: "sub"` works in, so both take the lease of their
repository's root (outside a repository, of the runner's workspace that holds them). An
agent file that says `writer: false` declares that it only looks, and runs alongside too: the
built-in scout and reviewer run `git log` or the tests through bash, and serialising them would undo
parallel scouting (`AgentSpec.is_writer` decides). Nesting cannot multiply the limit: a parent lends
its lease back while it waits for its children (who may need the slot and the writer lease), and
takes it again before it goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from contextvars import Context, ContextVar, copy_context
from dataclasses import dataclass, field
from pathlib import Path

from ..agents.context import repository_root
from ..events import SLOT, WRITER_LEASE


@dataclass
class WriterLease:
    """One workspace's writer lease: its lock, and who holds it and who waits for it (task labels), for
    `subagent watch`."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    holder: str | None = None
    waiting: list[str] = field(default_factory=list)


class Lease:
    """A running session's slot (and writer lease); `lent()` gives them back while it waits.

    Args:
        who: the task's label, which its writer lease names as holder or waiter.
    """

    def __init__(self, slots: asyncio.Semaphore, writer: WriterLease | None, who: str = "") -> None:
        self._slots = slots
        self._writer = writer
        self._who = who
        self._lock = asyncio.Lock()
        self._n_lent = 0
        self.held = False

    async def acquire(self, on_wait: Callable[[str], None] | None = None) -> None:
        """Take the writer lease (for a writer), then a slot; `on_wait` is told what it waits for, before it
        waits: `the writer lease`, `a slot`."""
        # The writer lease first: a writer waiting for it keeps no slot from the others.
        writer = self._writer
        if writer is not None:
            if writer.lock.locked() and on_wait is not None:
                on_wait(WRITER_LEASE)
            writer.waiting.append(self._who)
            try:
                await writer.lock.acquire()
            finally:
                writer.waiting.remove(self._who)
            writer.holder = self._who
        if self._slots.locked() and on_wait is not None:
            on_wait(SLOT)
        try:
            await self._slots.acquire()
        except BaseException:
            self._release_writer()
            raise
        self.held = True

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        self._slots.release()
        self._release_writer()

    def _release_writer(self) -> None:
        if self._writer is not None:
            self._writer.holder = None
            self._writer.lock.release()

    @asynccontextmanager
    async def lent(self) -> AsyncIterator[None]:
        """Give the lease back for the block (a parent waiting on its children); concurrent
        blocks share one loan, and the lease is taken back when the last ends."""
        async with self._lock:
            if self._n_lent == 0:
                self.release()
            self._n_lent += 1
        try:
            yield
        except BaseException:
            self._n_lent -= 1  # the session is ending (cancelled or failed): nothing to take back
            raise
        async with self._lock:
            self._n_lent -= 1
            if self._n_lent == 0 and not self.held:
                await self.acquire()


_CURRENT: ContextVar[Lease | None] = ContextVar("mlx_subagents_lease", default=None)


def without_lease() -> Context:
    """This context without the slot lease held in it: what a background start runs in, so that it never
    lends or waits on its starter's slot, and keeps the rest (a front end's: whose client it logs to)."""
    context = copy_context()
    context.run(_CURRENT.set, None)
    return context


class Slots:
    """The runner's slots and writer leases. Create inside the event loop that uses them.

    Args:
        root: the runner's workspace: outside a repository, the writer lease of every folder in it.
    """

    def __init__(self, concurrency: int, root: Path | None = None) -> None:
        self._slots = asyncio.Semaphore(concurrency)
        self.writers: dict[Path, WriterLease] = {}  # by workspace (see `lease_key`)
        self.root = root

    def lease_key(self, folder: Path) -> Path:
        """Whose writer lease a writer working in `folder` takes: its repository's root, else the
        runner's workspace when it holds `folder`, else `folder` itself."""
        repository = repository_root(folder)
        if repository is not None:
            return repository
        return self.root if self.root is not None and folder.is_relative_to(self.root) else folder

    @asynccontextmanager
    async def hold(
        self, writer: Path | None = None, on_wait: Callable[[str], None] | None = None, *, who: str = ""
    ) -> AsyncIterator[Lease]:
        """Wait for a slot (and, for a writer, the writer lease of the workspace `writer` is in), hold
        it for the block.

        Args:
            writer: the folder a writer works in (None: a reader).
            on_wait: called with what it waits for (`WRITER_LEASE`, then `SLOT`) when another session holds
                it, before waiting.
            who: the task's label, as its writer lease names it.
        """
        key = self.lease_key(writer) if writer is not None else None
        lease_of = self.writers.setdefault(key, WriterLease()) if key is not None else None
        lease = Lease(self._slots, lease_of, who)
        await lease.acquire(on_wait)
        token = _CURRENT.set(lease)
        try:
            yield lease
        finally:
            _CURRENT.reset(token)
            lease.release()


def lend() -> AbstractAsyncContextManager[None]:
    """The current session's lease, lent for a block (nothing to lend outside a held slot)."""
    lease = _CURRENT.get()
    return lease.lent() if lease is not None else nullcontext()
