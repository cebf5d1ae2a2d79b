"""MlxModelHost on tiny real models: reuse, hybrid caches, concurrency, tool calls, cancellation."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.host import GenerateArgs, MlxModelHost
from mlx_subagents.host.calls import prompt
from mlx_subagents.host.protocol import HostEvent, PrefillBegun, TokensSoFar, ToolCall
from mlx_subagents.testing import ForcedScripts, tool_call_text
from tests.helpers import texts

LS_SCHEMA = {
    "type": "function",
    "function": {
        "name": "ls",
        "description": "List a folder.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}
TASK = [
    {"role": "system", "content": "You are a scout. Find things in the code."},
    {"role": "user", "content": "Task: where is the config parsed?"},
]


def tool_result(i: int) -> dict[str, Any]:
    lines = "\n".join(f"src/module_{i}_{j}.py: def parse_config_{j}(path): return load(path)" for j in range(8))
    return {"role": "tool", "tool_call_id": "call_0", "name": "ls", "content": lines}


async def converse(host: MlxModelHost, name: str, turns: int, max_tokens: int = 12) -> list[Any]:
    """`turns` agent-like turns on one session: reply, then a tool result, and so on."""
    session = host.session(name)
    messages = list(TASK)
    replies = []
    for i in range(turns):
        reply = await session.generate(messages, GenerateArgs(max_tokens=max_tokens), tools=[LS_SCHEMA])
        replies.append(reply)
        messages = messages + [reply.to_message(), tool_result(i)]
    return replies


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.mark.slow
@pytest.mark.parametrize("arch_fixture", ["tiny_qwen3_path", "tiny_qwen35_path"])
def test_turns_prefill_only_new_tokens_and_match_cacheless(arch_fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(arch_fixture)

    async def both() -> tuple[list[Any], list[Any]]:
        async with MlxModelHost(str(path)) as host, MlxModelHost(str(path), reuse=False) as fresh:
            return await converse(host, "a", 4), await converse(fresh, "a", 4)

    reused, cacheless = run(both())
    assert [r.token_ids for r in reused] == [r.token_ids for r in cacheless]
    assert all(len(r.token_ids) > 0 for r in reused)
    for prev, cur in zip(reused, reused[1:]):
        held = prev.usage.prompt_tokens + prev.usage.generated_tokens
        assert cur.usage.cached_tokens == held
        assert cur.usage.prefilled_tokens == cur.usage.prompt_tokens - held
    assert [r.usage.cached_tokens for r in cacheless] == [0, 0, 0, 0]
    assert [r.usage.prompt_tokens for r in cacheless] == [r.usage.prompt_tokens for r in reused]


def test_forced_tool_calls_splice_to_the_fresh_rendering(tiny_qwen3_path: Path, tiny_qwen3: Any) -> None:
    """A reply in the template's own format re-renders to the same ids: reuse is the whole prefix."""
    tokenizer = tiny_qwen3[1]
    call = tool_call_text("ls", {"path": "."})
    scripts = ForcedScripts(tokenizer, {"a": [call, call, "The config is parsed in src/config.py:12-40."]})

    async def go() -> tuple[list[Any], int]:
        async with MlxModelHost(str(tiny_qwen3_path), processor_factory=scripts) as host:
            replies = await converse(host, "a", 3, max_tokens=64)
            messages = TASK + [replies[0].to_message(), tool_result(0), replies[1].to_message(), tool_result(1)]
            return replies, await host.count_tokens(messages, [LS_SCHEMA])

    replies, fresh_count = run(go())
    assert [r.tool_calls for r in replies[:2]] == [
        [ToolCall("ls", {"path": "."}, "call_0")],
        [ToolCall("ls", {"path": "."}, "call_1")],
    ]
    assert replies[2].text == "The config is parsed in src/config.py:12-40."
    assert replies[2].tool_calls == [] and replies[2].finish_reason == "stop"
    assert replies[2].usage.prompt_tokens == fresh_count  # spliced ids == a fresh rendering
    assert replies[2].usage.cached_tokens == replies[1].usage.prompt_tokens + replies[1].usage.generated_tokens


