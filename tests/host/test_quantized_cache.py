"""The quantized batch caches on their own: through mlx-lm's `BatchGenerator` they decode as a single
sequence does, token for token, for dense, sliding-window and hybrid models at 8 and 4 bits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.host.kv.kv_bits import KVSetting, kv_setting


@dataclass
class Decoded:
    """A sequence's greedy tokens, the log-probabilities each was chosen from (None: not seen), and its
    cache once it holds every one of them."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    cache: list[Any] = field(default_factory=list)


def _continue(model: Any, cache: list[Any], last: int, n: int, out: Decoded) -> Decoded:
    """`n` greedy tokens after `last` (not yet in `cache`), then the last one fed too."""
    import mlx.core as mx

    for _ in range(n):
        logits = model(mx.array([[last]]), cache=cache)[0, -1]
        out.logprobs.append(logits - mx.logsumexp(logits))
        last = int(mx.argmax(logits).item())
        out.tokens.append(last)
    model(mx.array([[last]]), cache=cache)
    out.cache = cache
    return out


def _decode_alone(model: Any, setting: KVSetting, ids: list[int], n: int) -> Decoded:
    import mlx.core as mx

    cache = setting.make_cache(model)
    model(mx.array(ids[:-1])[None], cache=cache)
    return _continue(model, cache, ids[-1], n, Decoded())


