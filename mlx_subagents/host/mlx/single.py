"""One sequence decoding on its own, one token per call, the way `mlx_lm.generate_step` does.

A single session (the common `subagent run`) decodes fastest on mlx-lm's single-sequence path: no
batch bookkeeping around each token. When a second session arrives the scheduler moves the
sequence into the batch (`handover`); when the others in the batch end, the last one comes back
(`take_from_batch`, then a stream with `pending`). Either way the next token and the cache carry
over, and the logits processors see the same growing context, so the output is token-identical.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

LogitsProcessor = Callable[[Any, Any], Any]


class SingleStream:
    """Decodes from a cache holding `context[:-1]`, feeding `context[-1]` first; or, given `pending`
    (the token already computed after `context`, as a batch has it), from a cache holding all of it.

    Pipelined one step ahead, as `generate_step`: when `next()` returns a token, that token is
    already in the cache and the one after it is being computed.
    """

    def __init__(
        self,
        model: Any,
        cache: list[Any],
        context: list[int],
        sampler: Callable[[Any], Any],
        processors: list[LogitsProcessor],
        pending: Any = None,
    ) -> None:
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        self.model, self.cache, self.sampler, self.processors = model, cache, sampler, processors
        self._stream = generation_stream
        fed = context if pending is not None else context[:-1]
        # What the processors are shown: every token fed so far, as in a batch's token context; or,
        # where each reads only the length and the last token (`tail_only`), just those.
        self._tail = bool(processors) and all(getattr(p, "tail_only", False) for p in processors)
        self._context: Any = Tail(len(fed)) if self._tail else mx.array(fed, dtype=mx.uint32) if processors else None
        self._pending = pending if pending is not None else self._step(mx.array(context[-1:], dtype=mx.uint32))
        self.n_steps = 0

    def _step(self, y: Any) -> Any:
        """Feed `y` (one token), start computing the token after it."""
        import mlx.core as mx

        with mx.stream(self._stream):
            logits = self.model(y[None], cache=self.cache)[:, -1, :]
            if self.processors:
                self._context = self._context.then(y) if self._tail else mx.concatenate([self._context, y])
                for processor in self.processors:
                    logits = processor(self._context, logits)
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            token = self.sampler(logprobs)
        mx.async_eval(token)
        return token

    def next(self) -> int:
        """The next token; it is fed into the cache as this returns, and its successor computed."""
        import mlx.core as mx

        token = self._pending
        self._pending = self._step(token)
        self.n_steps += 1
        if self.n_steps % 256 == 0:
            mx.clear_cache()
        return int(token.item())

    def handover(self) -> int:
        """Stop here: the token computed but not yet returned (not in the cache); the cache holds the rest."""
        return int(self._pending.item())

    def feed(self, token: int) -> None:
        """Put a last token into the cache (when the sequence ends on the token `handover` gave)."""
        import mlx.core as mx

        self._pending = self._step(mx.array([token], dtype=mx.uint32))
        mx.eval(self._pending)


class Tail:
    """A context as a `tail_only` processor reads it: its length and its last token (lazy)."""

    in_place = True  # its last token is the step's own array: reading it adds no op

    def __init__(self, n: int, last: Any = None) -> None:
        self._n, self._last = n, last

    def then(self, y: Any) -> Tail:
        return Tail(self._n + 1, y)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> Any:
        """The last token as the array the step computed (shape (1,)): no new op, so reading it
        waits for that step only, not for whatever is queued after it."""
        if i not in (-1, self._n - 1) or self._last is None:
            raise IndexError("a tail-only context holds its last token only")
        return self._last


def take_from_batch(batch: Any, uid: int) -> tuple[list[Any], list[int], Any] | None:
    """Take sequence `uid` out of mlx-lm's `BatchGenerator` with what the batch computed for it: its
    cache as a single-sequence one (left padding cut off), the ids that cache holds, and the token
    computed after them but not yet returned (the batch, like `SingleStream`, is a step ahead).

    None, leaving it in the batch, while it still prefills there, or when a layer's batch cache is
    not one whose `extract` is tested to continue token-identically (`kinds.extractable`: dense,
    sliding-window and hybrid layers are, quantized or not; a `CacheList` is not). Reads mlx-lm's generation batch
    (0.32-0.33): the pipelined token is not part of its public API.
    """
    from ..kv.kinds import extractable

    generation = batch._generation_batch
    if uid not in generation.uids or not all(extractable(c) for c in generation.prompt_cache):
        return None
    i = generation.uids.index(uid)
    pending = generation._next_tokens[i : i + 1]
    cache, held = batch.remove([uid], return_prompt_caches=True)[uid]
    return cache, list(held), pending
