"""Compaction: budget scaling, safe split points and the summarising round trip."""

from __future__ import annotations

import asyncio
import copy
import json
import math
import random

import pytest

from mlx_subagents.agents.compaction import (
    SUMMARY_HEADER,
    SUMMARY_PROMPT,
    CompactionSettings,
    compact,
    fallback_summary,
    recent_token_counts,
    scale_compaction,
    should_compact,
    split_for_compaction,
)
from mlx_subagents.host.engine.estimate import approx_tokens
from mlx_subagents.host.protocol import GenerateArgs
from mlx_subagents.host.scripted import ScriptedHost

# --- scale_compaction ------------------------------------------------------------------------


def test_scale_small_window() -> None:
    expected = CompactionSettings(reserve_tokens=2048, keep_recent_tokens=4096)
    assert scale_compaction(8192) == expected


def test_scale_large_window_keeps_defaults() -> None:
    assert scale_compaction(200_000) == CompactionSettings()


def test_scale_keeps_smaller_configured_values_and_enabled() -> None:
    settings = CompactionSettings(reserve_tokens=1000, keep_recent_tokens=3000, enabled=False)
    assert scale_compaction(8192, settings) == settings
    mixed = CompactionSettings(reserve_tokens=1000, keep_recent_tokens=30000)
    assert scale_compaction(32768, mixed) == CompactionSettings(1000, 16384)


@pytest.mark.parametrize("window", [1, 2, 3, 4, 7, 10, 100, 1023, 4096, 32768, 65537, 10**7])
def test_scale_never_above_three_quarters(window: int) -> None:
    scaled = scale_compaction(window)
    assert scaled.reserve_tokens <= window / 4
    assert scaled.keep_recent_tokens <= window / 2
    assert scaled.reserve_tokens + scaled.keep_recent_tokens <= 0.75 * window
    assert scaled.reserve_tokens >= 0 and scaled.keep_recent_tokens >= 0


def test_scale_tiny_windows_exact() -> None:
    assert scale_compaction(1) == CompactionSettings(0, 0)
    assert scale_compaction(3) == CompactionSettings(0, 1)
    assert scale_compaction(7) == CompactionSettings(1, 3)


def test_scale_accepts_whole_float() -> None:
    assert scale_compaction(8192.0) == CompactionSettings(2048, 4096)


@pytest.mark.parametrize(
    ("window", "message"),
    [
        (0, "context window must be positive, got 0"),
        (-5, "context window must be positive, got -5"),
        (True, "context window must be a positive whole number of tokens, got True"),
        (math.nan, "context window must be a whole number of tokens, got nan"),
        (math.inf, "context window must be a whole number of tokens, got inf"),
        (1.5, "context window must be a whole number of tokens, got 1.5"),
        ("8192", "context window must be a positive whole number of tokens, got '8192'"),
        (None, "context window must be a positive whole number of tokens, got None"),
    ],
)
def test_scale_rejects_invalid_windows(window: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        scale_compaction(window)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_settings_reject_negative_budgets() -> None:
    with pytest.raises(ValueError, match="reserve_tokens must be an int >= 0"):
        CompactionSettings(reserve_tokens=-1)


def test_should_compact() -> None:
    settings = scale_compaction(8192)  # reserve 2048
    assert not should_compact(6144, 8192, settings)
    assert should_compact(6145, 8192, settings)
    assert not should_compact(8000, 8192, CompactionSettings(2048, 4096, enabled=False))


# --- split_for_compaction ---------------------------------------------------------------------


def sys_(text: str = "system") -> dict:
    return {"role": "system", "content": text}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def call(*ids: str) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": i, "type": "function", "function": {"name": "ls", "arguments": {}}} for i in ids],
    }


def result(call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "name": "ls", "content": f"out {call_id}"}


def answer(text: str) -> dict:
    return {"role": "assistant", "content": text}


CONVERSATION = [
    sys_(),  # 0
    user("task"),  # 1
    call("c1"),  # 2
    result("c1"),  # 3
    call("c2", "c3"),  # 4
    result("c2"),  # 5
    result("c3"),  # 6
    answer("thinking"),  # 7
    user("more"),  # 8
    call("c4"),  # 9
    result("c4"),  # 10
]


