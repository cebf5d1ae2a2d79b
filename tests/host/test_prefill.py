"""Prefill in slices between decode steps (host/mlx/prefill.py), on tiny real models with forced decoding.

The step-driven tests drive the scheduler on the test's thread, as test_single.py does, and count what
each step did; the others go through the host and compare every session's tokens with slicing off.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.errors import RequestError
from mlx_subagents.host import GenerateArgs, MlxModelHost, parse_prefill_slice
from mlx_subagents.host.kv.kv_pool import CacheState, KVPool, KVShape
from mlx_subagents.host.mlx.decode_stage import COMPLETION_BATCH_SIZE, FIRST_WORDS_TOKENS
from mlx_subagents.host.mlx.prefill import SlicePolicy, describe
from mlx_subagents.host.mlx.scheduler import Scheduler, SchedulerConfig
from mlx_subagents.host.mlx.turn import OutputSink, Request, Turn, TurnOutput
from mlx_subagents.testing import ForcedScripts, make_tiny_model
from tests.helpers import texts
from tests.host.test_batching import SYSTEM, Forwards, result, task

SCRIPT = " ".join(f"word{n}" for n in range(800))  # longer than any reply here


def long_task(i: int, lines: int) -> list[dict[str, Any]]:
    """A task with a file's worth of text in it: a prompt of many slices."""
    body = "\n".join(f"{n:>5}  def handler_{i}_{n}(request): return route(request, {n * 7 % 97})" for n in range(lines))
    return [SYSTEM, {"role": "user", "content": f"Task {i}: what does this file do?\n{body}"}]


def scheduler(tiny: tuple[Any, Any], prefill_slice: int | str, factory: Any = None, step_size: int = 512) -> Scheduler:
    model, tokenizer = tiny
    config = SchedulerConfig(prefill_slice=prefill_slice, prefill_step_size=step_size)
    return Scheduler(model, tokenizer, config, KVPool(None), KVShape(0, 0), True, factory)


def make_turn(name: str, messages: list[dict[str, Any]], max_tokens: int, results: dict[str, Any]) -> Turn:
    def deliver(output: TurnOutput) -> None:
        if output.ended:
            results[name] = output.reply if output.error is None else output.error

    return Turn(
        name,
        CacheState(),
        Request(messages, None, max_tokens, 0.0),
        threading.Event(),
        OutputSink(None, deliver, streams=False),
    )


def test_the_prefill_slice_setting_is_auto_off_or_tokens() -> None:
    assert [parse_prefill_slice(v) for v in (None, "auto", "OFF", "64", 32)] == ["auto", "auto", "off", 64, 32]
    for bad in ("0", "-3", "fast", 0):
        with pytest.raises(RequestError, match=r"^--prefill-slice .* is not auto, off or a number of tokens; use e"):
            parse_prefill_slice(bad)
    assert SlicePolicy.of("off", 512) is None
    assert SlicePolicy.of(64, 512) == SlicePolicy(64, 512) and SlicePolicy.of(4096, 512).tokens == 512
    assert describe("auto", 512).startswith("auto: slices of about 8 decode steps' time (at least 16 tokens)")


@pytest.mark.slow
def test_a_decoder_keeps_decoding_while_a_long_prompt_is_prefilled(tiny_qwen3: tuple[Any, Any]) -> None:
    """a decodes on its own; b arrives with a prompt of about 1,500 tokens. Sliced, a gets at least a token
    between every two of b's slices of 64; with slicing off b joins the batch at once and a gets one
    token per 512-token chunk. Both as serialized, token for token."""
    gained, replies = {}, {}
    for slicing in (64, "off"):
        results: dict[str, Any] = {}
        factory = ForcedScripts(tiny_qwen3[1], {"a": [SCRIPT]})
        sch = scheduler(tiny_qwen3, slicing, factory)
        a, b = make_turn("a", task(0), 300, results), make_turn("b", long_task(1, 60), 4, results)
        sch.submit(a)
        for _ in range(3):
            sch.step()
        sch.submit(b)
        at_arrival = len(a.generated)
        while not b.generated:
            sch.step()
        gained[slicing] = len(a.generated) - at_arrival
        while sch.has_work():
            sch.step()
        replies[slicing] = (results["a"].token_ids, results["b"].token_ids)
        n_prompt = len(b.ids)
    assert 1400 < n_prompt < 1700
    assert gained[64] >= (n_prompt - 40) // 64 - 1  # the shared system prompt was cached
    assert gained["off"] <= n_prompt // 512 + 4  # one as b arrives, one handed over, then one per chunk
    assert replies[64] == replies["off"]
    assert len(replies[64][0]) == 300 and len(replies[64][1]) == 4


