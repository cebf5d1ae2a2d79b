"""The grammar at batch speed: the masks of every constrained row of the batch, computed together.

Each constrained row's processor (`Constrainer`) needs, at each step, the token the batch is feeding
it (its mask depends on it) and then its next mask. Row by row that is a read of the token, a call of
llguidance to consume it and one to compute the mask, and a host-to-device copy, per row and step.
Here the first constrained row of a step does it for all of them: one read of every row's token (the
batch's own array), one `consume_token_par` and one `fill_next_token_bitmask_par` on an llguidance
`LLExecutor` for all rows, one unpacking of the bitmasks; each row's mask is then copied to an array
of its own (a copy, where a slice of one array would be an op more in the step's graph). llguidance's work runs on a worker thread while the mlx thread
dispatches the step's forward pass: on the CPU backend, dispatching a graph of many small ops takes
about as long as computing it, so the masks are ready when the forward is. The worker touches only
llguidance and the rows' Python state, never mlx (the mlx thread owns every mlx call), and the mlx
thread waits for it before it goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx

    from .grammar import Constrainer


class MaskBatch:
    """The batch's constrained rows' masks, one step at a time (one per scheduler).

    Args:
        rows: the constrained rows of the batch's decode step, in order: (its uid, its processor).
        read: every row's token in flight this step, by uid (one read of the batch's array).
        step: what identifies this step (the batch's array of tokens in flight).
    """

    def __init__(
        self,
        rows: Callable[[], list[tuple[int, Constrainer]]],
        read: Callable[[], dict[int, int]],
        step: Callable[[], Any],
    ) -> None:
        self._rows, self._read, self._step = rows, read, step
        self._key: Any = None
        self._masks: dict[int, mx.array] = {}
        self._fed: set[int] = set()
        self._executor: Any = None
        self._bitmask: Any = None
        self._worker: ThreadPoolExecutor | None = None

    def compute(self, row: Constrainer, logits: mx.array) -> bool:
        """At a step's first constrained row that needs its token in flight: every row's token fed and
        every running row's mask computed (the forward dispatched meanwhile). Whether `row`'s token was
        among them (else it reads its own, as on the single path)."""
        key = self._step()
        if key is not self._key:
            self._key = key
            self._masks.clear()
            self._fed.clear()
            self._run(logits)
        return id(row) in self._fed

    def take(self, row: Constrainer) -> mx.array | None:
        """`row`'s mask of this step, computed with the others' (None: it computes its own)."""
        return self._masks.pop(id(row), None)

    def _run(self, logits: mx.array) -> None:
        import mlx.core as mx

        tokens = self._read()
        jobs = []
        for uid, row in self._rows():
            row.catch_up(len(row.known) + 1)  # the tokens the host has read, before the one in flight
            if row.running and uid in tokens and len(row.fed) == len(row.known):
                jobs.append((row, tokens[uid]))
        if not jobs:
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        vocab = logits.shape[-1]
        pending = self._worker.submit(self._masks_of, jobs, vocab)
        mx.async_eval(logits)  # the forward runs while llguidance works
        masked, rows = pending.result()
        self._fed.update(id(row) for row, _ in jobs)
        # A row's own array: a copy made now, not a slice op more in the step's graph.
        self._masks.update((id(row), mx.array(rows[i])) for i, row in enumerate(masked))

    def _masks_of(self, jobs: list[tuple[Constrainer, int]], vocab: int) -> tuple[list[Constrainer], Any]:
        """On the worker: each row's token consumed, the running rows' masks (one call each for all)."""
        import llguidance
        import llguidance.numpy as llnp

        from .grammar import unpack

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        pairs = [(row, token) for row, token in jobs if row.consumes(token)]
        if pairs:
            answers = llnp.consume_token_par(self._executor, [(row.matcher, token) for row, token in pairs])
            for (row, _), ok in zip(pairs, answers, strict=True):
                row.consumed(ok)
        masked = [row for row, _ in jobs if row.running]
        if not masked:
            return [], None
        words = (masked[0].vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < len(masked) or self._bitmask.shape[1] != words:
            self._bitmask = llnp.allocate_token_bitmask(max(8, len(masked)), masked[0].vocab_size)
        llnp.fill_next_token_bitmask_par(
            self._executor, [(row.matcher, i) for i, row in enumerate(masked)], self._bitmask
        )
        rows = unpack(self._bitmask[: len(masked)], vocab)
        for i, row in enumerate(masked):
            row.allowed(vocab, rows[i])
        return masked, rows
