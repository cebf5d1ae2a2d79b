"""When drafts pay in the batch (`host/mlx/draft_costs.py`): from costs injected as the batch would have
measured them, which width each step runs and which rows draft; and a host whose costs say drafts never
pay drafts nothing, with the tokens of drafts off."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

from mlx_subagents.host.mlx.draft_costs import DraftWidths, StepCosts, best_width

GPU = {2: 1.02, 3: 1.04, 5: 1.1, 9: 1.2, 17: 1.5, 33: 2.1}  # a memory-bound device: width is nearly free
CPU = {2: 2.1, 3: 4.7, 5: 4.8, 9: 10.0, 17: 33.0, 33: 120.0}  # a loaded CPU, 4 rows of the tiny model


def outlook(p: float, k: int) -> list[float]:
    """The expected accepted tokens of drafts of 0..k tokens, each accepted with odds p after the last."""
    out = [0.0]
    for j in range(1, k + 1):
        out.append(out[-1] + p**j)
    return out


def costs(ratios: dict[int, float]) -> StepCosts:
    return StepCosts(plain=0.01, plains=2, ratios=dict(ratios))


def test_the_width_is_the_one_whose_expected_tokens_per_cost_are_the_most() -> None:
    sure, unsure = outlook(1.0, 16), outlook(0.3, 16)
    # Rows whose drafts are always accepted: nearly free widths pay up to the longest draft (16 tokens: 17).
    assert best_width([16] * 4, [sure] * 4, costs(GPU)) == (17, 17)
    # On the CPU 5 positions give the most (20 tokens for 4.8 steps), not 2, 3 or 9 (36 for 10).
    assert best_width([16] * 4, [sure] * 4, costs(CPU)) == (5, 5)
    # Drafts that are seldom accepted: a plain step gives more on the CPU; the best width is the probe's.
    assert best_width([16] * 4, [unsure] * 4, costs(CPU)) == (1, 2)
    # ... and still pay where width is nearly free.
    assert best_width([16] * 4, [unsure] * 4, costs(GPU))[0] > 1
    # No row drafted: a plain step, nothing to probe.
    assert best_width([0] * 4, [[0.0]] * 4, costs(GPU)) == (1, 1)
    # One sure row of four, with a 3-token draft: the width stops at what carries it.
    assert best_width([3, 0, 0, 0], [sure, [0.0], [0.0], [0.0]], costs(GPU)) == (5, 5)
    assert best_width([3, 0, 0, 0], [sure, [0.0], [0.0], [0.0]], costs(CPU)) == (1, 2)


def test_a_width_not_measured_is_extrapolated_from_the_narrower_ones() -> None:
    measured = costs({2: 2.0, 5: 4.0})
    assert measured.ratio(2) == 2.0 and measured.ratio(5) == 4.0
    assert measured.ratio(3) == 2.0 * 3 / 2  # from 1 at width 1 to 2 at width 2: the cost grows as the width
    power = math.log(4.0 / 2.0) / math.log(5 / 2)  # from width 2 to 5 it grew as width^0.76
    assert measured.ratio(9) == 4.0 * (9 / 5) ** power
    assert StepCosts().ratio(2) == 2**0.5  # nothing measured: from a plain step's 1, by the width's root
    assert costs(GPU | {9: 1.2}).ratio(33) == 2.1  # measured
    assert round(costs({2: 1.02, 5: 1.1}).ratio(33), 2) == 2.83  # flat costs: at least the root
    # This machine's tiny-model rows: 9 positions cost 12.7 plain steps, so 33 are not tried (96.8, measured 86).
    assert round(costs({3: 2.28, 9: 12.7}).ratio(33), 1) == 96.8
    measured.drafted_step(2, 0.01 * 30.0)  # the first at a width compiles its shapes: not counted
    measured.drafted_step(2, 0.01 * 3.0)  # then a moving average of what each width measured
    assert measured.ratios[2] == 0.7 * 2.0 + 0.3 * 3.0


def test_a_steps_seconds_count_once_its_tokens_are_read_back() -> None:
    """mlx-lm's plain step leaves its tokens computing; the next step's wait for them is part of its cost."""
    widths = DraftWidths()
    widths.plain(0.004)  # the call; its tokens still computing
    widths.plain(None)  # a step that also prefilled: says nothing, and the one before is not counted alone
    assert widths.costs.plains == 0
    widths.plain(0.004)
    widths.synced(0.006)  # drafts read its tokens back: 4 + 6 ms
    widths.plain(0.003)
    widths.plain(0.009)  # a plain step after a plain one waited for it itself
    assert widths.costs.plains == 2 and abs(widths.costs.plain - (0.8 * 0.010 + 0.2 * 0.003)) < 1e-12
    widths.drafted(5, 0.2)  # its first: it compiles
    widths.drafted(5, 0.02)
    assert widths.costs.ratios == {5: 0.02 / widths.costs.plain}


def test_drafts_that_do_not_pay_are_probed_less_and_less_often() -> None:
    widths = DraftWidths(costs(CPU))
    unsure = [outlook(0.3, 16)] * 4
    assert not widths.promising([0] * 4, [[0.0]] * 4)  # no draft to make: no probe counted either
    steps = [widths.promising([16] * 4, unsure) for _ in range(16 + 32 + 64)]
    assert [i for i, drafts in enumerate(steps) if drafts] == [15, 15 + 32, 15 + 32 + 64]
    assert widths.choose([16, 0, 3, 0], unsure) == 2  # the probe: the best width over one
    assert widths.choose([16, 0, 3, 0], unsure) == 1 and widths.probe == 128
    sure = [outlook(1.0, 16)] * 4
    assert widths.promising([16] * 4, sure) and widths.choose([16] * 4, sure) == 5  # they pay: probes start over
    assert widths.probe == 16 and widths.declined == 0
    assert not DraftWidths().promising([16] * 4, sure)  # before two plain steps are measured: none


class Fixed(StepCosts):
    """Costs injected as measured, kept whatever the steps take (this machine's timings are not asserted)."""

    def plain_step(self, seconds: float) -> None:
        self.plains += 1

    def drafted_step(self, width: int, seconds: float) -> None:
        pass


def fix_costs(host: Any, ratios: dict[int, float] = GPU) -> None:
    """Make `host`'s batch decide on `ratios` whatever its steps take (a GPU's by default: drafts pay)."""
    host._scheduler.decode.widths = DraftWidths(Fixed(plain=0.01, ratios=dict(ratios)), probe=10**9)


async def four(path: Path, draft: str, ratios: dict[int, float] | None) -> list[tuple[list[int], int, int]]:
    """Four sessions decoding together; each one's tokens, drafted and accepted tokens."""
    from mlx_subagents.host import GenerateArgs, MlxModelHost
    from tests.host.test_batching import task

    async with MlxModelHost(str(path), draft=draft) as host:
        if ratios is not None:
            fix_costs(host, ratios)
        replies = await asyncio.gather(
            *(host.session(f"s{i}").generate(task(i), GenerateArgs(max_tokens=48)) for i in range(4))
        )
    return [(r.token_ids, r.usage.drafted_tokens, r.usage.accepted_tokens) for r in replies]


def test_the_batch_drafts_only_where_the_measured_costs_say_drafts_pay(tiny_qwen3_path: Path) -> None:
    """The same four sessions with drafts off, with costs where drafts pay (a GPU's) and with costs where
    the forwards they need cost more than they give (every width 50 plain steps): the same tokens each
    way; rows draft and keep drafts under the first, and none drafts under the second."""
    off = asyncio.run(four(tiny_qwen3_path, "off", None))
    paying = asyncio.run(four(tiny_qwen3_path, "lookup", GPU))
    dear = asyncio.run(four(tiny_qwen3_path, "lookup", dict.fromkeys(GPU, 50.0)))
    assert [t for t, _, _ in paying] == [t for t, _, _ in off] == [t for t, _, _ in dear]
    assert all(accepted > 0 for _, _, accepted in paying)
    assert [(d, a) for _, d, a in dear] == [(0, 0)] * 4