@pytest.mark.slow
def test_a_short_prompt_arriving_during_a_long_prefill_decodes_before_it(tiny_qwen3: tuple[Any, Any]) -> None:
    """Shortest first: c (a short task) arrives while b's long prompt is prefilled in slices and has
    its first token, and its last, before b has its first."""
    results: dict[str, Any] = {}
    sch = scheduler(tiny_qwen3, 32, ForcedScripts(tiny_qwen3[1], {"a": [SCRIPT]}))
    a, b = make_turn("a", task(0), 400, results), make_turn("b", long_task(1, 60), 4, results)
    c = make_turn("c", task(2), 6, results)
    sch.submit(a)
    while not a.generated:
        sch.step()
    sch.submit(b)
    for _ in range(6):
        sch.step()
    assert 0 < b.prefill.pos < len(b.ids) // 4  # b is being prefilled
    sch.submit(c)
    while "c" not in results:
        sch.step()
    assert len(results["c"].token_ids) == 6 and not b.generated and b in sch.prefill.turns
    while sch.has_work():
        sch.step()
    assert len(results["b"].token_ids) == 4 and results["b"].usage.prefill_wait_seconds > 0


@pytest.mark.slow
@pytest.mark.parametrize("lines", [8, 22])
def test_turns_arriving_together_get_first_tokens_oldest_first_each_after_only_the_prefills_before_it(
    tiny_qwen3: tuple[Any, Any], lines: int
) -> None:
    """Four prompts submitted together with nothing decoding (of 233 tokens: one slice each, at once; of
    577: slices of 64 while others decode): the oldest is prefilled alone and has its first token out
    after its own prefill, the second after two prefills, and so on (never one padded group that gives
    every first token after all four, nor a turn's first token held in mlx-lm's batch while the next is
    prefilled); every turn already decoding gains a token between any two slices of the later ones."""
    results: dict[str, Any] = {}
    names = ["a", "b", "c", "d"]
    sch = scheduler(tiny_qwen3, 64, ForcedScripts(tiny_qwen3[1], {n: [SCRIPT] for n in names}))
    turns = [make_turn(n, long_task(i, lines), 3000, results) for i, n in enumerate(names)]

    def watch() -> tuple[tuple[bool, ...], int]:  # at each prefill forward: who has a token, tokens decoded
        return tuple(bool(t.generated) for t in turns), sum(len(t.generated) for t in turns)

    forwards = sch.prefill.model = Forwards(sch.prefill.model, watch)
    for turn in turns:
        sch.submit(turn)
    firsts: dict[str, int] = {}  # who had a first token, and in which step
    for step in range(5000):
        sch.step()
        firsts |= {t.name: step for t in turns if t.generated and t.name not in firsts}
        if len(firsts) == 4:
            break
    assert list(firsts) == names and all(len(t.generated) < 3000 for t in turns), results  # errors, if any
    assert sorted(set(firsts.values())) == list(firsts.values())  # each in a step of its own
    prefilled = [len(t.ids) - 1 - t.prefill.n_cached for t in turns]
    assert len(set(len(t.ids) for t in turns)) == 1 and prefilled[0] > prefilled[1]  # b, c, d start from a's prefix
    slices = 1 if prefilled[1] <= 512 else -(-prefilled[1] // 64)  # each of b, c and d
    assert all(rows == 1 for rows, _ in forwards.shapes) and sum(n for _, n in forwards.shapes) == sum(prefilled)
    fed = [(n, has, done) for (_, n), (has, done) in zip(forwards.shapes, forwards.seen, strict=True)]
    before_first = [sum(n for n, has, _ in fed if not has[i]) for i in range(4)]
    assert before_first == [sum(prefilled[: i + 1]) for i in range(4)]
    after_a = [done for _, has, done in fed if has[0]]  # the slices while a (then b, c) decoded
    assert len(after_a) == 3 * slices and all(y > x for x, y in zip(after_a, after_a[1:]))
    for turn in turns:
        turn.cancel.set()
    while sch.has_work():
        sch.step()


@pytest.mark.slow
def test_later_turns_arriving_together_while_one_decodes_are_prefilled_back_to_back_each_after_the_words_before(
    tiny_qwen3: tuple[Any, Any],
) -> None:
    """Four conversations' second turns (each under a prefill step of new tokens: a chat client's next
    message) arrive together while a fifth session decodes. Each new part is prefilled whole in one
    slice, the oldest first, without waiting for a decoders' share, and the next slice runs once the turn
    handed over has its first words out to its caller: b's reply opens with two newlines (its words come
    with its third token), c's with twelve (the prefill waits for `FIRST_WORDS_TOKENS` of them, no more),
    d's with a word. Before, the next slice ran at a first token of whitespace and b's words reached its
    caller a prefill later, with c's first token."""
    tokenizer = tiny_qwen3[1]
    newline, words = tokenizer.encode("\n"), tokenizer.encode(" Found it in config.py at line 12, as asked.")
    assert len(newline) == 1
    opens = {"b": 2, "c": 12, "d": 0, "e": 1}  # newlines before the first word
    results: dict[str, Any] = {}
    scripts = {n: ["Noted.", newline * k + words] for n, k in opens.items()}
    sch = scheduler(tiny_qwen3, "auto", ForcedScripts(tokenizer, {"a": [SCRIPT], **scripts}))
    asked = {n: long_task(i, 8) for i, n in enumerate(opens, 1)}
    first_turns = [make_turn(n, asked[n], 2, results) for n in opens]
    for turn in first_turns:
        sch.submit(turn)
    while sch.has_work():
        sch.step()
    a = make_turn("a", task(0), 3000, results)
    sch.submit(a)
    while not a.generated:
        sch.step()
    heard = {n: "" for n in opens}  # the text each caller of a later turn was handed so far
    turns = []
    for i, (name, before) in enumerate(zip(opens, first_turns, strict=True), 1):
        later = make_turn(name, [*asked[name], {"role": "assistant", "content": "Noted."}, result(i, 1)], 40, results)
        later.state = before.state  # the same session: its cache holds the first turn

        def hear(output: TurnOutput, name: str = name, then: Any = later.sink.receive) -> None:
            heard[name] += output.text
            then(output)

        later.sink = OutputSink(None, hear)  # it streams, on this thread
        turns.append(later)
    forwards = sch.prefill.model = Forwards(
        sch.prefill.model, lambda: (len(a.generated), {t.name: (len(t.generated), heard[t.name]) for t in turns})
    )
    for turn in turns:
        sch.submit(turn)
    while not all(t.generated for t in turns):
        sch.step()
    new = [len(t.ids) - 1 - t.prefill.n_cached for t in turns]
    assert all(0 < n <= 512 for n in new) and all(t.prefill.n_cached > 200 for t in turns)  # the first turn cached
    assert forwards.shapes == [(1, n) for n in new]  # one slice each, the oldest first
    at_slices = [seen for _, seen in forwards.seen]
    # At each slice, the turns before it: how many tokens each had, and whether its caller had its words.
    assert [at[t.name][0] for at, t in zip(at_slices[1:], turns, strict=False)] == [3, FIRST_WORDS_TOKENS, 1]
    assert heard_at(at_slices[1], "b") == "Found" and heard_at(at_slices[3], "d") == "Found"
    assert at_slices[2]["c"][1].strip() == ""  # c's caller had only newlines (or nothing) when d's slice ran
    gained = [g for g, _ in forwards.seen]
    assert all(y > x for x, y in zip(gained, gained[1:]))  # a decodes on between slices
    while sch.has_work():
        sch.step()
    assert [results[n].text.strip() for n in opens] == [tokenizer.decode(words).strip()] * 4


def heard_at(seen: dict[str, tuple[int, str]], name: str) -> str:
    """The first word a caller was handed, as `seen` at a slice recorded it."""
    return seen[name][1].split()[0]


@pytest.mark.slow
@pytest.mark.parametrize("together", [False, True])
def test_a_cancelled_turn_mid_prefill_leaves_no_slice_state_and_parks_what_it_holds(
    tiny_qwen3: tuple[Any, Any], together: bool
) -> None:
    """b is cancelled after some slices of its prompt (alone while a decodes, or in a group with c, both
    short and arriving with nothing decoding, prefilled 8 tokens a slice): it leaves the prefill and its
    group, no bytes of it stay in flight, its cache holds exactly what was prefilled and is parked for its
    next turn; c goes on on its own cache to the same tokens as without b."""
    results: dict[str, Any] = {}
    factory = ForcedScripts(tiny_qwen3[1], {"a": [SCRIPT]})
    step_size = 8 if together else 512
    sch = scheduler(tiny_qwen3, 64, factory, step_size)
    asked = task(1) if together else long_task(1, 45)
    b, c = make_turn("b", asked, 4, results), make_turn("c", task(2), 4, results)
    a = make_turn("a", task(0), 200, results)
    sch.submit(c if together else a)
    if not together:
        sch.step()
    sch.submit(b)
    for _ in range(40):  # until a slice of b's own prompt went in
        sch.step()
        if b.prefill is not None and b.prefill.pos > b.prefill.n_cached:
            break
    assert (
        (len(sch.prefill.groups) == 1 and set(sch.prefill.groups[0].turns) == {b, c})
        if together
        else not sch.prefill.groups
    )
    assert 0 < b.prefill.pos < len(b.ids) - 1
    b.cancel.set()
    sch.step()
    assert results["b"].finish_reason == "cancelled" and b not in sch.prefill.turns and b.prefill.group is None
    spent = results["b"].usage  # what it prefilled, not the rest of its prompt
    assert (spent.prompt_tokens, spent.prefilled_tokens) == (b.prefill.pos, b.prefill.pos - b.prefill.n_cached)
    assert not sch.prefill.groups and (c.prefill is None or c.prefill.group is None)
    held = sch.pool.idle("b")
    assert held is b.state and held.token_ids == b.ids[: b.prefill.pos]
    assert {layer.offset for layer in held.prompt_cache} == {b.prefill.pos}
    in_flight = sch.resident_bytes() - sch.pool.idle_bytes() - sch.prefixes.nbytes()
    other = c if together else a  # the only work left in flight: on its own cache
    uid, cache = (other.decode.uid, other.decode.cache) if other.decode else (None, other.prefill.cache)
    assert uid is None and in_flight == sum(layer.nbytes for layer in cache) > 0
    while sch.has_work():
        sch.step()
    # The next turn of b reuses exactly what it had prefilled.
    again = make_turn("b", asked, 4, results)
    again.state = b.state
    sch.submit(again)
    while sch.has_work():
        sch.step()
    assert results["b"].usage.cached_tokens == b.prefill.pos
    if together:
        alone: dict[str, Any] = {}
        ref = scheduler(tiny_qwen3, 64, step_size=step_size)
        ref.submit(make_turn("c", task(2), 4, alone))
        while ref.has_work():
            ref.step()
        assert results["c"].token_ids == alone["c"].token_ids


# -- sliced and unsliced, token for token, through the host ------------------------------------------


@pytest.fixture(scope="module")
def tiny_gemma3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny gemma3-like folder: every other layer a sliding window shorter than the prompts."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3_text")