def test_malformed_tool_call_is_returned_not_raised(tiny_qwen3_path: Path, tiny_qwen3: Any) -> None:
    bad = '<tool_call>\n{"name": "ls", "arguments": {"path": </tool_call>'
    unclosed = 'Looking.<tool_call>\n{"name": "ls"'
    scripts = ForcedScripts(tiny_qwen3[1], {"a": [bad, unclosed]})

    async def go() -> list[Any]:
        async with MlxModelHost(str(tiny_qwen3_path), processor_factory=scripts) as host:
            session = host.session("a")
            first = await session.generate(TASK, GenerateArgs(max_tokens=64), tools=[LS_SCHEMA])
            second = await session.generate(TASK, GenerateArgs(max_tokens=64), tools=[LS_SCHEMA])
            return [first, second]

    first, second = run(go())
    assert first.tool_calls == [] and len(first.malformed_tool_calls) == 1
    assert first.malformed_tool_calls[0].raw == bad
    fix = (
        "Write each call exactly in this format, with the tool's own name and arguments:\n"
        '<tool_call>\n{"name": "tool_name", "arguments": {"argument": "value"}}\n</tool_call>'
    )
    assert first.malformed_tool_calls[0].error == (
        "Error: your tool call could not be parsed (JSONDecodeError: Expecting value: line 1 column 37 (char 36)). "
        + fix
    )
    assert second.text == "Looking."
    assert second.malformed_tool_calls[0].error == (
        "Error: your tool call could not be parsed (the call has no closing </tool_call>). " + fix
    )


def test_four_concurrent_sessions_match_their_solo_outputs(tiny_qwen3_path: Path) -> None:
    prompts = {f"s{i}": [{"role": "user", "content": f"Task {i}: describe module {i * 7}"}] for i in range(4)}

    async def together() -> dict[str, tuple[int, ...]]:
        async with MlxModelHost(str(tiny_qwen3_path)) as host:
            names = list(prompts)
            replies = await asyncio.gather(
                *(host.session(n).generate(prompts[n], GenerateArgs(max_tokens=24)) for n in names)
            )
            return {n: r.token_ids for n, r in zip(names, replies)}

    async def separately() -> dict[str, tuple[int, ...]]:
        out = {}
        for name, messages in prompts.items():
            async with MlxModelHost(str(tiny_qwen3_path)) as host:
                out[name] = (await host.session(name).generate(messages, GenerateArgs(max_tokens=24))).token_ids
        return out

    concurrent, solo = run(together()), run(separately())
    assert concurrent == solo
    assert len({ids for ids in solo.values()}) > 1  # the prompts really differ


@pytest.mark.parametrize("arch_fixture", ["tiny_qwen3_path", "tiny_qwen35_path"])
def test_cancel_mid_generation_then_next_turn_is_correct(
    arch_fixture: str, request: pytest.FixtureRequest, tiny_qwen3: Any
) -> None:
    path: Path = request.getfixturevalue(arch_fixture)
    long_text = " ".join(f"word{i}" for i in range(400))
    scripts = ForcedScripts(tiny_qwen3[1], {"a": [long_text]})
    follow = TASK + [{"role": "user", "content": "Never mind: list the files instead."}]

    async def go() -> tuple[Any, Any, Any, int]:
        async with MlxModelHost(str(path), processor_factory=scripts) as host:
            session = host.session("a")
            chunks: list[str] = []
            first_chunk = asyncio.Event()

            def on_text(text: str) -> None:
                chunks.append(text)
                first_chunk.set()

            task = asyncio.create_task(session.generate(TASK, GenerateArgs(max_tokens=2000, on_event=texts(on_text))))
            await first_chunk.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            other = await host.session("b").generate(TASK, GenerateArgs(max_tokens=8))  # the mlx thread is free again
            after = await session.generate(follow, GenerateArgs(max_tokens=16))
            async with MlxModelHost(str(path), reuse=False) as fresh:
                reference = await fresh.session("a").generate(follow, GenerateArgs(max_tokens=16))
            return other, after, reference, len(chunks)

    other, after, reference, n_chunks = run(go())
    assert n_chunks < 100  # stopped long before the 400-word script ended
    assert other.finish_reason in {"stop", "length"}
    assert after.token_ids == reference.token_ids
    assert after.usage.prompt_tokens == reference.usage.prompt_tokens
    assert after.usage.cached_tokens > 0  # the task prefix survived the cancel