def _decode_batched(model: Any, setting: KVSetting, prompts: list[list[int]], lengths: list[int]) -> list[Decoded]:
    """Two sequences join first, two more five steps later (`extend`); they end at different steps
    (`filter`, `extract`); the last one leaves the batch and finishes alone (`take_from_batch`). Each
    arrives with 10 tokens prefilled in its own cache (`merge`), the rest prefilled in the batch in
    chunks (right-padded: `prepare`, `finalize`)."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    from mlx_subagents.host.mlx.single import take_from_batch

    def insert(which: range) -> list[int]:
        caches = []
        for i in which:
            caches.append(setting.make_cache(model))
            model(mx.array(prompts[i][:10])[None], cache=caches[-1])
        return batch.insert(
            [prompts[i][10:] for i in which],
            max_tokens=[lengths[i] for i in which],
            caches=caches,
            all_tokens=[prompts[i][:10] for i in which],
        )

    batch = BatchGenerator(model, stop_tokens=[], prefill_step_size=64)
    uids, steps = insert(range(2)), 0
    out: dict[int, Decoded] = {}
    while len([d for d in out.values() if d.cache]) < len(prompts):
        if steps == 5:
            uids += insert(range(2, len(prompts)))
        for response in batch.next()[1]:
            mine = out.setdefault(response.uid, Decoded())
            mine.tokens.append(response.token)
            mine.logprobs.append(response.logprobs)
            if response.finish_reason is not None:
                mine.cache = response.prompt_cache
        steps += 1
        left = [u for u in uids if not (u in out and out[u].cache)]
        if len(uids) == len(prompts) and len(left) == 1 and (taken := take_from_batch(batch, left[0])) is not None:
            (last,), (cache, _, pending) = left, taken
            assert all(type(c).__name__.startswith(("Quantized", "Arrays")) for c in cache)
            mine = out[last]
            mine.tokens.append(int(pending.item()))
            mine.logprobs.append(None)  # computed by the batch, not handed back
            _continue(model, cache, mine.tokens[-1], lengths[uids.index(last)] - len(mine.tokens), mine)
    return [out[u] for u in uids]


def _held(layer: Any) -> list[Any]:
    """The quantized keys' and values' parts a layer holds, oldest token first."""
    window = getattr(layer, "max_size", None)
    if window is None:
        return [p[..., : layer.offset, :] for p in (*layer.keys, *layer.values)]
    n = min(layer.offset, window)
    return [p[..., -n:, :] for t in (layer.keys, layer.values) for p in layer._temporal_order(t)]


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "bits"), [("qwen3", 8), ("qwen3", 4), ("gemma3_text", 8), ("qwen3_5", 8)])
def test_a_quantized_batch_decodes_as_each_sequence_alone(
    arch: str, bits: int, quantizable: Callable[[str], Path]
) -> None:
    import mlx.core as mx
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(quantizable(arch)))
    setting, problem = kv_setting(model, bits)
    assert (setting, problem) == (KVSetting(bits, 64), None)
    # 27 to 180 tokens: gemma3_text's sliding window (64) rotates in the prefill of the long prompts
    # and in the decode of the short ones, which are left-padded in the batch when it does.
    prompts = [tokenizer.encode(f"hello world {i} " * n) for i, n in enumerate((12, 3, 20, 5))]
    lengths = [14, 50, 8, 30]

    alone = [_decode_alone(model, setting, ids, n) for ids, n in zip(prompts, lengths)]
    batched = _decode_batched(model, setting, prompts, lengths)

    assert [b.tokens for b in batched] == [a.tokens for a in alone]
    assert len({tuple(a.tokens) for a in alone}) == 4  # the sequences differ: a row mixed up would show
    for a, b in zip(alone, batched):
        # The same distributions, up to float rounding: a batch sums attention in another order,
        # and a rounding there can move a value across an 8-bit step (a gap of a few 1e-3 at most).
        gaps = [float(abs(x - y).max().item()) for x, y in zip(a.logprobs, b.logprobs) if y is not None]
        assert len(gaps) >= len(a.tokens) - 1 and max(gaps) < 1e-2
        # What the first quantized layer holds (its inputs are the same tokens) is the same, bit for bit.
        first = next(i for i, c in enumerate(a.cache) if hasattr(c, "bits"))
        assert type(b.cache[first]) is type(a.cache[first])
        assert all(mx.array_equal(x, y).item() for x, y in zip(_held(a.cache[first]), _held(b.cache[first])))


def test_caches_of_different_settings_never_share_a_batch() -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlx_subagents.host.kv.quantized_cache import BatchQuantizedKVCache, QuantizedKVCache

    def filled(cache: Any) -> Any:
        cache.update_and_fetch(mx.ones((1, 2, 3, 64)), mx.ones((1, 2, 3, 64)))
        return cache

    eight, four, plain = filled(QuantizedKVCache(bits=8)), filled(QuantizedKVCache(bits=4)), filled(KVCache())
    for mixed in ([eight, four], [eight, plain]):
        with pytest.raises(ValueError, match="KV caches of different settings cannot share a batch"):
            BatchQuantizedKVCache.merge(mixed)
    merged = BatchQuantizedKVCache.merge([eight, filled(QuantizedKVCache(bits=8))])
    assert (merged.bits, merged.group_size, merged.size()) == (8, 64, 3)
    back = merged.extract(1)
    for ours, theirs in zip(back.state[:2], eight.keys_and_values()):
        assert all(mx.array_equal(a, b).item() for a, b in zip(ours, theirs))


class Twins:
    """One of our quantized caches and mlx-lm's own unquantized one, given the same operations: ours the
    keys and values, theirs what quantizing them gives back (`dequantize(quantize(x))`). Every buffer
    of ours must then dequantize to theirs exactly, every mask and counter equal."""

    GROUP = 64

    def __init__(self, ours: Any, theirs: Any) -> None:
        self.ours, self.theirs = ours, theirs
        self.bits = ours.bits

    def rounded(self, x: Any) -> Any:
        import mlx.core as mx

        return mx.dequantize(*mx.quantize(x, self.GROUP, self.bits), group_size=self.GROUP, bits=self.bits)

    def feed(self, batch: int, n: int) -> None:
        import mlx.core as mx

        k, v = mx.random.normal((batch, 2, n, 64)), mx.random.normal((batch, 2, n, 64))
        ours = self.ours.update_and_fetch(k, v)
        theirs = self.theirs.update_and_fetch(self.rounded(k), self.rounded(v))
        for a, b in zip(ours, theirs):
            assert self.same(a, b)
        self.check()

    def same(self, parts: Any, plain: Any) -> bool:
        import mlx.core as mx

        return mx.array_equal(mx.dequantize(*parts, group_size=self.GROUP, bits=self.bits), plain).item()

    def check(self, masks: tuple[int, ...] = (1, 3)) -> None:
        import mlx.core as mx

        ours, theirs = self.ours, self.theirs
        assert (ours.keys is None) == (theirs.keys is None)
        if ours.keys is not None:
            assert self.same(ours.keys, theirs.keys) and self.same(ours.values, theirs.values)
        for name in ("offset", "left_padding", "_idx", "_offset", "rotated"):
            a, b = getattr(ours, name, None), getattr(theirs, name, None)
            assert (a.tolist() if isinstance(a, mx.array) else a) == (b.tolist() if isinstance(b, mx.array) else b), (
                name
            )
        window = getattr(theirs, "max_size", None)
        for n in masks:  # as a model asks for them
            a = ours.make_mask(n, return_array=False, window_size=window)
            b = theirs.make_mask(n, return_array=False, window_size=window)
            assert type(a) is type(b) and (not isinstance(a, mx.array) or mx.array_equal(a, b).item())


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("window", [None, 16])
def test_each_batch_operation_moves_what_mlx_lm_moves(window: int | None, bits: int) -> None:
    """Dense (`BatchQuantizedKVCache`) and sliding-window (`BatchQuantizedRotatingKVCache`, window 16)
    caches through every operation a batch does, side by side with mlx-lm's own classes."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

    from mlx_subagents.host.kv.quantized_cache import BatchQuantizedKVCache, QuantizedKVCache
    from mlx_subagents.host.kv.quantized_rotating import BatchQuantizedRotatingKVCache, QuantizedRotatingKVCache

    mx.random.seed(3)

    def single(n: int, chunk: int, keep: int = 0) -> Twins:
        pair = (
            Twins(QuantizedKVCache(bits=bits), KVCache())
            if window is None
            else Twins(QuantizedRotatingKVCache(window, keep, bits=bits), RotatingKVCache(window, keep))
        )
        for start in range(0, n, chunk):  # chunks (concatenated) or single tokens (in place)
            pair.feed(1, min(chunk, n - start))
        return pair

    def merged(pairs: list[Twins]) -> Twins:
        ours, theirs = (
            (BatchQuantizedKVCache, BatchKVCache)
            if window is None
            else (
                BatchQuantizedRotatingKVCache,
                BatchRotatingKVCache,
            )
        )
        batch = Twins(ours.merge([p.ours for p in pairs]), theirs.merge([p.theirs for p in pairs]))
        batch.check()
        return batch

    def extract_each(batch: Twins) -> None:
        for i in range(batch.ours.offset.size):
            row = Twins(batch.ours.extract(i), batch.theirs.extract(i))
            row.check()
            row.feed(1, 1)  # an extracted row goes on as a single sequence
            row.feed(1, 4)

    if window is not None:  # a window keeping its first tokens (mlx-lm's `max_kv_size` caches), rotated
        kept = single(20, 1, keep=4)
        kept.feed(1, 5)  # a chunk after rotating in place puts it back in temporal order first
        kept.feed(1, 1)
    # Lengths below, at and past the window, fed in chunks and token by token.
    batch = merged([single(5, 5), single(23, 7), single(12, 1)])
    batch.ours.prepare(lengths=[9, 2, 6], right_padding=[0, 7, 3])  # a right-padded prompt of 9 tokens...
    batch.theirs.prepare(lengths=[9, 2, 6], right_padding=[0, 7, 3])
    batch.feed(3, 5)  # ... in two chunks: the padding of the second must not push valid tokens out
    batch.feed(3, 4)
    batch.ours.finalize()
    batch.theirs.finalize()
    batch.check()
    extract_each(batch)  # rows still left-padded
    for _ in range(20):  # decode in place, past the window (it rotates)
        batch.feed(3, 1)
    other = merged([single(30, 30), single(3, 1)])
    batch.feed(3, 1)
    other.feed(2, 1)
    other.ours.extend(batch.ours)  # the shorter batch takes the longer one's rows
    other.theirs.extend(batch.theirs)
    batch = other
    batch.check()
    batch.feed(5, 1)
    batch.ours.filter([0, 2, 3])
    batch.theirs.filter([0, 2, 3])
    batch.check()
    batch.feed(3, 1)
    extract_each(batch)
    if window is None:  # a sliding window past its size cannot be trimmed
        assert batch.ours.trim(2) == batch.theirs.trim(2) == 2
        batch.check()
