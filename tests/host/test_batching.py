"""Continuous batching, the shared prefix and the bounded KV pool, on tiny real models."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.host import GenerateArgs, MlxModelHost
from mlx_subagents.testing import ForcedScripts
from tests.helpers import texts

SYSTEM = {"role": "system", "content": "You are a scout. Report exact paths and line ranges for what you find."}


def task(i: int) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": f"Task {i}: where is module {i * 7} configured?"}]


def result(i: int, turn: int) -> dict[str, Any]:
    body = "\n".join(f"{n:>4}  def handler_{i}_{turn}_{n}(request): return route(request, {n})" for n in range(12))
    return {"role": "user", "content": f"Tool output:\n{body}"}


async def conversation(host: MlxModelHost, i: int, turns: int = 2, max_tokens: int = 16) -> list[tuple[int, ...]]:
    session = host.session(f"s{i}")
    messages = task(i)
    out = []
    for turn in range(turns):
        reply = await session.generate(messages, GenerateArgs(max_tokens=max_tokens))
        out.append(reply.token_ids)
        messages = messages + [reply.to_message(), result(i, turn)]
    return out


class Forwards:
    """A model that records the shape of the tokens of every forward pass it runs, and with `watch` what
    `watch()` said as each began (the rest of the model is the model's)."""

    def __init__(self, model: Any, watch: Any = None) -> None:
        self.model, self.shapes, self.watch, self.seen = model, [], watch, []

    def __call__(self, tokens: Any, *args: Any, **kwargs: Any) -> Any:
        self.shapes.append(tuple(tokens.shape))
        if self.watch is not None:
            self.seen.append(self.watch())
        return self.model(tokens, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


async def everyone(path: Path, n: int = 4, **options: Any) -> list[list[tuple[int, ...]]]:
    async with MlxModelHost(str(path), **options) as host:
        return list(await asyncio.gather(*(conversation(host, i) for i in range(n))))


async def each_on_a_fresh_host(path: Path, n: int = 4) -> list[list[tuple[int, ...]]]:
    out = []
    for i in range(n):
        async with MlxModelHost(str(path), batching=False, share_prefix=False) as host:
            out.append(await conversation(host, i))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("arch_fixture", ["tiny_qwen3_path", "tiny_qwen35_path"])
def test_batched_serialized_and_separate_are_token_identical(arch_fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(arch_fixture)
    batched = asyncio.run(everyone(path, batching=True))
    serialized = asyncio.run(everyone(path, batching=False))
    separate = asyncio.run(each_on_a_fresh_host(path))
    assert batched == serialized == separate
    assert len({turns[0] for turns in separate}) > 1  # the sessions really differ


@pytest.mark.slow
def test_session_joins_a_running_batch(tiny_qwen3_path: Path, tiny_qwen3: Any) -> None:
    long_text = " ".join(f"step{i}" for i in range(120))
    order: list[str] = []

    async def go(batching: bool) -> tuple[Any, Any]:
        scripts = ForcedScripts(tiny_qwen3[1], {"s0": [long_text]})
        async with MlxModelHost(str(tiny_qwen3_path), processor_factory=scripts, batching=batching) as host:
            started = asyncio.Event()

            def on_a(text: str) -> None:
                order.append("a")
                started.set()

            a = asyncio.create_task(
                host.session("s0").generate(task(0), GenerateArgs(max_tokens=400, on_event=texts(on_a)))
            )
            await started.wait()
            # On its own, s0 decodes on mlx-lm's single-sequence path; s1 moves it into the batch.
            assert host._scheduler.decode.batch is None and host._scheduler.decode.single is not None or not batching
            b = await host.session("s1").generate(
                task(1), GenerateArgs(max_tokens=12, on_event=texts(lambda t: order.append("b")))
            )
            assert (host._scheduler.decode.batch is not None) == batching
            return await a, b

    a_batched, b_batched = asyncio.run(go(True))
    assert "a" in order[order.index("b") :]  # b streamed while a was still decoding
    order.clear()
    a_serial, b_serial = asyncio.run(go(False))
    assert order.index("b") > len(order) - 13  # serialized: b waits for a to finish
    assert a_batched.text == long_text == a_serial.text
    assert b_batched.token_ids == b_serial.token_ids


def test_sessions_started_together_decode_in_one_batch_from_their_first_token(
    tiny_qwen3_path: Path, tiny_qwen3: Any
) -> None:
    """Four sessions arriving at once, with nothing decoding, prefill what follows their cached prefix
    as one padded batch (one forward of four rows), then enter mlx-lm's batch in the same step: every
    decode step yields a token for each of them (none decodes on the single path while the others
    prefill), and the batch itself prefills nothing."""
    texts = {f"s{i}": [" ".join(f"word{i}_{n}" for n in range(20))] * 2 for i in range(4)}

    async def go() -> tuple[list[tuple[int, ...]], Any, list[int], list[tuple[int, ...]]]:
        scripts = ForcedScripts(tiny_qwen3[1], texts)
        async with MlxModelHost(str(tiny_qwen3_path), processor_factory=scripts) as host:
            await asyncio.gather(
                *(host.session(f"s{i}").generate(task(i), GenerateArgs(max_tokens=8)) for i in range(4))
            )
            for i in range(4):
                await host.session(f"s{i}").reset()
            prefills = Forwards(host._scheduler.prefill.model)  # what the prefill feeds (the batch keeps the model)
            host._scheduler.prefill.model = prefills
            with host._scheduler.decode.batch.stats() as stats:
                replies = await asyncio.gather(
                    *(host.session(f"s{i}").generate(task(i), GenerateArgs(max_tokens=8)) for i in range(4))
                )
            return [r.token_ids for r in replies], stats, [r.usage.prefilled_tokens for r in replies], prefills.shapes

    token_ids, stats, prefilled, shapes = asyncio.run(go())
    assert stats.generation_tokens == 4 * 8 and stats.generation_steps == 8
    assert stats.prompt_tokens == 0  # the batch only decodes: each enters it with its last prompt token to feed
    assert shapes == [(4, max(prefilled) - 1)]  # one padded forward of all four, up to each one's last token
    assert [len(t) for t in token_ids] == [8, 8, 8, 8] and len(set(token_ids)) == 4


@pytest.mark.slow
def test_hybrid_sessions_started_together_decode_in_one_batch_from_their_first_token(
    tiny_qwen35_path: Path, tiny_qwen35: Any
) -> None:
    """On a hybrid model each turn saves a snapshot before its generation prompt, so it has a stop
    before its end: four sessions arriving at once all reach their end, then enter mlx-lm's batch
    in the same step (none decodes on the single path while the others prefill), with the tokens and the
    prefilled and cached counts of one session at a time."""
    texts = {f"s{i}": [" ".join(f"word{i}_{n}" for n in range(20))] * 2 for i in range(4)}
    Round = tuple[list[tuple[int, ...]], list[tuple[int, int, int]]]

    async def go(batching: bool) -> tuple[list[Round], list[Any], int]:
        scripts = ForcedScripts(tiny_qwen35[1], texts)
        async with MlxModelHost(str(tiny_qwen35_path), processor_factory=scripts, batching=batching) as host:
            scheduler = host._scheduler
            await host._mlx.run(scheduler.decode.ensure_batch)  # there from the start, to count its steps
            rounds, stats = [], []
            for _ in range(2):  # the first computes the shared prefix; the second starts from it
                with scheduler.decode.batch.stats() as window:
                    replies = await asyncio.gather(
                        *(host.session(f"s{i}").generate(task(i), GenerateArgs(max_tokens=8)) for i in range(4))
                    )
                usage = [(r.usage.prompt_tokens, r.usage.cached_tokens, r.usage.prefilled_tokens) for r in replies]
                rounds.append(([r.token_ids for r in replies], usage))
                stats.append(window)
                for i in range(4):
                    await host.session(f"s{i}").reset()
            system_text = host.tokenizer.apply_chat_template([SYSTEM], tokenize=False, add_generation_prompt=False)
            return rounds, stats, len(host.tokenizer.encode(system_text, add_special_tokens=False))

    batched, stats, n_prefix = asyncio.run(go(True))
    serialized, serial_stats, _ = asyncio.run(go(False))
    for window in stats:  # every token from the batch, all four in each of its 8 steps
        assert window.generation_tokens == 4 * 8 and window.generation_steps == 8
    assert [w.generation_tokens for w in serial_stats] == [0, 0]
    assert batched == serialized
    (first, first_usage), (second, second_usage) = batched
    assert first == second and [len(t) for t in first] == [8] * 4 and len(set(first)) == 4
    assert [cached for _, cached, _ in first_usage] == [0, n_prefix, n_prefix, n_prefix]
    assert [cached for _, cached, _ in second_usage] == [n_prefix] * 4
    assert all(prefilled == prompt - cached for prompt, cached, prefilled in first_usage + second_usage)


def test_shared_prefix_is_prefilled_once(tiny_qwen3_path: Path) -> None:
    async def go(share: bool) -> tuple[list[Any], int]:
        async with MlxModelHost(str(tiny_qwen3_path), share_prefix=share) as host:
            replies = await asyncio.gather(
                *(host.session(f"s{i}").generate(task(i), GenerateArgs(max_tokens=4)) for i in range(4))
            )
            system_text = host.tokenizer.apply_chat_template([SYSTEM], tokenize=False, add_generation_prompt=False)
            prefix = len(host.tokenizer.encode(system_text, add_special_tokens=False))
            return list(replies), prefix if share else 0

    shared, n_prefix = asyncio.run(go(True))
    private, _ = asyncio.run(go(False))
    assert [r.usage.cached_tokens for r in shared] == [0, n_prefix, n_prefix, n_prefix]
    assert [r.usage.cached_tokens for r in private] == [0, 0, 0, 0]
    assert (
        sum(r.usage.prefilled_tokens for r in shared) == sum(r.usage.prefilled_tokens for r in private) - 3 * n_prefix
    )
    assert [r.token_ids for r in shared] == [r.token_ids for r in private]


@pytest.mark.slow
def test_small_budget_spills_restores_and_never_overflows(tiny_qwen3_path: Path) -> None:
    async def go(budget: int | None) -> tuple[list[Any], Any, int | None]:
        async with MlxModelHost(str(tiny_qwen3_path), kv_budget=budget, max_sessions=1, share_prefix=False) as host:
            out = list(await asyncio.gather(*(conversation(host, i, turns=3, max_tokens=8) for i in range(3))))
            stats = await host.memory_stats()
            return out, stats, host.kv_budget

    unbounded, free_stats, free_budget = asyncio.run(go(0))
    bounded, stats, budget = asyncio.run(go(1024 * 1024))
    assert free_budget is None and free_stats.pool["evictions"] == 0
    assert bounded == unbounded
    assert budget == 1024 * 1024
    assert stats.pool["peak_bytes"] <= budget
    assert stats.pool["evictions"] > 0 and stats.pool["spills"] > 0 and stats.pool["restores"] > 0


def test_budget_too_small_for_the_window_is_a_clear_error(tiny_qwen3_path: Path) -> None:
    from mlx_subagents.errors import SubagentError

    async def go() -> None:
        async with MlxModelHost(str(tiny_qwen3_path), kv_budget="1MiB", context_window=4096):
            pass

    with pytest.raises(
        SubagentError,
        match=r"^a context window of 4096 tokens for 5 sessions needs .* lower --context-window or raise --kv-budget$",
    ):
        asyncio.run(go())


def test_cancelling_one_batched_session_leaves_the_others(tiny_qwen3_path: Path, tiny_qwen3: Any) -> None:
    long_text = " ".join(f"item{i}" for i in range(300))

    async def go() -> list[tuple[int, ...]]:
        scripts = ForcedScripts(tiny_qwen3[1], {"s9": [long_text]})
        async with MlxModelHost(str(tiny_qwen3_path), processor_factory=scripts) as host:
            first = asyncio.Event()
            doomed = asyncio.create_task(
                host.session("s9").generate(
                    task(9), GenerateArgs(max_tokens=600, on_event=texts(lambda _: first.set()))
                )
            )
            others = [
                asyncio.create_task(host.session(f"s{i}").generate(task(i), GenerateArgs(max_tokens=20)))
                for i in range(3)
            ]
            await first.wait()
            doomed.cancel()
            replies = await asyncio.gather(*others)
            with pytest.raises(asyncio.CancelledError):
                await doomed
            again = await host.session("s9").generate(task(9), GenerateArgs(max_tokens=5))
            assert again.usage.cached_tokens > 0
            return [r.token_ids for r in replies]

    async def serially() -> list[tuple[int, ...]]:
        async with MlxModelHost(str(tiny_qwen3_path), batching=False) as host:
            return [
                (await host.session(f"s{i}").generate(task(i), GenerateArgs(max_tokens=20))).token_ids for i in range(3)
            ]

    assert asyncio.run(go()) == asyncio.run(serially())


def test_unbatchable_caches_fall_back_to_serialized_turns(tiny_qwen3_path: Path) -> None:
    """A cache type without `merge` (here mlx-lm's ConcatenateKVCache) cannot join a batch."""
    from mlx_lm.models.cache import ConcatenateKVCache

    async def go(unbatchable: bool) -> list[list[tuple[int, ...]]]:
        async with MlxModelHost(str(tiny_qwen3_path)) as host:
            if unbatchable:
                model = host._model
                model.make_cache = lambda: [ConcatenateKVCache() for _ in model.layers]
            out = list(await asyncio.gather(*(conversation(host, i) for i in range(3))))
            if unbatchable:
                assert host._scheduler.decode.batch is None  # nothing ever went through the batch
            return out

    assert asyncio.run(go(True)) == asyncio.run(go(False))


async def first_replies(host: MlxModelHost, names: list[int], max_tokens: int = 16) -> list[Any]:
    """One turn of sessions `s<i>` at once; an exception is returned in place of its reply."""
    calls = [host.session(f"s{i}").generate(task(i), GenerateArgs(max_tokens=max_tokens)) for i in names]
    return list(await asyncio.gather(*calls, return_exceptions=True))


async def replies_one_at_a_time(path: Path, names: list[int], max_tokens: int = 16) -> list[tuple[int, ...]]:
    async with MlxModelHost(str(path), batching=False, share_prefix=False) as host:
        return [
            (await host.session(f"s{i}").generate(task(i), GenerateArgs(max_tokens=max_tokens))).token_ids
            for i in names
        ]


@pytest.mark.parametrize("where", ["factory", "processor"])
def test_one_sessions_bad_processor_fails_that_session_only(where: str, tiny_qwen3_path: Path) -> None:
    """A processor factory that raises, or a processor raising mid-decode inside the batch step."""
    failures = {"s2": 1}

    def raising(tokens: Any, logits: Any) -> Any:
        if raising.calls == 3:  # the fourth token of the reply, inside the batch step
            raise ValueError("processor refuses s2")
        raising.calls += 1
        return logits

    raising.calls = 0  # type: ignore[attr-defined]

    def factory(name: str, prompt_ids: list[int]) -> list[Any]:
        if failures.get(name, 0) == 0:
            return []
        failures[name] -= 1
        if where == "factory":
            raise ValueError("factory refuses s2")
        return [raising]

    async def go() -> tuple[list[Any], Any]:
        async with MlxModelHost(str(tiny_qwen3_path), processor_factory=factory) as host:
            replies = await first_replies(host, [0, 1, 2, 3])
            return replies, await host.session("s2").generate(task(2), GenerateArgs(max_tokens=16))

    replies, again = asyncio.run(go())
    separate = asyncio.run(replies_one_at_a_time(tiny_qwen3_path, [0, 1, 2, 3]))
    failed = replies[2]
    assert isinstance(failed, ValueError) and str(failed) == f"{where} refuses s2"
    assert [r.token_ids for r in replies[:2] + replies[3:]] == separate[:2] + separate[3:]
    assert all(len(r.token_ids) == 16 for r in replies[:2] + replies[3:])
    # The failed session is usable again and answers as if it had never failed.
    assert again.token_ids == separate[2]


def test_a_failed_batch_step_fails_its_turns_and_leaves_every_cache_consistent(tiny_qwen3_path: Path) -> None:
    async def go() -> tuple[list[Any], list[Any], list[tuple[int, ...]]]:
        async with MlxModelHost(str(tiny_qwen3_path), share_prefix=False) as host:
            idle = await host.session("s3").generate(task(3), GenerateArgs(max_tokens=8))  # parked before the failure
            batch = await host._mlx.run(host._scheduler.decode.ensure_batch)
            real_next, calls = batch.next, []

            def failing_next() -> Any:
                calls.append(1)
                if len(calls) == 5:
                    raise RuntimeError("the batch step failed")
                return real_next()

            batch.next = failing_next
            failed = await first_replies(host, [0, 1], max_tokens=40)
            assert host._scheduler.decode.batch is None and not host._scheduler.decode.decoding
            # Failed sessions start over from an empty cache; the idle one kept its cache.
            after = await first_replies(host, [0, 1], max_tokens=40)
            follow_up = task(3) + [idle.to_message(), result(3, 0)]
            s3 = await host.session("s3").generate(follow_up, GenerateArgs(max_tokens=8))
            return failed, after, [idle.token_ids, s3.token_ids, (s3.usage.cached_tokens,)]

    async def reference() -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        async with MlxModelHost(str(tiny_qwen3_path), batching=False, share_prefix=False) as host:
            first = [
                (await host.session(f"s{i}").generate(task(i), GenerateArgs(max_tokens=40))).token_ids for i in (0, 1)
            ]
            idle = await host.session("s3").generate(task(3), GenerateArgs(max_tokens=8))
            s3 = await host.session("s3").generate(
                task(3) + [idle.to_message(), result(3, 0)], GenerateArgs(max_tokens=8)
            )
            return first, [idle.token_ids, s3.token_ids, (idle.usage.prompt_tokens + idle.usage.generated_tokens,)]

    failed, after, s3 = asyncio.run(go())
    first, s3_reference = asyncio.run(reference())
    assert [type(f) for f in failed] == [RuntimeError, RuntimeError]
    assert [str(f) for f in failed] == ["the batch step failed"] * 2
    assert [r.token_ids for r in after] == first
    assert [r.usage.cached_tokens for r in after] == [0, 0]
    assert s3 == s3_reference  # same ids, and the idle session's whole cache was reused
