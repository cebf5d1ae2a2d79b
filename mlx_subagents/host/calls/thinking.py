"""Thinking budgets: a thought that runs past its budget is closed, and the model answers.

One logits processor per request watches the tokens it is shown: it notices the
thought opening (in the prompt, as Qwen3.5's template does, or in the reply), counts
its tokens, and once the budget is spent forces the end marker's token(s), one per
step. Being a logits processor, it works the same in the batched and the serialized
decode path; the scheduler's loop is not touched.

Its state lives on the device and a call only builds a graph: reading the newest token
on the host would wait for the step in flight, undoing the pipelining of both decode
paths, which build step n+1 while step n computes (as `testing/forced.py` does). Until a
thought could have reached its budget a call adds nothing at all; after that, one lookup
in a small automaton (markers, thought, forcing) and a count per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # mlx is imported where it runs: importing the host stays quick
    import mlx.core as mx

# The generation prompt that opens a thought is short (`<|im_start|>assistant\n<think>\n`).
_PROMPT_TAIL = 32


@dataclass(frozen=True)
class ThoughtState:
    """Where a reply stands, as device arrays of shape (1,) (read them only once the step is evaluated)."""

    at: mx.array  # int32: the automaton's state (inside a thought or not, marker progress, end tokens
    # forced), times its number of entries per state
    over: mx.array  # int32: tokens of the thought so far minus the budget, at most 0 (read inside one)


@dataclass(frozen=True)
class _Automaton:
    """Thinking, open and closed, as a table: a state per (inside a thought, the longest suffix of the
    tokens that starts a marker, end tokens forced so far), an entry per (state, token class, budget
    spent before the token). Built on the host; one lookup per token then replaces the marker matching."""

    nodes: list[tuple[int, ...]]  # the markers' prefixes, shortest first
    classes: dict[int, int]  # token -> class times 2; every other token is `other`
    other: int
    next: list[int]  # entry -> the next state, times the entries per state
    stay: list[bool]  # entry -> the token was inside a thought that goes on (its count goes on)
    row: list[int]  # state (times the entries per state) -> 0, or 1 + the end token it forces once spent
    n_forced: int  # end tokens forced so far: 0 to the marker's length
    width: int  # entries per state: 2 per token class

    @classmethod
    def make(cls, start: tuple[int, ...], end: tuple[int, ...]) -> _Automaton:
        nodes = sorted({m[:k] for m in (start, end) for k in range(len(m) + 1)}, key=lambda p: (len(p), p))
        alphabet = sorted(set(start) | set(end))
        n_classes, n_forced = len(alphabet) + 1, len(end) + 1
        width = 2 * n_classes  # entries per state

        def state(thinking: bool, node: tuple[int, ...], forced: int) -> int:
            return ((int(thinking) * len(nodes) + nodes.index(node)) * n_forced + forced) * width

        size = 2 * len(nodes) * n_forced * width
        next_, stay, row = [0] * size, [False] * size, [0] * size
        for thinking in (False, True):
            for node in nodes:
                for forced in range(n_forced):
                    at = state(thinking, node, forced)
                    row[at] = 1 + min(forced, len(end) - 1) if thinking else 0
                    for c, token in enumerate([*alphabet, None]):
                        after = _longest_node(node, token, nodes)
                        for past in (0, 1):  # the budget was spent before this token
                            i = at + 2 * c + past
                            if not thinking:  # opening resets the count (stay False) and the forcing
                                next_[i] = state(_ends(after, start), after, 0)
                            elif _ends(after, end):
                                next_[i] = state(False, after, 0)
                            else:
                                on = past and forced < len(end) and token == end[min(forced, len(end) - 1)]
                                next_[i], stay[i] = state(True, after, forced + int(on)), True
        classes = {token: 2 * c for c, token in enumerate(alphabet)}
        return cls(nodes, classes, 2 * len(alphabet), next_, stay, row, n_forced, width)


def _longest_node(node: tuple[int, ...], token: int | None, nodes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The longest suffix of `node` + `token` that is a marker's prefix (no token: another than theirs)."""
    if token is None:
        return ()
    seq = (*node, token)
    while seq not in nodes:
        seq = seq[1:]
    return seq


