"""Calls that close: a reply whose call (or held answer) is still open near its token limit is steered
to close it, so a started call ends as a valid call instead of being cut.

A small model often runs a string argument on until the limit (SmolLM2 did for 16 of 24 forced calls):
the call is then lost, though every call that closed was valid. So once a running grammar has
`CLOSE_WINDOW` tokens or fewer left, the host looks for the shortest way to close what is open: a
breadth-first search through the tokens that close things (`"`, `}`, `]`, a newline, `</`, `>`: the
JSON and XML of every call format; `,`, `:`, `[]`, `{}` and `0` for a required key still missing) and
whatever the grammar then forces (a key's name, a closing tag's rest, the end marker), each step checked
by the matcher itself, so the closing is valid by construction. While the tokens left are more than that way is long,
the model writes on; once they are not, each next token is the way's next one: the budget for an open
string or array shrinks with the tokens left. The search runs only inside the window, on copies of the
matcher.
"""

from __future__ import annotations

from collections import deque
from typing import Any

CLOSE_WINDOW = 16  # tokens left at which a running grammar starts to look for its way to close
MAX_NODES = 96  # states the search looks at, at most, per step
BRANCH = 4  # closing tokens tried from each state (those that close the most first)
CLOSING = frozenset('"]}')  # what a token's closing score counts
# What closings are written with: strings, lists and objects closed, a required key still missing
# written with an empty or zero value (`, "tags": []`), closing tags (`</`, `>`), newlines.
CLOSER_CHARS = frozenset('"}]>/<\n ,:[{0')


class Closers:
    """The tokens of a vocabulary that close things (their text only `CLOSER_CHARS`), plus the end
    marker and end-of-turn tokens, each with a score: how much it closes (its quotes and closing
    brackets, the most for an end marker), less a little for its length (spaces close nothing).
    Found once per host, on first need."""

    def __init__(self, tokenizer: Any, extra: tuple[int, ...]) -> None:
        self._tokenizer, self._extra = tokenizer, extra
        self._mask: Any = None
        self._score: Any = None

    def mask(self) -> tuple[Any, Any]:
        """(a bool row over the vocabulary: the closers, each token's score)."""
        if self._mask is None:
            import numpy as np

            vocab = len(self._tokenizer.vocab)
            mask, score = np.zeros(vocab, dtype=bool), np.zeros(vocab, dtype=np.float32)
            for t in range(vocab):
                text = self._tokenizer.decode([t])
                if text and set(text) <= CLOSER_CHARS:
                    mask[t] = True
                    score[t] = sum(c in CLOSING for c in text) - len(text) / 100
            ends = [t for t in self._extra if t < vocab]
            mask[ends], score[ends] = True, 100.0
            self._mask, self._score = mask, score
        return self._mask, self._score


def shortest_close(matcher: Any, allowed_of: Any, allowed: Any, closers: Closers, budget: int) -> list[int] | None:
    """The shortest token sequence (at most `budget`) after which `matcher` accepts or stops: the way
    to close what is open. None when there is none within the search's bounds.

    Args:
        allowed_of: `allowed_of(matcher)` is what a matcher allows next (a bool row).
        allowed: what `matcher` allows now (computed already).
    """
    import numpy as np

    mask, score = closers.mask()
    if matcher.is_accepting():
        return []
    start: list[int] = []
    if forced := matcher.compute_ff_tokens():  # what the grammar already dictates (an enum's rest) comes first
        matcher = matcher.deep_copy()
        if not matcher.consume_tokens(forced):
            return None
        start, allowed = list(forced), allowed_of(matcher)
        if matcher.is_accepting() or matcher.is_stopped():
            return start if len(start) <= budget else None
    frontier: deque[tuple[Any, list[int], Any]] = deque([(matcher, start, allowed)])
    nodes = 0
    while frontier:
        state, path, can = frontier.popleft()
        n = min(can.size, mask.size)
        candidates = np.flatnonzero(can[:n] & mask[:n])
        for token in candidates[np.argsort(-score[candidates], kind="stable")][:BRANCH]:
            after = state.deep_copy()
            if not after.consume_token(int(token)):
                continue
            way = [*path, int(token)]
            forced = after.compute_ff_tokens()
            if forced and after.consume_tokens(forced):
                way += forced
            if after.is_accepting() or after.is_stopped():
                return way if len(way) <= budget else None
            nodes += 1
            if len(way) < budget and nodes < MAX_NODES:
                frontier.append((after, way, allowed_of(after)))
    return None


def still_closes(matcher: Any, way: list[int]) -> bool:
    """Whether `way`, found from an earlier state, still closes what is open from `matcher`'s state (the
    model wrote on inside a string, say). The check copies the matcher once, where a search copies it
    up to `MAX_NODES` times; a way that still closes and is shorter than the tokens left decides as a
    new search would (the shortest is no longer, so there is room still: write on)."""
    after = matcher.deep_copy()
    return bool(after.consume_tokens(way)) and (after.is_accepting() or after.is_stopped())