def test_split_exact_lists() -> None:
    counts = [10] * len(CONVERSATION)
    c = CONVERSATION
    # 10 tokens keep only the last message, a tool result: its call comes along.
    assert split_for_compaction(c, counts, 10) == (c[:2], c[2:9], c[9:])
    # 30 would start at the result c2 (index 5); the cut moves back to its call.
    assert split_for_compaction(c, counts, 60) == (c[:2], c[2:4], c[4:])
    assert split_for_compaction(c, counts, 40) == (c[:2], c[2:7], c[7:])
    # Everything fits: nothing to summarise.
    assert split_for_compaction(c, counts, 1000) == (c[:2], [], c[2:])
    # A budget of 0 still keeps the last message (with its call).
    assert split_for_compaction(c, counts, 0) == (c[:2], c[2:9], c[9:])


def test_split_head_variants() -> None:
    two_systems = [sys_("a"), sys_("b"), user("task"), answer("x"), user("y"), answer("z")]
    head, middle, kept = split_for_compaction(two_systems, [1] * 6, 1)
    assert (head, middle, kept) == (two_systems[:3], two_systems[3:5], two_systems[5:])
    no_system = [user("task"), answer("x"), user("y")]
    expected = (no_system[:1], no_system[1:2], no_system[2:])
    assert split_for_compaction(no_system, [1, 1, 1], 1) == expected
    assert split_for_compaction([sys_(), user("t")], [1, 1], 0) == ([sys_(), user("t")], [], [])
    assert split_for_compaction([], [], 5) == ([], [], [])


def test_split_matches_results_by_id_not_position() -> None:
    # A result whose call is further back than the nearest call stays with its own call.
    odd = [sys_(), user("t"), call("a"), answer("x"), call("b"), result("b"), result("a")]
    head, middle, kept = split_for_compaction(odd, [1] * len(odd), 1)
    assert (head, middle, kept) == (odd[:2], [], odd[2:])


def test_split_result_without_id_belongs_to_the_assistant_before_it() -> None:
    # session.py answers a malformed call (no tool_calls) with an id-less tool message.
    error = {"role": "tool", "content": "Error: your tool call could not be parsed"}
    convo = [sys_(), user("t"), call("a"), result("a"), answer("<tool_call>x"), error]
    assert split_for_compaction(convo, [1] * 6, 1) == (convo[:2], convo[2:4], convo[4:])
    unknown = {"role": "tool", "tool_call_id": "zz", "content": "?"}
    convo = [sys_(), user("t"), call("a"), result("a"), call("b"), unknown]
    assert split_for_compaction(convo, [1] * 6, 1) == (convo[:2], convo[2:4], convo[4:])


def test_split_rejects_mismatched_counts() -> None:
    with pytest.raises(ValueError, match="2 token counts for 3 messages"):
        split_for_compaction([user("a"), user("b"), user("c")], [1, 2], 10)


def random_conversation(rng: random.Random) -> list[dict]:
    messages = [sys_()] if rng.random() < 0.8 else []
    messages.append(user("task"))
    n_ids = 0
    for _ in range(rng.randint(0, 12)):
        kind = rng.choice(["calls", "calls", "answer", "user", "malformed"])
        if kind == "malformed":
            messages.append(answer("<tool_call>oops"))
            messages.append({"role": "tool", "content": "Error: could not parse"})
        elif kind == "calls":
            ids = [f"c{n_ids + k}" for k in range(rng.randint(1, 3))]
            n_ids += len(ids)
            messages.append(call(*ids))
            messages.extend(result(i) for i in ids)
        elif kind == "answer":
            messages.append(answer("a" * rng.randint(1, 50)))
        else:
            messages.append(user("u" * rng.randint(1, 50)))
    return messages