def _ends(node: tuple[int, ...], marker: tuple[int, ...]) -> bool:
    return bool(marker) and node[len(node) - len(marker) :] == marker


@dataclass(frozen=True)
class _Tables:
    """The automaton on the device, made on the thread that decodes."""

    classes: mx.array  # token id -> class times 2
    next: mx.array
    stay: mx.array
    row: mx.array
    masks: mx.array  # row -> the logits forcing that end token (row 0 unused)
    nodes: list[tuple[mx.array, int]]  # each non-empty prefix, with its state index part
    zero: mx.array  # constants of the state's shape (1,): Python numbers would add a broadcast each
    one: mx.array
    floor: mx.array  # minus the budget: the count of a thought just opened

    @classmethod
    def make(cls, auto: _Automaton, end: tuple[int, ...], budget: int, vocab: int, dtype: Any) -> _Tables:
        import mlx.core as mx

        classes = mx.full((vocab,), auto.other, dtype=mx.int32)
        known = [(t, c) for t, c in auto.classes.items() if 0 <= t < vocab]
        if known:
            classes[mx.array([t for t, _ in known])] = mx.array([c for _, c in known], dtype=mx.int32)
        keep = mx.arange(vocab)[None] == mx.array([-1, *end])[:, None]
        masks = mx.where(keep, mx.array(0.0, dtype=dtype), mx.array(-mx.inf, dtype=dtype))
        nodes = [(mx.array(p, dtype=mx.int32), i) for i, p in enumerate(auto.nodes) if p]
        tables = [mx.array(auto.next), mx.array(auto.stay), mx.array(auto.row)]
        return cls(classes, *tables, masks, nodes, mx.array([0]), mx.array([1]), mx.array([-budget]))


class ThoughtBudget:
    """Forces `end` once `budget` tokens were thought; serves one request (like every processor).

    Both decode paths pass the context plus the tokens generated so far, so the first call
    sees the prompt and each later call one new token (several are taken in order).

    Until `budget` tokens were generated nothing can be forced (a thought counts only its own
    tokens), so until then a call adds nothing to the graph; the state is then worked out from
    those tokens in one go, and from there on updated per token.
    """

    def __init__(self, budget: int, start: Sequence[int], end: Sequence[int], opened: bool) -> None:
        if not end:
            raise ValueError("a thought budget needs an end marker to close the thought with")
        self.budget = max(0, budget)
        self.start, self.end = tuple(start), tuple(end)
        self.opened = opened
        self.state: ThoughtState | None = None  # made once something could be forced
        self._automaton = _Automaton.make(self.start, self.end)
        self._tables: _Tables | None = None
        self._first: int | None = None  # the context length at the first call: the prompt
        self._seen = 0  # context tokens taken into the state
        # A token ending both markers would open and close at once: the catch-up cannot tell which
        # came first, so such markers are followed token by token from the start.
        self._defer = not (_is_suffix(self.start, self.end) or _is_suffix(self.end, self.start))

    def __call__(self, tokens: mx.array | Sequence[int], logits: mx.array) -> mx.array:
        import mlx.core as mx

        n = len(tokens)  # a shape: no evaluation
        if self._first is None:
            self._first = self._seen = n
        if n < self._seen:
            raise RuntimeError("a ThoughtBudget serves one request; make a fresh one per request")
        if self.state is None:
            if self._defer and n - self._first < self.budget:
                return logits  # no thought is `budget` tokens long yet
            self._tables = _Tables.make(self._automaton, self.end, self.budget, logits.shape[-1], logits.dtype)
            caught = min(n - self._first, self.budget) if self._defer else 0
            self.state = self._catch_up(_ids(tokens, self._first, self._first + caught))
            self._seen = self._first + caught
        if n > self._seen:
            new = tokens[self._seen : n]
            new = new if isinstance(new, mx.array) else mx.array(list(new), dtype=mx.int32)
            for i in range(n - self._seen):
                self.state = self._advance(self.state, new[i : i + 1] if n - self._seen > 1 else new)
            self._seen = n
        tables = self._tables
        assert tables is not None
        # Past the budget inside a thought: a fresh mask keeping only the next end-marker token, not
        # on top of `logits`, so it wins over processors that ran before it.
        row = mx.where(self.state.over >= tables.zero, tables.row[self.state.at], tables.zero)
        return mx.where(row > tables.zero, tables.masks[row], logits)

    def _advance(self, state: ThoughtState, token: mx.array) -> ThoughtState:
        """The state after `token` (shape (1,)): one lookup in the automaton, and the count goes on
        inside a thought (a thought opening starts it at minus the budget)."""
        import mlx.core as mx

        tables = self._tables
        assert tables is not None
        past = mx.where(state.over >= tables.zero, tables.one, tables.zero)  # the budget was spent
        i = state.at + tables.classes[token] + past
        over = mx.where(tables.stay[i], mx.minimum(state.over + tables.one, tables.zero), tables.floor)
        return ThoughtState(tables.next[i], over)

    def _catch_up(self, history: mx.array) -> ThoughtState:
        """The state after `history`, none of whose tokens was forced or counted past the budget:
        only the markers moved it. The thought open at its end is the one the prompt opened if no
        end marker came, else the first one opened after the last end marker."""
        import mlx.core as mx

        tables, auto = self._tables, self._automaton
        assert tables is not None
        m = history.size
        if m == 0:
            thinking, spent = mx.array([self.opened]), mx.array([0])
        else:
            index = mx.arange(m)
            last_close = mx.max(mx.where(_hits(history, self.end), index, -1))
            first_open = mx.min(mx.where(_hits(history, self.start) & (index > last_close), index, m))
            kept = mx.array(self.opened) & (last_close < 0)  # the prompt's thought, never closed
            thinking = (kept | (first_open < m)).reshape(1)
            spent = mx.where(kept, m, m - 1 - first_open).reshape(1)
        # The marker progress: the longest marker prefix the history ends with (prefixes shortest first).
        node = mx.array([0])
        for prefix, i in tables.nodes:
            if prefix.size <= m:
                node = mx.where(mx.all(history[m - prefix.size :] == prefix), i, node)
        at = (thinking.astype(mx.int32) * len(auto.nodes) + node) * auto.n_forced * auto.width  # forced 0
        return ThoughtState(at, mx.minimum(spent - self.budget, 0))


