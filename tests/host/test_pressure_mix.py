"""Sessions of two agents over shared prefixes, forks and turns gathered three at a time, under a KV budget
that forces spills: the tokens of an unbounded host, and a peak within the budget, at 16 and 8 bits.

What each piece does alone has its own tests; this one mixes them, as an orchestrator's children do,
because their interplay is where admission went wrong twice: a session evicted to make room for its own
turn came back whole, more than it was counted for, and a hybrid session's snapshot (a copy of its
cache as allocated) held up to a step more than it was counted for, over the budget."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.host import GenerateArgs, MlxModelHost

AGENTS = {
    agent: {"role": "system", "content": f"You are {agent}. " + " ".join(f"Rule {n}: report {agent} paths." for n in range(45))}
    for agent in ("scout", "worker")
}  # fmt: skip
# The budget: this share of what the unbounded run held at its peak: one turn and some idle sessions fit,
# not all of them (spills and restores happen, asserted).
SHARE = 0.7


def plan(seed: int) -> list[tuple[str, int, str, int, int]]:
    """Fourteen steps: (a turn | a fork's first turn | three sessions at once, session, agent, tokens, salt)."""
    rng = random.Random(seed)
    kinds = ["turn", "turn", "turn", "fork", "gather"]
    return [
        (rng.choice(kinds), rng.randrange(6), rng.choice(list(AGENTS)), rng.randrange(4, 20), rng.randrange(1000))
        for _ in range(14)
    ]


async def play(path: Path, bits: int, budget: int | None, steps: list[tuple[str, int, str, int, int]]) -> Any:
    """Each reply's session and token ids in order, and the pool's counters."""
    replies: list[tuple[str, tuple[int, ...]]] = []
    async with MlxModelHost(str(path), kv_bits=bits) as host:
        await host.set_kv_budget(budget)
        sessions: dict[str, Any] = {}
        talks: dict[str, list[dict[str, Any]]] = {}

        def open_session(i: int, agent: str) -> str:
            name = f"{agent}{i}"
            if name not in sessions:
                sessions[name], talks[name] = host.session(name), [AGENTS[agent]]
            return name

        async def turn(name: str, n: int, salt: int) -> tuple[str, tuple[int, ...]]:
            talks[name].append({"role": "user", "content": f"Task {salt}: look at module {salt * 3}."})
            reply = await sessions[name].generate(list(talks[name]), GenerateArgs(max_tokens=n))
            talks[name].append({"role": "assistant", "content": reply.text})
            return name, tuple(reply.token_ids)

        for j, (kind, i, agent, n, salt) in enumerate(steps):
            name = open_session(i, agent)
            if kind == "turn":
                replies.append(await turn(name, n, salt))
            elif kind == "fork":
                fork = f"{name}-fork{j}"
                sessions[fork], talks[fork] = host.session(fork, fork_of=name), list(talks[name])
                replies.append(await turn(fork, n, salt))
            else:
                names = [open_session((i + d) % 6, agent) for d in range(3)]
                replies += await asyncio.gather(*(turn(m, n, salt + d) for d, m in enumerate(names)))
        stats = await host.memory_stats()
    return replies, stats.pool


@pytest.mark.slow
@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize(("arch", "seed"), [("qwen3", 6), ("qwen3_5", 7), ("gemma3_text", 9)])
def test_forks_and_gathered_turns_under_pressure_give_unbounded_tokens_within_the_budget(
    quantizable: Callable[[str], Path], arch: str, seed: int, bits: int
) -> None:
    """Dense, hybrid (its sessions hold snapshots) and sliding-window layers; the seeds are plans that once
    broke the budget (qwen3, qwen3_5) or press it hardest (gemma3_text)."""
    path, steps = quantizable(arch), plan(seed)
    free, unbounded = asyncio.run(play(path, bits, None, steps))
    budget = int(unbounded["peak_bytes"] * SHARE)
    tight, pool = asyncio.run(play(path, bits, budget, steps))
    assert tight == free
    assert pool["spills"] > 0 and pool["restores"] > 0  # the budget pressed
    assert pool["peak_bytes"] <= budget