def test_split_property_random_conversations() -> None:
    rng = random.Random(1234)
    for _ in range(2000):
        messages = random_conversation(rng)
        snapshot = copy.deepcopy(messages)
        counts = [rng.randint(0, 40) for _ in messages]
        budget = rng.randint(0, 300)
        head, middle, kept = split_for_compaction(messages, counts, budget)
        assert messages == snapshot  # input untouched
        assert head + middle + kept == messages
        n_head = len(head)
        assert head == messages[:n_head]
        assert all(m["role"] == "system" for m in head[:-1])
        assert head and head[-1] == user("task")
        rest = messages[n_head:]
        if rest:
            assert kept and kept[-1] is messages[-1]
        # Every kept tool result has its call kept; every summarised call has its results there.
        kept_ids = {c["id"] for m in kept for c in m.get("tool_calls", [])}
        assert all(m["tool_call_id"] in kept_ids for m in kept if "tool_call_id" in m)
        middle_ids = {c["id"] for m in middle for c in m.get("tool_calls", [])}
        assert all(m["tool_call_id"] in middle_ids for m in middle if "tool_call_id" in m)
        assert not kept or kept[0]["role"] != "tool"
        if not rest:
            continue
        # The cut is the latest safe one at or before the budget's start.
        start = len(rest) - 1
        while start > 0 and sum(counts[n_head + start - 1 :]) <= budget:
            start -= 1
        cut = len(middle)
        assert cut <= start
        assert cut == 0 or is_safe_cut(rest, cut)
        assert not any(is_safe_cut(rest, c) for c in range(cut + 1, start + 1))


def is_safe_cut(rest: list[dict], cut: int) -> bool:
    after = rest[cut:]
    ids = {c["id"] for m in after for c in m.get("tool_calls", [])}
    return after[0]["role"] != "tool" and all(m["tool_call_id"] in ids for m in after if "tool_call_id" in m)


# --- compact ------------------------------------------------------------------------------------


def long_conversation() -> list[dict]:
    return [
        sys_("You are a worker."),
        user("Fix the bug in auth.py."),
        call("c1"),
        result("c1") | {"content": "auth.py tests.py " * 40},
        call("c2"),
        result("c2") | {"content": "def login(): ... " * 40},
        answer("I see the bug."),
        user("Go on."),
        call("c3"),
        result("c3"),
    ]


def test_compact_replaces_middle_with_summary() -> None:
    summary = "## Goal\nFix auth.\n## Next steps\nEdit login."
    host = ScriptedHost.from_replies([summary])
    session = host.session("worker-1")
    messages = long_conversation()
    snapshot = copy.deepcopy(messages)
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {}}}]
    # Per-message tokens: [12, 13, 30, 186, 30, 186, 12, 9, 30, 17]; 50 keeps the last two.
    settings = CompactionSettings(reserve_tokens=256, keep_recent_tokens=50)

    got = asyncio.run(compact(messages, session, host.count_tokens, settings, tools=tools))

    assert messages == snapshot
    assert got.summary == summary
    assert got.n_summarized == 6
    assert got.messages[:2] == messages[:2]
    assert all(a is b for a, b in zip(got.messages[:2], messages[:2]))
    assert got.messages[2] == {"role": "user", "content": SUMMARY_HEADER + summary}
    assert got.messages[3:] == messages[8:]
    assert json.dumps(got.messages[:2]) == json.dumps(snapshot[:2])
    assert got.tokens_before == approx_tokens(messages)
    assert got.tokens_after == approx_tokens(got.messages)
    assert got.tokens_after < got.tokens_before
    # A fresh session has nothing cached yet.
    assert got.usage.prompt_tokens > 0 and got.usage.cached_tokens == 0


def test_compact_request_shape() -> None:
    host = ScriptedHost.from_replies(["summary"])
    seen: dict = {}

    class Spy:
        name = "spy"

        def __init__(self) -> None:
            self.inner = host.session("spy")

        async def generate(self, messages, args=GenerateArgs(), **kwargs):
            seen["messages"], seen["args"], seen["kwargs"] = messages, args, kwargs
            return await self.inner.generate(messages, args, **kwargs)

    messages = long_conversation()
    tools = [{"type": "function", "function": {"name": "ls"}}]
    settings = CompactionSettings(reserve_tokens=1000, keep_recent_tokens=60)
    spy = Spy()
    asyncio.run(compact(messages, spy, host.count_tokens, settings, tools=tools))

    request = seen["messages"]
    assert request[:2] == messages[:2] and len(request) == 3
    assert request[2]["role"] == "user"
    content = request[2]["content"]
    assert content.endswith(SUMMARY_PROMPT)
    assert "[user]\nGo on." not in content  # kept messages are not summarised
    assert "[assistant]\nI see the bug." in content
    assert "tool call: ls({})" in content
    assert "[tool ls]" in content
    assert seen["kwargs"]["tools"] is tools
    assert seen["args"].max_tokens == 500