def _ids(tokens: mx.array | Sequence[int], start: int, stop: int) -> mx.array:
    """`tokens[start:stop]` as an int32 device array (a slice of a pending context stays pending)."""
    import mlx.core as mx

    ids = tokens[start:stop]
    return (ids if isinstance(ids, mx.array) else mx.array(list(ids))).astype(mx.int32)


def _hits(ids: mx.array, marker: tuple[int, ...]) -> mx.array:
    """For each position of `ids`, whether the tokens up to it end with `marker` (never an empty one)."""
    import mlx.core as mx

    m, k = ids.size, len(marker)
    if not marker or k > m:
        return mx.zeros((m,), dtype=mx.bool_)
    hit = ids[k - 1 :] == marker[-1]
    for j, token in enumerate(marker[:-1]):
        hit = hit & (ids[j : m - k + 1 + j] == token)
    return mx.concatenate([mx.zeros((k - 1,), dtype=mx.bool_), hit])


def _is_suffix(suffix: tuple[int, ...], of: tuple[int, ...]) -> bool:
    return bool(suffix) and len(suffix) <= len(of) and of[len(of) - len(suffix) :] == suffix


def prompt_opens_thought(tokenizer: Any, prompt_ids: Sequence[int]) -> bool:
    """Whether the prompt ends inside a thought (its generation prompt wrote the start marker)."""
    if not getattr(tokenizer, "has_thinking", False):
        return False
    ids = list(prompt_ids[-_PROMPT_TAIL:])
    return tokenizer.rfind_think_start(ids) > tokenizer.rfind_think_end(ids)


def thought_budget(tokenizer: Any, budget: int, prompt_ids: Sequence[int]) -> ThoughtBudget | None:
    """The processor for one request of a thinking model, or None for a model that does not think."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    opened = prompt_opens_thought(tokenizer, prompt_ids)
    return ThoughtBudget(budget, tokenizer.think_start_tokens, tokenizer.think_end_tokens, opened)
