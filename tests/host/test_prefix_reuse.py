"""Prefix reuse by content (issue 64): a new session starts from the longest start of its prompt held
anywhere: another idle session's conversation (made a shared prefix, held once) or, in a new process,
a conversation the last one stored on disk. Counted in prefilled tokens and bytes; greedy tokens are
those of a host that reuses nothing across sessions."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.host import GenerateArgs, MlxModelHost
from mlx_subagents.host.calls.prompt import common_prefix, encode, render
from mlx_subagents.host.kv.prefix_files import list_prefixes
from mlx_subagents.testing import ForcedScripts

SYSTEM = {"role": "system", "content": "You are a scout. " + " ".join(f"Rule {n}: report paths." for n in range(40))}
CONTEXT = " ".join(f"Note {n}: module {n} reads its settings from config/{n}.toml." for n in range(30))


def prompt_ids(host: MlxModelHost, messages: list[Any], generation_prompt: bool = True) -> list[int]:
    text = render(host.tokenizer, messages, None, generation_prompt=generation_prompt)
    return encode(host.tokenizer, text)


def test_a_new_conversation_starts_from_another_sessions_by_content_held_once(tiny_qwen3_path: Path) -> None:
    """Session b's prompt starts as idle session a's did (system prompt and a long first message): b
    prefills only what differs, a goes on from the same shared prefix, so those tokens are held once
    (the entry's bytes, each session a tail); the tokens are those of sessions that share nothing."""

    def ask(question: str) -> list[Any]:
        return [SYSTEM, {"role": "user", "content": f"{CONTEXT} {question}"}]

    async def go(share: bool) -> tuple[list[tuple[int, ...]], list[Any], dict[str, Any]]:
        async with MlxModelHost(str(tiny_qwen3_path), share_prefix=share, prefix_cache=0) as host:
            replies = [
                await host.session("a").generate(ask("Where is module 3?"), GenerateArgs(max_tokens=12)),
                await host.session("b").generate(ask("And module 9?"), GenerateArgs(max_tokens=12)),
            ]
            # a goes on: its next turn still reuses all it held
            follow = [*ask("Where is module 3?"), {"role": "assistant", "content": replies[0].text}]
            follow.append({"role": "user", "content": "Thanks."})
            replies.append(await host.session("a").generate(follow, GenerateArgs(max_tokens=12)))
            scheduler = host._scheduler
            seen = {
                "common": common_prefix(
                    prompt_ids(host, ask("Where is module 3?")), prompt_ids(host, ask("And module 9?"))
                ),
                "caches": [scheduler.pool.idle(n).prompt_cache for n in "ab"],  # type: ignore[union-attr]
                "resident": await host._mlx.run(scheduler.resident_bytes),
                "prefixes": scheduler.prefixes,
                "per_token": host.kv_shape.per_token,
            }
            return [r.token_ids for r in replies], [r.usage for r in replies], seen

    shared_ids, usage, seen = asyncio.run(go(True))
    private_ids, private_usage, _ = asyncio.run(go(False))
    assert shared_ids == private_ids
    common = seen["common"]
    assert common > 256 + 128  # the system prompt and most of the first message
    assert private_usage[1].cached_tokens == 0 and usage[1].cached_tokens == common  # prefills only what differs
    assert usage[2].cached_tokens == private_usage[2].cached_tokens > common  # a's own cache, as without sharing
    # Held once: both sessions' attention layers start from one entry of exactly the common tokens.
    caches, prefixes = seen["caches"], seen["prefixes"]
    [shared] = {layer.shared for cache in caches for layer in cache}
    assert shared is not None and shared.length == common and shared.nbytes == common * seen["per_token"]
    tails = sum(layer.nbytes for cache in caches for layer in cache)
    assert seen["resident"] == prefixes.nbytes() + tails
    assert all(sum(layer.nbytes for layer in cache) < shared.nbytes for cache in caches)  # tails, not copies


def test_a_new_process_goes_on_from_a_conversation_stored_at_its_last_message(
    tiny_qwen3_path: Path, tiny_qwen3: Any, tmp_path: Path
) -> None:
    """A conversation that asks for it (the chat endpoints') is stored on disk up to its prompt's last
    message at each turn, its new file replacing its last (the folder holds the system prompt's file and
    one of the conversation's); a new host on the same folder serves the third turn of it from there: the
    whole second prompt but its reply's opening is cached, and the tokens are a cold host's."""
    replies = ["Module 3 is in config/3.toml.", "Module 9 reads config/9.toml too."]
    turns = [
        [SYSTEM, {"role": "user", "content": f"{CONTEXT} Where is module 3?"}],
        [{"role": "user", "content": "And module 9?"}],
        [{"role": "user", "content": "Which one is older?"}],
    ]
    store = {"prefix_cache_dir": tmp_path / "prefixes", "prefix_cache": 2**30}
    args = GenerateArgs(max_tokens=24, store_prompt=True)

    async def first_process() -> list[Any]:
        scripts = ForcedScripts(tiny_qwen3[1], {"c": replies})
        messages: list[Any] = []
        async with MlxModelHost(str(tiny_qwen3_path), processor_factory=scripts, **store) as host:
            for turn, reply in zip(turns, replies, strict=False):
                messages += turn
                assert (await host.session("c").generate(messages, args)).text == reply
                messages.append({"role": "assistant", "content": reply})
            return [*messages, *turns[2]]

    third = asyncio.run(first_process())

    stored = sorted(p.n_tokens for p in list_prefixes(store["prefix_cache_dir"]))

    async def later_process(**host: Any) -> tuple[Any, list[int]]:
        async with MlxModelHost(str(tiny_qwen3_path), **host) as h:
            reply = await h.session("new").generate(third, GenerateArgs(max_tokens=12, store_prompt=True))
            return reply, [len(prompt_ids(h, m, generation_prompt=False)) for m in (third[:1], third[:-2], third)]

    warm, (system, second_prompt, third_prompt) = asyncio.run(later_process(**store))
    cold, _ = asyncio.run(later_process(prefix_cache=0))
    assert stored == [system, second_prompt]  # the first turn's file was replaced by the second's
    # The new process went on from the second's file: its third turn's file replaced it.
    assert sorted(p.n_tokens for p in list_prefixes(store["prefix_cache_dir"])) == [system, third_prompt]
    assert warm.token_ids == cold.token_ids and cold.usage.cached_tokens == 0
    assert warm.usage.cached_tokens == second_prompt  # the system prompt, both questions and the first reply
    assert warm.usage.cached_tokens > 0.8 * warm.usage.prompt_tokens


def test_a_stored_conversation_is_the_prompts_kv_even_when_its_session_writes_on_at_once(
    tiny_qwen3_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mlx thread hands the writer views of the session's own buffers (no copy); while the writer still
    holds them, the session's next turn goes back into the conversation (another question: its cache is
    cut back into the stored tokens and written over there) and decodes. The file written then holds the
    prompt's KV as it was at the store, byte for byte (what a copy made at the store holds), and the
    session's reply is a host's that stores nothing."""
    import threading

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_subagents.host.kv import prefix_store
    from mlx_subagents.host.kv.kv_bits import load_prompt_cache

    held, copied = prefix_store.held, prefix_store.copied
    written = threading.Event()  # the writer waits for the session's next turn to end
    at_store: list[list[bytes]] = []

    def arrays(cache: list[Any]) -> list[bytes]:
        return [bytes(memoryview(v)) for _, v in tree_flatten([c.state for c in cache]) if isinstance(v, mx.array)]

    def holding(cache: list[Any]) -> Any:  # mlx thread: the views, and what a copy made now holds
        views = held(cache)
        at_store.append(arrays(copied(views)))
        return views

    def waiting(views: Any) -> list[Any]:  # writer thread
        written.wait(60)
        return copied(views)

    monkeypatch.setattr(prefix_store, "held", holding)
    monkeypatch.setattr(prefix_store, "copied", waiting)
    folder = tmp_path / "prefixes"
    ask = [SYSTEM, {"role": "user", "content": f"{CONTEXT} Where is module 3?"}]
    other = [SYSTEM, {"role": "user", "content": f"{CONTEXT} Which module reads config/7.toml?"}]

    async def go(**store: Any) -> tuple[Any, Any]:
        async with MlxModelHost(str(tiny_qwen3_path), **store) as host:
            session = host.session("c")
            first = await session.generate(ask, GenerateArgs(max_tokens=8, store_prompt=True))
            second = await session.generate(other, GenerateArgs(max_tokens=16))
            written.set()
            if host.prefix_store is not None:
                await asyncio.to_thread(host.prefix_store.flush)
            return first, second

    first, second = asyncio.run(go(prefix_cache_dir=folder, prefix_cache=2**30))
    _, alone = asyncio.run(go(prefix_cache=0))
    system, stored = sorted(list_prefixes(folder), key=lambda p: p.n_tokens)  # the system prompt's, the conversation's
    assert (
        len(at_store) == 2
        and system.n_tokens < second.usage.cached_tokens < stored.n_tokens < first.usage.prompt_tokens
    )
    assert arrays(load_prompt_cache(str(stored.path))) == at_store[-1]
    assert second.token_ids == alone.token_ids


@pytest.mark.parametrize("prefill_slice", ["auto", "off"])
def test_new_conversations_sent_together_prefill_the_start_they_share_once(
    tiny_qwen3_path: Path, prefill_slice: str
) -> None:
    """Four new conversations sent at once whose prompts share a start of about 1,000 tokens that no
    system prompt marks (one long user message, a different question at its end): the first turn in
    prefills it and leaves it a shared prefix at the end of what they share; the other three wait for
    that one prefill and start from it. The shared tokens are prefilled once, not four times, and held
    once; every reply's tokens are those of a host that shares nothing. Sliced or not (`--prefill-slice
    off` hands the ready turns to mlx-lm's batch together)."""
    preamble = " ".join(f"Note {n}: module {n} reads config/{n}.toml." for n in range(56))

    def ask(i: int) -> list[Any]:
        return [{"role": "user", "content": f"{preamble} Question {i}: where is module {i * 7}?"}]

    async def go(share: bool) -> tuple[list[Any], int, Any]:
        host = MlxModelHost(str(tiny_qwen3_path), share_prefix=share, prefix_cache=0, prefill_slice=prefill_slice)
        async with host:
            replies = await asyncio.gather(
                *(host.session(f"s{i}").generate(ask(i), GenerateArgs(max_tokens=6)) for i in range(4))
            )
            ids = [prompt_ids(host, ask(i)) for i in range(4)]
            common = min(common_prefix(ids[0], other) for other in ids[1:])
            caches = [host._scheduler.pool.idle(f"s{i}").prompt_cache for i in range(4)]  # type: ignore[union-attr]
            return list(replies), common, {layer.shared for cache in caches for layer in cache}

    shared, common, entries = asyncio.run(go(True))
    private, _, _ = asyncio.run(go(False))
    assert common >= 1000  # the preamble, and the question's first words
    assert sorted(r.usage.cached_tokens for r in shared) == [0, common, common, common]
    assert [r.usage.cached_tokens for r in private] == [0, 0, 0, 0]
    prompts = sum(r.usage.prompt_tokens for r in shared)
    assert sum(r.usage.prefilled_tokens for r in shared) == prompts - 3 * common  # the shared start once
    assert sum(r.usage.prefilled_tokens for r in private) == prompts
    [entry] = entries  # all four sessions' layers start from one entry of exactly those tokens
    assert entry is not None and entry.length == common
    assert [r.token_ids for r in shared] == [r.token_ids for r in private]
