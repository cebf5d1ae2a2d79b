"""When drafts pay in the batch: what a drafted step costs against a plain one, measured as the batch runs,
and the width of the forward that gives the most tokens per second.

A plain step of the batch feeds each row one token and gives each one token. A drafted step feeds each
row its token and a draft, padded to the longest (`drafted_batch.py`): a forward `width` positions
wide, which gives each row one token and the drafted tokens it accepted. On a memory-bound device (a
Mac's GPU) that forward costs about what a plain step does, and every accepted token is a gain; on a
CPU its cost grows with its positions, and drafts that are not accepted often enough make the batch
slower than drafts off (on this project's CPU a 4-row forward 9 positions wide measured 7 plain steps,
17 positions 30). So the batch decides each step from costs it measures itself (`StepCosts`: a plain
step's seconds, and a drafted step's over it, by width) and from each row's expected accepted tokens
(its drafter's record, `Drafter.outlook`): it drafts where the tokens it expects per second beat a
plain step's, at the width that gives the most, and otherwise steps plainly. A width not measured yet
is extrapolated from the narrower ones, hopefully (drafting it measures it); while drafts do not pay, one step in a growing number
drafts anyway, so a cost that falls (the machine less loaded) is seen again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

# The widths a drafted step may have: a draft of 1, 2, 4, .. 32 tokens and the token before it. A row's
# draft is cut to the step's width; few widths keep few shapes for the device to compile, and the cost
# of each is measured on its own (on a CPU it grows faster than the width).
WIDTHS = (2, 3, 5, 9, 17, 33)


@dataclass
class StepCosts:
    """The batch's step costs, moving averages of what it measured: `plain` the seconds of a plain step,
    and by width the seconds of a drafted step over a plain one's (`ratio`)."""

    plain: float | None = None  # seconds of a plain step, a moving average
    plains: int = 0  # plain steps measured
    ratios: dict[int, float] = field(default_factory=dict)  # a drafted step's cost over a plain one's, by width
    warmed: set[int] = field(default_factory=set)  # the widths run once: the first run compiles its shapes

    def plain_step(self, seconds: float) -> None:
        """A plain step took `seconds`."""
        self.plain = seconds if self.plain is None else 0.8 * self.plain + 0.2 * seconds
        self.plains += 1

    def drafted_step(self, width: int, seconds: float) -> None:
        """A drafted step up to `width` (one of `WIDTHS`) positions wide took `seconds` (ignored until a
        plain step was measured, and the first at each width: it compiles the width's shapes, tens of
        plain steps on a CPU)."""
        if self.plain is None or self.plain <= 0 or width not in self.warmed:
            self.warmed.add(width)
            return
        ratio, before = seconds / self.plain, self.ratios.get(width)
        self.ratios[width] = ratio if before is None else 0.7 * before + 0.3 * ratio

    def ratio(self, width: int) -> float:
        """The cost of a drafted step `width` positions wide over a plain step's: as measured, or, for a
        width not measured yet, extrapolated from the two widest measured below it (a plain step's 1 at
        width 1 counting as one) by the power of the width their costs grew with, at least its root:
        hopeful enough that a width that pays is tried (and then measured), not so that a CPU, where the
        cost grows faster than the width, tries a width its narrower ones already say is too dear."""
        if width in self.ratios:
            return self.ratios[width]
        below = sorted(w for w in self.ratios if w < width)
        (w1, r1), (w2, r2) = ([(1, 1.0)] + [(w, self.ratios[w]) for w in below])[-2:] if below else ((1, 1.0), (1, 1.0))
        power = max(0.5, math.log(r2 / r1) / math.log(w2 / w1)) if w2 > w1 and r2 > r1 > 0 else 0.5
        return r2 * (width / w2) ** power