async def interleaved(path: Path, tokenizer: Any, prefill_slice: int | str) -> dict[str, tuple[int, ...]]:
    """d decodes (forced) while L (a long prompt) and S (a short one) arrive; then L's second turn and
    a fork of L, d still decoding. Everyone else decodes greedily: their tokens depend on every cache."""
    scripts = ForcedScripts(tokenizer, {"d": [SCRIPT]})
    args = GenerateArgs(max_tokens=10)
    async with MlxModelHost(str(path), processor_factory=scripts, prefill_slice=prefill_slice) as host:
        started = asyncio.Event()
        d = asyncio.create_task(
            host.session("d").generate(task(0), GenerateArgs(max_tokens=1600, on_event=texts(lambda _: started.set())))
        )
        await started.wait()
        first = long_task(1, 30)
        long, short = await asyncio.gather(
            host.session("L").generate(first, args), host.session("S").generate(task(2), args)
        )
        second = first + [long.to_message(), result(1, 0)]
        fork = first + [long.to_message(), {"role": "user", "content": "Now list the handlers."}]
        again, forked = await asyncio.gather(
            host.session("L").generate(second, args), host.session("F", fork_of="L").generate(fork, args)
        )
        assert not d.done()  # all of it while d decoded
        d.cancel()
        out = {"L": long, "S": short, "L2": again, "F": forked}
        assert forked.usage.cached_tokens > 0 and again.usage.cached_tokens > len(long.token_ids)
        return {name: r.token_ids for name, r in out.items()}