def test_compact_nothing_to_summarise() -> None:
    host = ScriptedHost.from_replies(["never used"])
    session = host.session("s")
    messages = long_conversation()
    got = asyncio.run(compact(messages, session, host.count_tokens, CompactionSettings()))
    assert got.messages == messages and got.messages is not messages
    assert (got.summary, got.n_summarized) == ("", 0)
    assert got.tokens_before == got.tokens_after == approx_tokens(messages)
    # The script was not consumed.
    assert asyncio.run(session.generate(messages)).text == "never used"


def test_compact_tool_call_instead_of_summary_falls_back() -> None:
    host = ScriptedHost.from_replies([{"tool_calls": [{"name": "ls", "arguments": {}}]}])
    messages = long_conversation()
    settings = CompactionSettings(reserve_tokens=256, keep_recent_tokens=50)
    got = asyncio.run(compact(messages, host.session("s"), host.count_tokens, settings))
    assert got.summary == fallback_summary(messages[2:8])
    assert got.summary.startswith("The model gave no summary; 6 earlier messages were dropped.")
    assert "- ls({})" in got.summary


def test_compact_twice_resummarises_the_summary() -> None:
    host = ScriptedHost.from_replies(["first", "second"])
    session = host.session("s")
    settings = CompactionSettings(reserve_tokens=256, keep_recent_tokens=20)
    messages = long_conversation()
    once = asyncio.run(compact(messages, session, host.count_tokens, settings))
    grown = once.messages + [answer("step"), user("again"), call("c9"), result("c9")]
    twice = asyncio.run(compact(grown, session, host.count_tokens, settings))
    assert twice.messages[:2] == messages[:2]
    assert twice.messages[2] == user(SUMMARY_HEADER + "second")
    assert twice.messages[3:] == grown[-2:]
    # The second request reused the session's cached head.
    assert twice.usage.cached_tokens == approx_tokens(messages[:2])


def test_recent_token_counts_are_prefix_differences() -> None:
    host = ScriptedHost.from_replies(["x"])
    messages = long_conversation()  # per message: [12, 13, 30, 186, 30, 186, 12, 9, 30, 17]
    big_tools = [{"type": "function", "function": {"name": "t", "description": "d" * 4000}}]
    calls: list[list[dict]] = []

    async def count(ms: list[dict]) -> int:
        calls.append(ms)
        return await host.count_tokens(ms, big_tools)

    counts = asyncio.run(recent_token_counts(messages, count, 50))
    # Tool overhead cancels out; counting stops once the recent messages pass the budget.
    assert counts == [0, 0, 51, 51, 51, 51, 51, 9, 30, 17]
    assert calls == [messages, messages[:9], messages[:8], messages[:7]]
    assert asyncio.run(recent_token_counts(messages, count, 10**6)) == [0, 0, 30, 186, 30, 186, 12, 9, 30, 17]


def test_compact_with_tools_bound_into_the_counter() -> None:
    # What session.py does: the counter includes the tool schemas.
    host = ScriptedHost.from_replies(["plain", "bound"])
    tools = [{"type": "function", "function": {"name": "t", "description": "d" * 4000}}]
    messages = long_conversation()
    settings = CompactionSettings(reserve_tokens=256, keep_recent_tokens=50)
    seen: list[list[dict]] = []

    async def bound(ms: list[dict]) -> int:
        seen.append(ms)
        return await host.count_tokens(ms, tools)

    plain = asyncio.run(compact(messages, host.session("a"), host.count_tokens, settings))
    with_tools = asyncio.run(compact(messages, host.session("b"), bound, settings, tools=tools))
    assert with_tools.n_summarized == plain.n_summarized == 6
    assert with_tools.messages[3:] == plain.messages[3:] == messages[8:]
    assert with_tools.tokens_before == approx_tokens(messages, tools)
    assert with_tools.tokens_after == approx_tokens(with_tools.messages, tools)
    # Only prefixes of the conversation, and the result, are ever rendered.
    assert all(ms == messages[: len(ms)] for ms in seen[:-1]) and seen[-1] == with_tools.messages