def test_hybrid_divergent_history_reuses_snapshot(tiny_qwen35_path: Path, tiny_qwen35: Any) -> None:
    """A non-trimmable cache cannot be cut back; a snapshot before the reply serves a retry."""
    tokenizer = tiny_qwen35[1]

    async def go() -> tuple[Any, Any, Any]:
        async with MlxModelHost(str(tiny_qwen35_path)) as host:
            session = host.session("a")
            first = await session.generate(TASK, GenerateArgs(max_tokens=10))
            retry = await session.generate(TASK, GenerateArgs(max_tokens=10))
            async with MlxModelHost(str(tiny_qwen35_path), reuse=False) as fresh:
                reference = await fresh.session("a").generate(TASK, GenerateArgs(max_tokens=10))
            return first, retry, reference

    first, retry, reference = run(go())
    opening = len(tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False))
    assert retry.usage.cached_tokens == first.usage.prompt_tokens - opening
    assert retry.usage.prefilled_tokens == opening
    assert retry.token_ids == first.token_ids == reference.token_ids


def then_edited(path: Path, edited: list[Any]) -> tuple[Any, Any, Any]:
    """A session's replies to TASK and then to `edited`, and a cacheless host's reply to `edited`."""

    async def go() -> tuple[Any, Any, Any]:
        async with MlxModelHost(str(path)) as host:
            session = host.session("a")
            first = await session.generate(TASK, GenerateArgs(max_tokens=10))
            second = await session.generate(edited, GenerateArgs(max_tokens=10))
            async with MlxModelHost(str(path), reuse=False) as fresh:
                reference = await fresh.session("a").generate(edited, GenerateArgs(max_tokens=10))
            return first, second, reference

    return run(go())


def test_dense_divergent_history_trims_cache(tiny_qwen3_path: Path) -> None:
    edited = [TASK[0], {"role": "user", "content": "Task: where is the logger configured?"}]
    first, second, reference = then_edited(tiny_qwen3_path, edited)
    assert 0 < second.usage.cached_tokens < first.usage.prompt_tokens
    assert second.token_ids == reference.token_ids


def test_an_edited_reply_is_prefilled_not_taken_from_the_cache(tiny_qwen3_path: Path) -> None:
    """A chat client sends the conversation back with the model's reply edited: the next turn reads the
    edited reply (as a fresh host does), not the one the cache holds; the prompt before it stays cached."""
    edited = [*TASK, {"role": "assistant", "content": "It is parsed in cfg.py."}, {"role": "user", "content": "Why?"}]
    first, second, reference = then_edited(tiny_qwen3_path, edited)
    assert first.text != "It is parsed in cfg.py."
    assert second.usage.prompt_tokens == reference.usage.prompt_tokens
    assert second.token_ids == reference.token_ids
    assert second.usage.cached_tokens == first.usage.prompt_tokens  # up to where the reply begins