@pytest.mark.slow
@pytest.mark.parametrize("arch_fixture", ["tiny_qwen3_path", "tiny_qwen35_path", "tiny_gemma3_path"])
def test_sliced_and_unsliced_give_the_same_tokens(arch_fixture: str, request: pytest.FixtureRequest) -> None:
    """Dense, hybrid (gated-delta layers: snapshots, no trimming) and sliding-window caches; a turn
    that reuses its cache and a fork that starts from its parent's."""
    import mlx_lm

    path: Path = request.getfixturevalue(arch_fixture)
    tokenizer = mlx_lm.load(str(path))[1]
    sliced = asyncio.run(interleaved(path, tokenizer, 16))
    unsliced = asyncio.run(interleaved(path, tokenizer, "off"))
    assert sliced == unsliced
    assert all(len(ids) > 0 for ids in sliced.values())


@pytest.mark.slow
def test_a_restored_spill_gives_the_same_tokens_sliced(tiny_qwen3_path: Path) -> None:
    """Three conversations on a budget that holds one: caches are spilled and restored between turns,
    and the restored prompts are prefilled in slices while the others decode."""
    from tests.host.test_batching import conversation

    async def go(prefill_slice: int | str) -> tuple[list[Any], Any]:
        async with MlxModelHost(
            str(tiny_qwen3_path), kv_budget=1024 * 1024, max_sessions=1, share_prefix=False, prefill_slice=prefill_slice
        ) as host:
            out = list(await asyncio.gather(*(conversation(host, i, turns=3, max_tokens=8) for i in range(3))))
            return out, await host.memory_stats()

    sliced, stats = asyncio.run(go(16))
    unsliced, _ = asyncio.run(go("off"))
    assert sliced == unsliced
    assert stats.pool["spills"] > 0 and stats.pool["restores"] > 0


