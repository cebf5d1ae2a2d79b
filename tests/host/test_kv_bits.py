"""`--kv-bits` on the host: quantized sessions batch, spill, fork and start warm token-identically; the
pool counts what their arrays hold; a model that cannot take a quantized cache warns and runs at 16."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.host import GenerateArgs, MlxModelHost
from mlx_subagents.host.kv.kv_bits import KVSetting, kv_setting
from tests.helpers import texts
from tests.host.test_batching import result, task
from tests.host.test_prefix_store import ask, stored


async def conversation(host: MlxModelHost, i: int, turns: int = 2) -> list[tuple[int, ...]]:
    session = host.session(f"s{i}")
    messages, out = task(i), []
    for turn in range(turns):
        reply = await session.generate(messages, GenerateArgs(max_tokens=16))
        out.append(reply.token_ids)
        messages = messages + [reply.to_message(), result(i, turn)]
    return out


def layer_kinds(host: MlxModelHost, name: str) -> list[str]:
    state = host._pool.idle(name)
    assert state is not None and state.prompt_cache is not None
    return [type(c).__name__ for c in state.prompt_cache]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "kinds"),
    [
        ("qwen3", {"QuantizedKVCache"}),
        ("gemma3_text", {"QuantizedKVCache", "QuantizedRotatingKVCache"}),  # global and sliding-window layers
        ("qwen3_5", {"QuantizedKVCache", "ArraysCache"}),  # attention quantized, gated-delta state as it is
    ],
)
def test_four_sessions_batched_at_8_bits_decode_as_each_alone(
    arch: str, kinds: set[str], quantizable: Callable[[str], Path]
) -> None:
    path = quantizable(arch)

    async def together() -> tuple[list[Any], int, set[str]]:
        async with MlxModelHost(str(path), kv_bits=8) as host:
            out = list(await asyncio.gather(*(conversation(host, i) for i in range(4))))
            assert host.kv_bits == 8
            return out, host._scheduler.decode.most_decoding, {k for i in range(4) for k in layer_kinds(host, f"s{i}")}

    async def alone() -> list[Any]:
        out = []
        for i in range(4):
            async with MlxModelHost(str(path), kv_bits=8, batching=False, share_prefix=False) as host:
                out.append(await conversation(host, i))
        return out

    batched, most, held = asyncio.run(together())
    separate = asyncio.run(alone())

    assert batched == separate
    assert most == 4 and held == kinds  # four decoded in one batch, on quantized caches
    assert len({turns[0] for turns in separate}) == 4  # the sessions differ: a row mixed up would show


@pytest.mark.slow
def test_a_quantized_prompt_prefilled_in_slices_decodes_as_prefilled_at_once(
    quantizable: Callable[[str], Path],
) -> None:
    """Keys and values are quantized token by token, so slices of any size leave the same cache."""

    async def go(step: int) -> list[Any]:
        async with MlxModelHost(str(quantizable("qwen3")), kv_bits=8, prefill_step_size=step) as host:
            return await conversation(host, 0)

    assert asyncio.run(go(48)) == asyncio.run(go(4096))


@pytest.mark.slow
def test_a_quantized_session_cancelled_in_the_batch_goes_on_from_its_cut_cache(
    quantizable: Callable[[str], Path], tiny_qwen3: Any
) -> None:
    from mlx_subagents.testing import ForcedScripts

    path = quantizable("qwen3")
    long_text = " ".join(f"item{i}" for i in range(300))

    async def cut() -> tuple[list[Any], Any]:
        scripts = ForcedScripts(tiny_qwen3[1], {"s9": [long_text]})  # the tiny models share one tokenizer
        async with MlxModelHost(str(path), kv_bits=8, processor_factory=scripts) as host:
            joined = asyncio.Event()
            doomed = asyncio.create_task(host.session("s9").generate(task(9), GenerateArgs(max_tokens=600)))
            others = [
                host.session(f"s{i}").generate(
                    task(i), GenerateArgs(max_tokens=20, on_event=texts(lambda _: joined.set()))
                )
                for i in range(3)
            ]
            running = asyncio.gather(*others)
            await joined.wait()  # the others decode, so s9 (300 tokens to go) does so in their batch
            doomed.cancel()  # taken out of the batch mid-reply (`remove`: its quantized cache extracted)
            replies = await running
            with pytest.raises(asyncio.CancelledError):
                await doomed
            assert host._scheduler.decode.most_decoding == 4
            again = await host.session("s9").generate(task(9), GenerateArgs(max_tokens=8))
            return [r.token_ids for r in replies], again

    async def alone() -> tuple[list[Any], Any]:
        async with MlxModelHost(str(path), kv_bits=8, batching=False) as host:
            replies = [await host.session(f"s{i}").generate(task(i), GenerateArgs(max_tokens=20)) for i in range(3)]
            return [r.token_ids for r in replies], await host.session("s9").generate(
                task(9), GenerateArgs(max_tokens=8)
            )

    (batched, again), (separate, cold) = asyncio.run(cut()), asyncio.run(alone())

    assert batched == separate
    assert again.token_ids == cold.token_ids  # the cut cache, trimmed to the prompt, goes on as a fresh one
    assert again.usage.cached_tokens == again.usage.prompt_tokens - 1 > cold.usage.cached_tokens


@pytest.mark.slow
def test_quantized_forks_spilled_and_restored_continue_token_identically(quantizable: Callable[[str], Path]) -> None:
    """A parent's quantized cache shared with two forks, each spilled to disk while the other runs and
    restored for its next turn: the same tokens as with no budget at all."""
    from tests.runs.test_forks import FORK_TASK

    path = quantizable("qwen3")

    async def go(budget_tokens: int) -> tuple[list[Any], dict[str, int], set[str], list[Path]]:
        async with MlxModelHost(str(path), kv_bits=8, kv_budget=0, max_sessions=1, share_prefix=False) as host:
            await host.set_kv_budget(budget_tokens * host.kv_shape.per_token or None)
            host._pool.drop_below_tokens = 0  # spilled, never dropped, however short
            parent = host.session("p")
            reply = await parent.generate(task(0), GenerateArgs(max_tokens=16))
            at_fork = [*task(0), reply.to_message()]

            async def fork(i: int) -> list[Any]:
                session = host.session(f"p > fork#{i}", fork_of="p")
                mine, replies = [*at_fork, {"role": "user", "content": FORK_TASK.format(task=f"check part {i}")}], []
                for turn in range(2):  # the second turn finds its cache spilled while the other fork ran
                    replies.append((await session.generate(mine, GenerateArgs(max_tokens=16))).token_ids)
                    mine = [*mine, {"role": "assistant", "content": "ok"}, {"role": "user", "content": f"part {turn}?"}]
                return replies

            out = list(await asyncio.gather(fork(1), fork(2)))
            stats = await host.memory_stats()
            states = [host._pool.idle(f"p > fork#{i}") for i in (1, 2)]
            kinds = {type(c).__name__ for s in states if s and s.prompt_cache for c in s.prompt_cache}
            spilled = [
                s.spill_path for s in map(host._pool.idle, ("p", "p > fork#1", "p > fork#2")) if s and s.spill_path
            ]
        return out, stats.pool, kinds, spilled

    unbounded, free, _, _ = asyncio.run(go(0))
    bounded, pool, kinds, spilled = asyncio.run(go(896))  # the parent's prefix and one fork's turn, not both forks

    assert free["evictions"] == 0
    assert bounded == unbounded
    assert len({ids for f in bounded for ids in f}) > 1  # the turns differ: a wrong cache would show
    assert pool["restores"] == 2 and pool["spills"] >= 3 and pool["drops"] == 0
    assert kinds == {"QuantizedKVCache"}  # the last fork to run, restored as it was spilled
    assert spilled and not any(path.exists() or path.parent.exists() for path in spilled)  # the host left no file


@pytest.mark.slow
def test_a_quantized_prefix_is_stored_quantized_and_found_at_its_own_bits_only(
    quantizable: Callable[[str], Path],
) -> None:
    path = quantizable("qwen3")
    cold = ask(path, kv_bits=8)[0]
    (eight,) = stored()
    warm = ask(path, kv_bits=8)[0]
    at_16 = ask(path)[0]  # another setting: another key, so prefilled again
    (sixteen,) = set(stored()) - {eight}

    assert (cold.usage.cached_tokens, at_16.usage.cached_tokens) == (0, 0)
    assert warm.usage.cached_tokens > 256 and warm.token_ids == cold.token_ids
    # 8 bits in groups of 64 with fp32 scales and biases: 72 bytes per 64 values against 256 (header aside)
    assert eight.stat().st_size < 0.3 * sixteen.stat().st_size


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_the_kv_bytes_counted_are_the_bytes_the_quantized_arrays_hold(
    bits: int, quantizable: Callable[[str], Path]
) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_subagents.host.kv.kv_pool import cache_nbytes

    def arrays_bytes(cache: list[Any]) -> int:
        return sum(v.nbytes for c in cache for _, v in tree_flatten(c.state) if isinstance(v, mx.array))

    def own_bytes(cache: list[Any]) -> int:  # its own arrays: not the shared prefix it starts from
        return sum(v.nbytes for c in cache for _, v in tree_flatten((c.keys, c.values)) if isinstance(v, mx.array))

    async def go() -> tuple[Any, list[tuple[int, int, int]], list[tuple[int, int]]]:
        async with MlxModelHost(str(quantizable("qwen3")), kv_bits=bits) as host:
            await asyncio.gather(*(conversation(host, i) for i in range(2)))
            sessions, states = [], []
            for i in range(2):
                state = host._pool.idle(f"s{i}")
                assert state is not None
                states.append(state.prompt_cache)
                sessions.append((host.session(f"s{i}").kv_bytes, cache_nbytes(state.prompt_cache), own_bytes(state.prompt_cache)))  # fmt: skip
            # Every array the two sessions hold, each once: their own and the prefix they start from, if
            # it is long enough to be shared (MIN_SHARED_TOKENS), once.
            unique = {id(v): v.nbytes for s in states for c in s for _, v in tree_flatten(c.state) if isinstance(v, mx.array)}  # fmt: skip
            prefixes = {id(c.shared): c.shared.nbytes for s in states for c in s if getattr(c, "shared", None)}
            assert sum(unique.values()) == sum(n for n, _, _ in sessions) + sum(prefixes.values())

            def held(n: int) -> tuple[int, int]:
                cache = host.kv_setting.make_cache(host._model)
                host._model(mx.array([[1] * n]), cache=cache)
                mx.eval([c.state for c in cache])
                return arrays_bytes(cache), host.kv_shape.bytes_for(n)

            return host.kv_shape, sessions, [await host._mlx.run(lambda n=n: held(n)) for n in (1, 256, 300, 700)]

    shape, sessions, sizes = asyncio.run(go())

    # 2 layers x (keys, values) x 2 KV heads x 64 values: packed `bits` each, a 4-byte scale and bias per 64
    assert shape.per_token == 2 * 2 * 2 * (64 * bits // 8 + 2 * 4)
    assert all(counted == nbytes == real > 0 for counted, nbytes, real in sessions)
    assert all(real == estimated for real, estimated in sizes)


def test_the_same_budget_holds_a_longer_window_at_fewer_bits(quantizable: Callable[[str], Path]) -> None:
    async def window(bits: int) -> int:
        async with MlxModelHost(str(quantizable("qwen3")), kv_bits=bits, kv_budget="8MiB") as host:
            return host.context_window

    # 8 MiB for 5 sessions: (window + 256) x bytes per token fits 1.6 MiB: 2,048 / 576 / 320 bytes per token
    assert [asyncio.run(window(bits)) for bits in (16, 8, 4)] == [512, 2560, 4096]


@pytest.mark.slow
def test_a_model_that_cannot_take_a_quantized_cache_warns_once_and_runs_at_16_bits(
    tiny_qwen3_path: Path, caplog: Any
) -> None:
    async def go(bits: int) -> tuple[Any, int, Any]:
        async with MlxModelHost(str(tiny_qwen3_path), kv_bits=bits) as host:
            out = await asyncio.gather(*(conversation(host, i) for i in range(2)))
            return out, host.kv_bits, host.kv_shape

    with caplog.at_level(logging.WARNING, logger="mlx_subagents"):
        asked_8 = asyncio.run(go(8))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    plain = asyncio.run(go(16))

    assert warnings == [
        f"--kv-bits 8: {tiny_qwen3_path}: its attention heads are 16 wide and mlx quantizes in groups of 32 "
        "or 64; its KV cache stays at 16 bits"
    ]
    assert asked_8 == plain and asked_8[1] == 16  # the same run as at 16 bits


def test_an_attention_that_refuses_a_quantized_cache_is_found_at_load() -> None:
    """gpt-oss's attention has sinks, which mlx-lm's quantized path refuses: found on three tokens."""
    from mlx_lm.models import gpt_oss

    args = gpt_oss.ModelArgs(
        num_hidden_layers=2,
        num_local_experts=2,
        num_experts_per_tok=1,
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    assert kv_setting(gpt_oss.Model(args), 8) == (
        KVSetting(),
        "its attention does not take a quantized cache (Quantized SDPA does not support attention sinks.)",
    )