def test_accounting_window_tokens_and_kv_bytes(tiny_qwen3_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_subagents.host.mlx import mlx_host

    tokenized_in: list[threading.Thread] = []  # count_tokens tokenizes off the caller's loop (a server's clients)
    monkeypatch.setattr(
        mlx_host, "encode", lambda *a: tokenized_in.append(threading.current_thread()) or prompt.encode(*a)
    )

    async def go() -> tuple[Any, ...]:
        async with (
            MlxModelHost(str(tiny_qwen3_path)) as host,
            MlxModelHost(str(tiny_qwen3_path), context_window=1000) as small,
        ):
            session = host.session("a")
            counted = await host.count_tokens(TASK)
            assert len(tokenized_in) == 1 and tokenized_in[0] is not threading.current_thread()
            reply = await session.generate(TASK, GenerateArgs(max_tokens=5))
            stats = await host.memory_stats()
            return (
                host.context_window,
                small.context_window,
                counted,
                reply,
                session.kv_bytes,
                stats,
                host.kv_bytes_total,
            )

    window, small_window, counted, reply, kv, stats, total = run(go())
    assert (window, small_window) == (4096, 1000)
    assert counted == reply.usage.prompt_tokens
    assert kv > 0 and stats.kv_bytes_by_session == {"a": kv} and total == kv
    assert stats.peak_memory >= stats.active_memory > 0


def test_prompt_over_the_window_is_a_clear_error(tiny_qwen3_path: Path) -> None:
    from mlx_subagents.errors import PromptTooLongError

    async def go() -> None:
        async with MlxModelHost(str(tiny_qwen3_path), context_window=300) as host:
            big = [{"role": "user", "content": "word " * 600}]
            with pytest.raises(PromptTooLongError, match=r"^the prompt is \d+ tokens but the context window is 300;"):
                await host.session("a").generate(big)
            # Over 2 x the longest token's 16 characters x 300: refused before it is tokenized.
            huge = [{"role": "user", "content": "x" * 9_600}]
            with pytest.raises(PromptTooLongError, match=r"^the prompt is 9,650 characters, .* \(9,600 at most\)"):
                await host.session("a").generate(huge)
            ok = await host.session("a").generate(TASK, GenerateArgs(max_tokens=4))  # the mlx thread survived
            assert ok.usage.generated_tokens == 4 or ok.finish_reason == "stop"

    run(go())


def test_a_long_prompt_is_tokenized_off_the_mlx_thread_while_others_decode(
    tiny_qwen3_path: Path, tiny_qwen3: Any
) -> None:
    """A huge prompt under the character bound (tokenized, then refused: over the window in tokens) is
    rendered and tokenized outside the mlx thread, so another session decodes meanwhile: its tokenizing
    cannot end before the other session has decoded 8 more tokens (on the mlx thread it would wait for
    them forever: the wait's 60 s bound fails the test), and no prompt is tokenized on the mlx thread."""
    from mlx_subagents.errors import PromptTooLongError
    from mlx_subagents.testing import make_forced_processor

    _, tokenizer = tiny_qwen3
    stepped = threading.Condition()
    steps = [0]  # the decoding session's steps, counted on the mlx thread
    began, during, threads = asyncio.Event(), [-1], []

    def counted(session_name: str, prompt_ids: Any) -> list[Any]:
        if session_name != "decoding":
            return []
        forced = make_forced_processor(tokenizer, "word " * 300)

        def processor(tokens: Any, logits: Any) -> Any:
            with stepped:
                steps[0] += 1
                stepped.notify_all()
            return forced(tokens, logits)

        return [processor]

    async def go() -> tuple[Any, Any, threading.Thread]:
        async with MlxModelHost(str(tiny_qwen3_path), processor_factory=counted) as host:
            hf = host.tokenizer._tokenizer
            encode = hf.encode

            def watched(text: str, *args: Any, **kwargs: Any) -> Any:
                threads.append(threading.current_thread())
                if len(text) > 50_000:  # the huge prompt: done only once the other session decoded 8 more
                    with stepped:
                        start = steps[0]
                        stepped.wait_for(lambda: steps[0] >= start + 8, 60)
                        during[0] = steps[0] - start
                return encode(text, *args, **kwargs)

            hf.encode = watched

            def seen(event: HostEvent) -> None:
                if isinstance(event, TokensSoFar):
                    began.set()

            decoding = asyncio.create_task(
                host.session("decoding").generate(TASK, GenerateArgs(max_tokens=300, on_event=seen))
            )
            await began.wait()
            huge = [{"role": "user", "content": "word " * 20_000}]  # 100,000 characters: under 131,072
            with pytest.raises(PromptTooLongError, match=r"^the prompt is \d+ tokens but the context window is 4096;"):
                await host.session("huge").generate(huge)
            return await decoding, host._mlx._thread

    reply, mlx_thread = run(go())
    assert during[0] >= 8  # the other session decoded while the huge prompt was tokenized
    assert reply.usage.generated_tokens == 300 and reply.text.startswith("word word")  # undisturbed
    assert threads and mlx_thread not in threads


def test_a_prompt_made_before_its_session_changed_is_made_again_on_the_mlx_thread(
    tiny_qwen3_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn's prompt made from what its session held before its last turn (a race with that turn's end)
    is not taken as it is: the scheduler makes it again from what the session holds, so the turn is spliced
    onto the ids its cache holds as without the race (the same ids, cached tokens and reply)."""
    from mlx_subagents.host.mlx import prompt_worker
    from mlx_subagents.host.mlx.turn_prompt import Basis

    async def go(stale: bool) -> tuple[list[Any], list[Any], list[threading.Thread], threading.Thread]:
        reads: list[Basis] = []
        threads: list[threading.Thread] = []

        def read(state: Any) -> Basis:  # the third turn's prompt is made from the first turn's end
            reads.append(Basis.of(state))
            return reads[1] if stale and len(reads) == 3 else reads[-1]

        monkeypatch.setattr(prompt_worker, "Basis", type("Stale", (), {"of": staticmethod(read)}))
        async with MlxModelHost(str(tiny_qwen3_path)) as host:
            make = host._scheduler.prompts.make
            host._scheduler.prompts.make = lambda *a: threads.append(threading.current_thread()) or make(*a)  # type: ignore[method-assign]
            session, messages, replies = host.session("a"), list(TASK), []
            for n in range(3):
                replies.append(await session.generate(messages, GenerateArgs(max_tokens=6)))
                messages = [*messages, replies[-1].to_message(), {"role": "user", "content": f"And then {n}?"}]
            return [r.token_ids for r in replies], [r.usage for r in replies], threads, host._mlx._thread

    raced, raced_usage, threads, mlx_thread = run(go(True))
    calm, calm_usage, calm_threads, _ = run(go(False))
    assert raced == calm and raced_usage[2].cached_tokens == calm_usage[2].cached_tokens > 0
    assert raced_usage[2].prompt_tokens == calm_usage[2].prompt_tokens
    assert mlx_thread not in calm_threads and threads.count(mlx_thread) == 1  # made again there, once


# -- a reply cut by a timeout or Ctrl-C still counts what it spent -------------------------------------


def test_a_cancelled_reply_counts_the_tokens_it_spent(tiny_qwen3_path: Path, tmp_path: Path) -> None:
    import threading
    import time

    import mlx_lm

    from mlx_subagents.agents.limits import Limits
    from mlx_subagents.agents.session import AgentSession, workspace_for
    from mlx_subagents.agents.spec import AgentSpec
    from mlx_subagents.testing import make_forced_processor

    _, tokenizer = mlx_lm.load(str(tiny_qwen3_path))
    reached = threading.Event()
    seen: dict[str, int] = {"prompt": 0, "calls": 0}

    def slow_forever(session_name: str, prompt_ids: Any) -> list[Any]:
        """Forces a long reply; from the sixth token on, each step takes 20 ms (a timeout lands mid-reply)."""
        seen["prompt"] = len(prompt_ids)
        forced = make_forced_processor(tokenizer, "word " * 400)

        def processor(tokens: Any, logits: Any) -> Any:
            seen["calls"] += 1
            if seen["calls"] > 5:
                reached.set()
                time.sleep(0.02)
            return forced(tokens, logits)

        return [processor]

    spec = AgentSpec(
        name="scout", description="d", tools=("ls",), system_prompt="Look.", source="builtin", path=tmp_path
    )

    async def go() -> AgentSession:
        async with MlxModelHost(str(tiny_qwen3_path), processor_factory=slow_forever) as host:
            session = AgentSession(spec, host, workspace_for(tmp_path), limits=Limits(max_reply_tokens=1000))
            task = asyncio.create_task(session.run("go"))
            await asyncio.to_thread(reached.wait, 60)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return session

    session = run(go())
    assert session.usage.turns == 1
    assert session.usage.input_tokens == seen["prompt"] > 0
    assert 5 <= session.usage.output_tokens <= seen["calls"]


def test_the_host_reports_each_turns_prefill_and_its_tokens_as_they_stream(
    tiny_qwen3_path: Path, tiny_qwen3: Any
) -> None:
    """The host's events: `PrefillBegun` says what the turn prefills and what its cache holds, before its
    first token (a live view says "prefilling N tokens"); `TokensSoFar` counts the tokens generated so far,
    call markup too."""
    call = tool_call_text("ls", {"path": "."})
    scripts = ForcedScripts(tiny_qwen3[1], {"a": [call, "The config is parsed in src/config.py."]})
    turns: list[list[tuple[str, Any]]] = []

    async def go() -> list[Any]:
        async with MlxModelHost(str(tiny_qwen3_path), processor_factory=scripts) as host:
            session, messages, replies = host.session("a"), list(TASK), []
            for i in range(2):
                seen: list[tuple[str, Any]] = []
                turns.append(seen)

                def on_event(event: HostEvent, seen: list[tuple[str, Any]] = seen) -> None:
                    if isinstance(event, PrefillBegun):
                        seen.append(("prefill", (event.tokens, event.cached)))
                    elif isinstance(event, TokensSoFar):
                        seen.append(("tokens", event.n))

                args = GenerateArgs(max_tokens=64, on_event=on_event)
                replies.append(await session.generate(messages, args, tools=[LS_SCHEMA]))
                messages = messages + [replies[-1].to_message(), tool_result(i)]
            return replies

    replies = run(go())
    assert replies[0].tool_calls and replies[1].usage.cached_tokens > 0  # the second turn prefills only what is new
    for reply, seen in zip(replies, turns):
        assert seen[0] == ("prefill", (reply.usage.prefilled_tokens, reply.usage.cached_tokens))
        counts = [n for what, n in seen[1:]]
        assert [what for what, _ in seen[1:]] == ["tokens"] * len(counts)
        # the last count comes with the last text; the end-of-turn token may follow it, streaming nothing
        assert (
            counts == sorted(counts) and reply.usage.generated_tokens - 1 <= counts[-1] <= reply.usage.generated_tokens
        )
