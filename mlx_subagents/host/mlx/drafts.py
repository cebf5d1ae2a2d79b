"""Drafts: the tokens a session proposes to verify in one forward, guessed from its own tokens.

A coding agent's replies repeat its context: an `edit` call quotes the lines it replaces, a `write`
re-emits a file it read, a summary quotes paths and names. Prompt lookup guesses the next tokens as
the ones that followed the latest earlier occurrence of the session's last few tokens (an n-gram), in
its prompt or its reply so far; the model then checks them all in one forward (`verify.py`), and on a
memory-bound device that forward costs about what one token's does.

`Drafter` is the seam: a draft model would be another one, proposing from the same tokens and told
the same verdicts. `LookupDrafter` adapts to its session: the draft grows while whole drafts are
accepted and shrinks to what was, a poor acceptance rate makes it ask for longer matches, and a rate
that stays poor pauses it for a while that doubles each time, so text with nothing to copy costs no
forwards and next to no lookups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


class Drafter(Protocol):
    """What proposes a session's drafts and hears how they fared."""

    def propose(self, tokens: Sequence[int]) -> list[int]:
        """Up to a few tokens to follow `tokens` (the session's whole sequence so far); [] for none."""
        ...

    def observe(self, drafted: int, accepted: int) -> None:
        """How many of the last proposal's `drafted` tokens the model accepted."""
        ...

    def outlook(self) -> list[float]:
        """The accepted tokens its next draft is expected to give, by its length: `[0, e1, .. ek]` up to the
        longest it would propose now (`[0.0]`: it would propose none)."""
        ...


@dataclass
class LookupDrafter:
    """Prompt lookup over one session's tokens, adapting its draft length and n-gram length.

    Args:
        max_draft: the longest draft (a forward's tokens are this and one).
        max_ngram: the longest n-gram matched; the longest one that matches is used.
        floor: below this acceptance rate (a moving average over drafts) drafting pauses.

    Its settings were chosen offline on SmolLM2-135M's greedy replies to `benchmarks/speculative.py`'s
    workloads, each reply replayed through drafters of every setting (a draft is accepted up to its
    first token that differs from the reply; `tests/host/test_speculative.py` replays one): drafts that
    start at 8 tokens, double while whole drafts are accepted up to 32 and fall to two more than were
    accepted, with n-grams of 2 to 4 tokens, keep the most tokens per forward.
    """

    max_draft: int = 32
    max_ngram: int = 4
    floor: float = 0.1
    draft: int = 8  # the current draft length
    min_ngram: int = 2  # the shortest n-gram matched now (never under 2: a single token matches anywhere)
    rate: float = 0.5  # the moving average of accepted / drafted
    drafts: int = 0  # drafts proposed since drafting last resumed
    paused: int = 0  # proposals left to skip
    pause: int = 16  # the next pause's length
    kept: float = 1.0  # drafted tokens accepted, and drafts refused (at a token), decayed: a token's odds
    refused: float = 1.0
    _index: dict[tuple[int, ...], int] = field(default_factory=dict, repr=False)
    _indexed: int = 0  # n-grams ending before this position are in `_index`

    def propose(self, tokens: Sequence[int]) -> list[int]:
        if self.paused:
            self.paused -= 1
            return []
        end = len(tokens)
        self._index_up_to(tokens, end - 1)
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            after = self._index.get(tuple(tokens[end - n : end]))
            if after is not None:
                # What followed the match; past the end, the draft goes on copying itself: a match that
                # overlaps the last tokens is a repeating run, and the run goes on.
                draft: list[int] = []
                for j in range(after, after + self.draft):
                    draft.append(tokens[j] if j < end else draft[j - end])
                return draft
        return []

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.drafts += 1
        self.kept, self.refused = 0.8 * self.kept + accepted, 0.8 * self.refused + (accepted < drafted)
        self.rate = 0.7 * self.rate + 0.3 * accepted / drafted
        whole = accepted == drafted
        self.draft = min(self.max_draft, 2 * self.draft) if whole else max(1, accepted + 2)
        if self.rate < 0.4:
            self.min_ngram = min(self.max_ngram, self.min_ngram + 1)
        elif self.rate > 0.6:
            self.min_ngram = max(2, self.min_ngram - 1)
        if self.drafts >= 4 and self.rate < self.floor:
            self.paused, self.pause = self.pause, min(2 * self.pause, 1024)
            self.drafts, self.rate = 0, 0.5
        elif whole:
            self.pause = 16

    def outlook(self) -> list[float]:
        """Each drafted token accepted as the one before it was, with the odds of its record (`kept` against
        `refused`): a draft of k tokens is expected to keep p + p^2 + .. + p^k."""
        if self.paused:
            return [0.0]
        p, out = self.kept / (self.kept + self.refused), [0.0]
        for k in range(1, self.draft + 1):
            out.append(out[-1] + p**k)
        return out

    def _index_up_to(self, tokens: Sequence[int], end: int) -> None:
        """Every n-gram (up to `max_ngram`) ending before `end`, each to the position after its latest
        occurrence."""
        for stop in range(max(self._indexed, 1), end + 1):
            for n in range(1, min(self.max_ngram, stop) + 1):
                self._index[tuple(tokens[stop - n : stop])] = stop
        self._indexed = max(self._indexed, end + 1)