@dataclass
class DraftWidths:
    """The batch's choice of each step's width, from the costs it measures (`costs`) and the rows' outlooks.

    A step asks `promising` first, with the drafts the rows would propose at most (proposing means
    reading the batch's next tokens back, which stops mlx-lm's pipelined step for a step), then `choose`
    with the drafts they did propose. While drafts do not pay, one step in `probe` drafts anyway, `probe`
    doubling up to 1024 while probes do not pay either (their cost stays a small share of the steps).
    A step's seconds come in as it ends: `plain` (mlx-lm's step), `synced` (the wait for the tokens it
    left in flight, read back by the next step's drafts) and `drafted`.
    """

    costs: StepCosts = field(default_factory=StepCosts)
    probe: int = 16
    declined: int = 0  # steps that declined to draft since the last probe or drafted step
    _probing: bool = False
    _plain: float | None = None  # the last plain step's seconds, not yet counted (its tokens in flight)

    def promising(self, drafts: Sequence[int], outlooks: Sequence[Sequence[float]]) -> bool:
        """Whether drafts this long, accepted as `outlooks` expect, would pay this step, or a probe is due.
        Not before two plain steps were measured: a drafted step's cost is measured against theirs."""
        if self.costs.plains < 2:
            return False
        width, widest = best_width(drafts, outlooks, self.costs)
        if width > 1 or widest == 1:
            return width > 1
        self.declined += 1
        if self.declined < self.probe:
            return False
        self.declined, self.probe, self._probing = 0, min(2 * self.probe, 1024), True
        return True

    def choose(self, drafts: Sequence[int], outlooks: Sequence[Sequence[float]]) -> int:
        """The width of this step's forward, for the drafts proposed (1: a plain step)."""
        width, widest = best_width(drafts, outlooks, self.costs)
        if self._probing:
            self._probing = False
            return widest
        if width > 1:
            self.declined, self.probe = 0, 16
        return width

    def plain(self, seconds: float | None) -> None:
        """A plain step's call took `seconds` (None: it prefilled too, so it says nothing of a step's cost).
        Its tokens may still be computing: counted here when the next plain step has waited for them."""
        if self._plain is not None and seconds is not None:
            self.costs.plain_step(self._plain)
        self._plain = seconds

    def synced(self, seconds: float) -> None:
        """The batch's next tokens were read back after waiting `seconds`: the last plain step's rest."""
        if self._plain is not None:
            self.costs.plain_step(self._plain + seconds)
        self._plain = None

    def read(self, tokens: Any) -> list[int]:
        """The batch's next tokens (an mlx array), read back; the wait is `synced`."""
        start = time.perf_counter()
        out = tokens.tolist()
        self.synced(time.perf_counter() - start)
        return out

    def drafted(self, width: int, seconds: float) -> None:
        """A drafted step `width` positions wide took `seconds`, its tokens read back."""
        self._plain = None
        self.costs.drafted_step(width, seconds)

    @contextmanager
    def drafting(self, width: int) -> Iterator[None]:
        """Times the drafted step run inside (`drafted`)."""
        start = time.perf_counter()
        yield
        self.drafted(width, time.perf_counter() - start)


def best_width(drafts: Sequence[int], outlooks: Sequence[Sequence[float]], costs: StepCosts) -> tuple[int, int]:
    """The width of forward worth running: 1 (a plain step) or one of `WIDTHS` (each row's draft cut to
    it), the one whose expected tokens per unit of cost are the most; and the best width over 1 (1 where
    no row drafted), the one to probe.

    Args:
        drafts: each row's draft length (0 for none).
        outlooks: each row's expected accepted tokens by draft length (`outlooks[i][k]` for the first k
            tokens of its draft, `Drafter.outlook`), at least as long as its draft.
        costs: the measured step costs.
    """
    rows, longest = len(drafts), max(drafts, default=0)
    widest, widest_rate = 1, 0.0
    for width in WIDTHS:
        tokens = rows + sum(e[min(d, width - 1)] for d, e in zip(drafts, outlooks, strict=True))
        rate = tokens / costs.ratio(width)
        if rate > widest_rate:
            widest, widest_rate = width, rate
        if width > longest:
            break  # a wider forward carries no more of the drafts
    if longest == 0:
        return 1, 1
    return (widest if widest_rate > rows else 1), widest  # a plain step: a token per row, at a cost of 1
