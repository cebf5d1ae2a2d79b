"""The grammar at batch speed: every constrained row of a decode step masked together, in one op.

mlx-lm's batch applies logits processors row by row: each row with a processor gets its own slice
of the step's logits, its own context array and its processors' ops, and the rows are concatenated
again; on a host-bound model those few ops per row cost more than the mask itself. So a turn's
grammar is a processor of its row only for the row's first step (the new rows' own step, before
they join the batch); from its first step in the batch on, `MaskedModel` takes it out of the row's
processors, and each decode step's logits leave the model already masked:

- rows whose matcher runs need the token in flight (their mask depends on it). Every row's is read
  at once from the batch's own array of them (no op added: the read waits for the step before, not
  for this step's forward); llguidance consumes them and computes the masks with one
  `consume_token_par` and one `fill_next_token_bitmask_par` on an `LLExecutor`, on a worker thread
  while the mlx thread dispatches the forward (on the CPU backend dispatching a graph of many small
  ops takes about as long as computing it). The worker touches only llguidance and the rows' Python
  state, never mlx; the mlx thread waits for it before it goes on.
- free rows whose token in flight may complete their call's start marker: with nothing read, the
  token is compared on the device and the grammar's first mask applies where it matched.

The masks of all rows become one `[B, 1, V]` array, applied with one `where`. The grammar still
comes first: the row's other processors (a thought budget, the test kit's forcing scripts) run after
it in mlx-lm's loop, and one that forces a token wins (the grammar lets go at a token it rejects).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx
    import numpy as np

    from ..calls.constrainer import Constrainer, Prototype

# A constrained row of a decode step: its index in the batch, its grammar, what to do if it fails.
Row = tuple[int, "Constrainer", Callable[[Exception], None]]


class MaskedModel:
    """The model as mlx-lm's batch calls it: the logits of the batch's decode steps come out masked
    by its rows' grammars (`MaskBatch`). Everything else is the model's own.

    Args:
        model: the model.
        masked: `(inputs, cache, logits)` of each call, to the logits to return.
    """

    def __init__(self, model: Any, masked: Callable[[Any, Any, Any], Any]) -> None:
        self._model, self._masked = model, masked

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        return self._masked(inputs, cache, self._model(inputs, cache=cache, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class MaskBatch:
    """The constrained rows' masks of a batch, one decode step at a time (one per scheduler).

    Args:
        rows: the constrained rows of the generation batch being stepped, in order (`Row`).
    """

    def __init__(self, rows: Callable[[Any], list[Row]]) -> None:
        self._rows = rows
        self._executor: Any = None
        self._bitmask: Any = None
        self._worker: ThreadPoolExecutor | None = None

    def apply(self, generation: Any, inputs: mx.array, logits: mx.array) -> mx.array:
        """`logits` of `generation`'s step (`[B, 1, V]`, fed `inputs`), each constrained row masked."""
        running: list[Row] = []
        armed: list[tuple[int, int, Prototype]] = []  # (row, the marker's last token, the grammar it starts)
        vocab = logits.shape[-1]
        for row in self._rows(generation):
            i, grammar, fail = row
            try:
                grammar.to_step()
                if grammar.running:
                    running.append(row)
                elif (trigger := grammar.armed()) is not None:
                    armed.append((i, *trigger))
            except Exception as exc:
                fail(exc)
        if not running and not armed:
            return logits
        import mlx.core as mx
        import numpy as np

        minus_inf = mx.array(-mx.inf, dtype=logits.dtype)
        if not running:  # free rows only: nothing read, the token in flight compared on the device
            return mx.where(_first_blocked(armed, inputs, vocab), minus_inf, logits)
        allow = np.ones((logits.shape[0], 1, vocab), dtype=bool)
        flight = generation._current_tokens.tolist()  # mlx-lm 0.32-0.33: the tokens this step feeds
        for i, marker, proto in armed:
            if flight[i] == marker:
                allow[i, 0] = proto.first_row(vocab)
        pending = self._worker_pool().submit(self._masks_of, running, flight, vocab)
        mx.async_eval(logits)  # the forward runs while llguidance works
        for i, row in pending.result():
            allow[i, 0] = row
        return mx.where(mx.array(allow), logits, minus_inf)

    def _worker_pool(self) -> ThreadPoolExecutor:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._worker

    def _masks_of(self, rows: list[Row], flight: list[int], vocab: int) -> list[tuple[int, np.ndarray]]:
        """On the worker: each running row's token in flight consumed, then the masks of the rows
        still running (one llguidance call each for all), by row index."""
        import llguidance
        import llguidance.numpy as llnp

        from ..calls.constrainer import unpack

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        # A row fed past what the host read has had its token in flight already (not at a batch step).
        fed = [(i, g, f) for i, g, f in rows if len(g.fed) == len(g.known) and g.consumes(flight[i])]
        if fed:
            try:
                answers = llnp.consume_token_par(self._executor, [(g.matcher, flight[i]) for i, g, _ in fed])
            except Exception as exc:
                for _, _, fail in fed:
                    fail(exc)
                return []
            for (_, grammar, _), ok in zip(fed, answers, strict=True):
                grammar.consumed(ok)
        masked = [(i, g, f) for i, g, f in rows if g.running]
        if not masked:
            return []
        size = masked[0][1].vocab_size
        if self._bitmask is None or self._bitmask.shape[0] < len(masked) or self._bitmask.shape[1] != (size + 31) // 32:
            self._bitmask = llnp.allocate_token_bitmask(max(8, len(masked)), size)
        try:
            llnp.fill_next_token_bitmask_par(
                self._executor, [(g.matcher, k) for k, (_, g, _) in enumerate(masked)], self._bitmask
            )
        except Exception as exc:
            for _, _, fail in masked:
                fail(exc)
            return []
        bits = unpack(self._bitmask[: len(masked)], vocab)
        out = []
        for k, (i, grammar, fail) in enumerate(masked):
            try:
                out.append((i, grammar.allowed(vocab, bits[k])))
            except Exception as exc:
                fail(exc)
        return out


def _first_blocked(armed: list[tuple[int, int, Prototype]], inputs: mx.array, vocab: int) -> mx.array:
    """Where the grammars' first masks rule a token out (`[B, 1, V]`, broadcast), for the rows whose
    token in flight (`inputs`, `[B, 1]`) completes their call's start marker. Built on the device from
    each grammar's own row, made once (`Prototype.blocked`): rows of one grammar, the usual batch,
    share it, and a free step copies nothing of the vocabulary's size to the device."""
    import mlx.core as mx
    import numpy as np

    markers = np.full((inputs.shape[0], 1), np.iinfo(np.uint32).max, dtype=np.uint32)
    for i, marker, _ in armed:
        markers[i] = marker
    hit = (inputs == mx.array(markers))[..., None]  # [B, 1, 1]: the marker's last token in flight
    protos = {id(proto): proto for _, _, proto in armed}
    if len(protos) == 1:
        return hit & next(iter(protos.values())).blocked(vocab)
    rows: list[Any] = [None] * inputs.shape[0]
    for i, _, proto in armed:
        rows[i] = proto.blocked(vocab)
    none = mx.zeros((vocab,), dtype=mx.bool_)
    return hit & mx.stack([none if r is None else r for r in rows])[:, None, :]