@pytest.mark.slow
def test_a_turns_prefill_is_told_at_its_first_slice_once(tiny_qwen3: tuple[Any, Any]) -> None:
    """b (long) and c (short) arrive in one step while a decodes: c is prefilled first, so c's prefill
    is told first; b's only in the step of its own first slice (until then it waits), each exactly once
    with the tokens it computes and those it reuses."""
    loop, told, results = asyncio.new_event_loop(), [], {}
    try:
        sch = scheduler(tiny_qwen3, 32, ForcedScripts(tiny_qwen3[1], {"a": [SCRIPT]}))
        a, b, c = (
            make_turn(n, m, k, results)
            for n, m, k in (("a", task(0), 300), ("b", long_task(1, 30), 2), ("c", task(2), 2))
        )
        for turn in (b, c):

            def receive(output: TurnOutput, name: str = turn.name, then: Any = turn.sink.receive) -> None:
                if output.prefill is not None:
                    told.append((name, *output.prefill))
                then(output)

            turn.sink = OutputSink(None, receive)
        sch.submit(a)
        while not a.generated:
            sch.step()
        sch.submit(b)
        sch.submit(c)
        seen: list[tuple[str, int]] = []  # (who was told, how far b's cache held it then)
        while not b.out.told or "c" not in results:
            held = b.prefill.pos if b.prefill is not None else 0
            sch.step()
            loop.run_until_complete(asyncio.sleep(0))
            seen += [(name, held) for name, *_ in told[len(seen) :]]
            assert not b.out.told or b.prefill.pos > b.prefill.n_cached
        assert [name for name, _ in seen] == ["c", "b"] and seen[1][1] == b.prefill.n_cached
        assert told == [
            ("c", len(c.ids) - c.prefill.n_cached, c.prefill.n_cached),
            ("b", len(b.ids) - b.prefill.n_cached, b.prefill.n_cached),
        ]
        assert c.prefill.n_cached > 0 and b.prefill.n_cached == c.prefill.n_cached  # the shared system prompt
        while sch.has_work():
            sch.step()
        assert len(told) == 2 and len(results["b"].token_ids) == 2
    finally:
        loop.close()


@pytest.mark.slow
def test_a_turn_waiting_for_a_row_of_a_full_batch_does_not_hold_up_the_prefill(tiny_qwen3: tuple[Any, Any]) -> None:
    """Eight turns decode (mlx-lm's batch starts no more rows: `COMPLETION_BATCH_SIZE`); a ninth handed over
    waits for one of them to end. The prefill goes on meanwhile: a long prompt arriving then is prefilled
    and handed over too (it waited for the ninth's first token, which cannot come before a row ends)."""
    results: dict[str, Any] = {}
    names = [f"d{i}" for i in range(COMPLETION_BATCH_SIZE)]
    sch = scheduler(tiny_qwen3, 64, ForcedScripts(tiny_qwen3[1], {n: [SCRIPT] for n in names}))
    decoders = [make_turn(n, task(i), 2000, results) for i, n in enumerate(names)]
    for turn in decoders:
        sch.submit(turn)
    while not all(t.generated for t in decoders):
        sch.step()
    ninth, long = make_turn("ninth", task(9), 4, results), make_turn("long", long_task(10, 30), 4, results)
    sch.submit(ninth)
    while ninth not in sch.decode.turns():
        sch.step()
    sch.submit(long)
    for _ in range(200):
        sch.step()
        if long in sch.decode.turns():
            break
    assert long in sch.decode.turns() and long.prefill.pos == len(long.ids) - 1
    assert not ninth.generated and not results  # the ninth still waits for a row: none of the eight ended
    for turn in [*decoders, ninth, long]:
        turn.cancel.set()
    while sch.has_work():
        sch.step()
