"""One request held to its grammars (`Constrainer`, a logits processor), and the compiled grammar every
request copies (`Prototype`, its first mask made once). `Grammars` (`grammar.py`) compiles them.

Free decoding costs no host sync. The host's loop records each token it has read
(`Turn.generated`); the processor reads those, and the one token still in flight (the step
being computed, as both decode paths pipeline) is only compared on the device: if it completes
the trigger, the next token is masked with the grammar's first mask, precomputed. Once the
matcher runs, each step needs the token just sampled (the mask depends on it): one sync per
constrained token, the only place, taken once the step's forward pass is queued, so that
llguidance computes the mask while the model runs. In a batch the same is done for all the constrained
rows of a step at once (`masks.MaskBatch`); the processor itself then serves the single path and a
row's first step. llguidance's mlx bitmask kernel is Metal-only, so the mask is
applied with ordinary mlx ops. Near the reply's token limit, what is open is closed (`closing.py`).

A grammar that fails on a token it allowed (llguidance gave up within its limits, mid-reply) does not let
the reply go on unconstrained as if it were held: the failure (`Constrainer.failure`) ends the turn, with
its error, at its next token (the decode stage's `_on_token`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from ...errors import GrammarError
from .closing import CLOSE_WINDOW, Closers, shortest_close, still_closes

if TYPE_CHECKING:  # imported where they run: importing the host stays quick
    import mlx.core as mx
    import numpy as np


# How far `Prototype.walked` follows a grammar's structure: tokens, and the most a step may allow.
WALK_TOKENS = 256
WALK_WIDTH = 16
SIMPLER = "send a simpler schema (smaller counted repetitions in patterns, fewer alternatives or values, less nesting)"


def guidance_error(error: str) -> str:
    """llguidance's error as one short line: its first, without the position in our grammar's text."""
    line = re.sub(r"^at \d+\(\d+\): ", "", error.strip().split("\n", 1)[0])
    return line if len(line) <= 200 else f"{line[:197]}..."


class Prototype:
    """A compiled grammar: the matcher every request copies, and its first mask, made once."""

    def __init__(self, matcher: Any, vocab_size: int, eos: Sequence[int]) -> None:
        self.matcher, self.vocab_size, self.eos = matcher, vocab_size, tuple(eos)
        self._first: dict[int, np.ndarray] = {}
        self._blocked: dict[int, mx.array] = {}
        self._bitmask: Any = None
        self._walked: str | None = None

    def copy(self) -> Any:
        return self.matcher.deep_copy()

    def walked(self, tokenizer: Any) -> str:
        """Why the grammar fails along its structure ("" where it does not), walked once on a copy with a
        buffer of its own (any thread): while a step allows few tokens (braces, keys, markers: not free
        text), the longest is taken (`tokenizer`: llguidance's). A lexeme is built at the first mask that
        reaches it, so what a schema's first values blow up on fails here, not mid-reply."""
        if self._walked is None:
            import llguidance.numpy as llnp
            import numpy as np

            matcher, bitmask = self.copy(), llnp.allocate_token_bitmask(1, self.vocab_size)
            for _ in range(WALK_TOKENS):
                llnp.fill_next_token_bitmask(matcher, bitmask)
                allowed = [int(t) for t in np.flatnonzero(unpack(bitmask, self.vocab_size)[0]) if t not in self.eos]
                if matcher.is_error() or not 0 < len(allowed) <= WALK_WIDTH:
                    break
                if not matcher.consume_token(max(allowed, key=lambda t: len(tokenizer.decode_bytes([t])))):
                    break
            self._walked = guidance_error(matcher.get_error()) if matcher.is_error() else ""
        return self._walked

    def gave_up(self, reason: str) -> None:
        """A copy failed mid-reply: the copies share the lexer that gave up, so `walked` says it from now on
        (the next request with these schemas is refused before its turn)."""
        self._walked = reason

    def first_row(self, vocab: int) -> np.ndarray:
        """The mask of the grammar's first token, as a bool row of `vocab` on the host (made once)."""
        if vocab not in self._first:
            self._first[vocab] = self.allowed(self.matcher, vocab)
        return self._first[vocab]

    def first(self, vocab: int) -> mx.array:
        """The mask of the grammar's first token."""
        import mlx.core as mx

        return mx.array(self.first_row(vocab))

    def blocked(self, vocab: int) -> mx.array:
        """What the first mask rules out, on the device (one op fewer per free step than applying the mask)."""
        if vocab not in self._blocked:
            import mlx.core as mx

            self._blocked[vocab] = mx.array(~self.first_row(vocab))
        return self._blocked[vocab]

    def allowed(self, matcher: Any, vocab: int) -> np.ndarray:
        """The tokens `matcher` allows next, as a bool row of `vocab` (the logits' width), on the host
        (see `unpack`). Every end-of-turn token counts as llguidance's end of sequence (a chat ends its
        turn on `<|im_end|>`, not the tokenizer's EOS)."""
        import llguidance.numpy as llnp

        if self._bitmask is None:  # one buffer: the mlx thread is the only caller
            self._bitmask = llnp.allocate_token_bitmask(1, self.vocab_size)
        llnp.fill_next_token_bitmask(matcher, self._bitmask)
        allowed = unpack(self._bitmask, vocab)[0]
        self.accept_end(matcher, allowed)
        return allowed

    def accept_end(self, matcher: Any, allowed: np.ndarray) -> None:
        """Allow the end-of-turn tokens in `allowed` where `matcher` accepts (the grammar may end)."""
        if self.eos and matcher.is_accepting():
            allowed[[t for t in self.eos if t < allowed.size]] = True


def unpack(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """llguidance's bitmask rows (32 tokens a word) as bool rows of `vocab`: unpacked on the host (numpy:
    a few microseconds; unpacking with mlx ops cost more than llguidance's own work). Padding rows of
    the embedding past the tokenizer's vocabulary are never allowed."""
    import numpy as np

    words = np.ascontiguousarray(bitmask).view(np.uint8)
    bits = np.unpackbits(words, axis=1, count=min(vocab, 8 * words.shape[1]), bitorder="little").astype(bool)
    if bits.shape[1] < vocab:
        bits = np.concatenate([bits, np.zeros((bits.shape[0], vocab - bits.shape[1]), dtype=bool)], axis=1)
    return bits


class Constrainer:
    """Holds one reply to its grammars; serves one request (like every processor).

    Both decode paths pass the context plus the tokens generated so far, a token longer each
    call; it reads only the context's length and its last token (`tail_only`: the single path
    then need not build the context for it). The tokens the host's loop has read come from
    `known` (the turn's `generated`, which the scheduler attaches); the newest, still in flight,
    is read only while a matcher runs. A
    token the grammar rejects (another processor forced it) ends the constraint for this reply:
    it is parsed, and reported, as written.
    """

    def __init__(
        self,
        answer: Prototype | None,
        calls: Prototype | None,
        start_ids: Sequence[int],
        think: tuple[tuple[int, ...], tuple[int, ...]] | None,
        eos: Sequence[int],
        opened: bool,
        ends_reply: bool = False,
        closers: Closers | None = None,
    ) -> None:
        self._answer, self._calls = answer, calls
        self.tail_only = True
        self.ends_reply = ends_reply  # a call runs to the reply's end (Mistral): then only its end follows
        self.start_ids, self.think, self.eos = tuple(start_ids), think, tuple(eos)
        self.known: Sequence[int] = []  # the tokens the host has read (set by the scheduler)
        self.limit: int | None = None  # the reply's token limit: a call open near it is closed (`closing.py`)
        self.closers = closers
        self._closing: list[int] = []  # the way to close what is open, while it is being said
        self._closing_said: int | None = None  # the last token of it this processor allowed alone
        self._check_at = CLOSE_WINDOW  # the tokens left at which to look for the way again
        self._span = 0  # the tokens the last call held by the answer's grammar took (`_close`)
        self._opened_at = 0  # where the call being written began
        self.thinking = opened and think is not None
        self._tokens: list[int] = []  # the tokens fed so far
        self._base: int | None = None  # the context's length at the first call (the prompt)
        self._matcher: Any = None  # while a call, or the answer, is being written
        self._active: Prototype | None = None
        self._mode: Literal["calls", "answer"] = "calls"
        self.engaged: Literal["calls", "answer"] | None = None
        self.broken = False
        self.failure: GrammarError | None = None  # the grammar failed on what it allowed: the turn ends with it
        # What each grammar holds the reply to, as `GrammarError.part` and tool (set by `Grammars.processor`).
        self.parts: dict[str, tuple[str, str | None]] = {"calls": ("tools", None), "answer": ("answer", None)}
        self._mask: np.ndarray | None = None  # the last mask this processor made (None: not its own)
        self._pending_answer = answer is not None  # the answer's grammar starts when the reply does
        # A thinking model's reply whose prompt did not open the thought may open it first.
        self._free_start = self._pending_answer and not self.thinking and think is not None and len(think[0]) == 1
        if self._pending_answer and not self.thinking:
            self._engage(answer, "answer")  # type: ignore[arg-type]

    def _engage(self, proto: Prototype, what: Literal["calls", "answer"]) -> None:
        self._matcher, self._active, self.engaged = proto.copy(), proto, self.engaged or what
        self._mode, self._mask = what, None
        if what == "answer":
            self._pending_answer, self._opened_at = False, len(self._tokens)

    @property
    def running(self) -> bool:
        """Whether a matcher holds the reply now (a call, or the answer, is being written)."""
        return self._matcher is not None and not self.broken

    def catch_up(self, count: int, tokens: Any = None) -> None:
        """Feed the tokens before the `count`-th that the host has read (else read them from the
        context `tokens`: a sync, rare)."""
        while len(self._tokens) < count - 1:
            i = len(self._tokens)
            self.take(self.known[i] if i < len(self.known) else int(tokens[self._base + i].item()))

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        n = len(tokens)
        self._base = n if self._base is None else self._base
        count = n - self._base  # generated tokens in the context; the last may be in flight
        self.catch_up(count, tokens)
        if len(self._tokens) < count:
            if self._matcher is None and not self.broken:
                return self._maybe_trigger(tokens, logits)
            if count - 1 < len(self.known):
                self.take(self.known[count - 1])
            else:
                import mlx.core as mx

                # Start this step's forward, then read the token: the mask is computed while the
                # forward runs. A read that adds no op (the single path's step array,
                # `Tail.in_place`) waits only for the step before. A read that slices adds an op,
                # queued behind the forward: it goes first.
                if getattr(tokens, "in_place", False):
                    mx.async_eval(logits)
                    token = int(tokens[-1].item())
                else:
                    token = int(tokens[-1].item())
                    mx.async_eval(logits)
                self.take(token)
        if self._matcher is None or self.broken:
            return logits
        import mlx.core as mx

        return _masked(logits, mx.array(self.allowed(logits.shape[-1])))

    def to_step(self) -> None:
        """At a step of the batch (`masks.MaskBatch`): the tokens the host has read fed, all but the
        one in flight."""
        self.catch_up(len(self.known) + 1)

    def allowed(self, vocab: int, row: np.ndarray | None = None) -> np.ndarray:
        """What may come next, as a bool row of `vocab`: the matcher's (`row`, when computed with other
        rows' already), the thought's opening at a reply that may open one, only the closing of what is
        open when the reply's limit is near."""
        allowed = self._active.allowed(self._matcher, vocab) if row is None else row  # type: ignore[union-attr]
        if self._matcher.is_error():  # llguidance gave up making the mask
            self._fail()
            allowed[:] = True
            return allowed
        if row is not None:
            self._active.accept_end(self._matcher, allowed)  # type: ignore[union-attr]
        if self._free_start and not self._tokens:  # the reply may open its thought first
            allowed[self.think[0][0]] = True  # type: ignore[index]
        if self.limit is not None and (close := self._close(allowed)) is not None:
            allowed[:] = False
            allowed[close] = True
        self._mask = allowed
        return allowed

    def _close(self, allowed: np.ndarray) -> int | None:
        """The token that closes what is open, once the tokens left leave no room for more (`closing.py`),
        and the reply's end once nothing is open and fewer tokens are left than the last call took (a
        grammar that allows more calls after one would start a call it cannot close). A way found is followed while each token of it is the one that came (a
        forcing processor before the grammar may say another: then it is looked for again)."""
        left = self.limit - len(self._tokens)  # type: ignore[operator]
        if self.closers is None or left > max(self._check_at, self._span):
            return None
        if self._matcher.is_accepting():  # all is closed: end rather than open a call as long as the last
            return next((t for t in self.eos if t < allowed.size and allowed[t]), None)
        if left > self._check_at:
            return None
        said = self._closing_said
        if not (self._closing and said is not None and self._tokens and self._tokens[-1] == said):
            proto, vocab = self._active, allowed.size
            assert proto is not None
            if self._closing and len(self._closing) < left and still_closes(self._matcher, self._closing):
                way: list[int] | None = self._closing  # the way found before still closes, with room: no search
            else:
                way = shortest_close(self._matcher, lambda m: proto.allowed(m, vocab), allowed, self.closers, left)
            self._closing = way or []
            # Each token written lengthens the way by two at most (a nested string or list opened):
            # there is no need to look again before a third of the room left is gone.
            self._check_at = left - max(1, (left - len(self._closing)) // 3) if way else left - 1
        self._closing_said = None
        if not self._closing or len(self._closing) < left:
            return None
        self._closing_said = self._closing.pop(0)
        return self._closing_said

    def _maybe_trigger(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """Free decoding: the token in flight is compared on the device; where it completes the
        trigger, the next token gets the grammar's first mask."""
        if (armed := self.armed()) is None:
            return logits
        import mlx.core as mx

        marker, proto = armed
        return mx.where((tokens[-1] == marker) & proto.blocked(logits.shape[-1]), -mx.inf, logits)

    def armed(self) -> tuple[int, Prototype] | None:
        """While the reply is free: the token that completes the trigger if it is the one in flight,
        and the grammar it starts (None: the token in flight cannot complete it)."""
        if self._matcher is not None or self.broken:
            return None
        if self.thinking:
            marker, proto = (self.think[1], self._answer) if self._pending_answer else ((), None)  # type: ignore[index]
        else:
            marker, proto = self.start_ids, self._calls
        if proto is None or not marker or tuple(self._recent(len(marker) - 1)) != marker[:-1]:
            return None
        return marker[-1], proto

    def _recent(self, k: int) -> list[int]:
        return self._tokens[len(self._tokens) - k :] if k else []

    def take(self, token: int) -> Any:
        """Feed the next token; the matcher that consumed it (None: none did), which a rollback undoes."""
        if not self.consumes(token):
            return None
        matcher = self._matcher
        self.consumed(matcher.consume_token(token))  # type: ignore[union-attr]
        return matcher

    def snapshot(self) -> dict[str, Any]:
        """Its state now, to `restore` when a draft walked through it is refused (`drafted_grammar.py`);
        what its matchers consumed since is theirs to roll back."""
        return {k: v.copy() if isinstance(v, list) and k != "known" else v for k, v in vars(self).items()}

    def restore(self, state: dict[str, Any]) -> None:
        """Comes back to a `snapshot` (taken once, restored once: its lists become the grammar's own)."""
        vars(self).update(state)

    @property
    def prototype(self) -> Prototype | None:
        """The grammar that holds the reply now, or held it last."""
        return self._active

    def consumes(self, token: int) -> bool:
        """Take the next token; True when the running matcher is to consume it (then pass its answer to
        `consumed`: a batch lets llguidance consume every row's token in one call)."""
        self._tokens.append(token)
        if self.broken:
            return False
        if self._matcher is not None:
            if self._free_start and len(self._tokens) == 1 and token == self.think[0][0]:  # type: ignore[index]
                self._matcher, self.thinking, self._pending_answer = None, True, True
                return False
            if token in self.eos:  # the turn ends here
                self._matcher = None
                return False
            return True
        self._free(token)
        return False

    def consumed(self, ok: bool) -> None:
        """The running matcher consumed the last token (`ok`), or rejected it: the grammar lets go. A token
        its own mask allowed is the grammar's failure (`_fail`); one it did not, another processor's forcing."""
        if not ok:
            token, mask = self._tokens[-1], self._mask
            if mask is not None and token < mask.size and mask[token]:
                self._fail()
            self.broken, self._matcher, self.engaged = True, None, None
        elif self._mode == "answer":
            self._measure(self._matcher.is_accepting())  # type: ignore[union-attr]
        elif self._matcher.is_stopped() and not self.ends_reply:  # type: ignore[union-attr]
            self._matcher = None  # the call is closed: free again (after an answer, only its end)

    def _fail(self) -> None:
        """The grammar failed on what it allowed (llguidance gave up within its limits): `failure` says so,
        and the decode stage ends the turn with it."""
        if self.failure is None:
            part, tool = self.parts[self._mode]
            what = {"answer": "the answer's schema", "tool": f"the parameters of {tool!r}"}.get(
                part, "the tools' parameters"
            )
            reason = guidance_error(self._matcher.get_error())  # type: ignore[union-attr]
            message = f"the grammar holding the reply to {what} failed at its token {len(self._tokens)} ({reason})"
            self.failure = GrammarError(f"{message}; {SIMPLER}", part, tool)
            self._active.gave_up(reason)  # type: ignore[union-attr]

    def _measure(self, accepting: bool) -> None:
        """How many tokens the last call (or answer) the answer's grammar holds took, from where it
        began to where the grammar accepted it."""
        if accepting and self._opened_at >= 0:
            self._span, self._opened_at = len(self._tokens) - self._opened_at, -1
        elif not accepting and self._opened_at < 0:
            self._opened_at = len(self._tokens) - 1

    @property
    def matcher(self) -> Any:
        """The running llguidance matcher (None while the reply is free)."""
        return self._matcher

    @property
    def fed(self) -> list[int]:
        """The generated tokens this processor has taken so far."""
        return self._tokens

    @property
    def vocab_size(self) -> int:
        """llguidance's vocabulary size (a bitmask row's width), of the running grammar."""
        return self._active.vocab_size  # type: ignore[union-attr]

    def _free(self, token: int) -> None:
        """A token of free decoding: a thought opening or closing, or a call's start marker."""
        if self.think is not None:
            start, end = self.think
            if self.thinking and _ends_with(self._tokens, end):
                self.thinking = False
                if self._pending_answer and self._answer is not None:
                    self._engage(self._answer, "answer")
                return
            if not self.thinking and _ends_with(self._tokens, start):
                self.thinking = True
                return
        if not self.thinking and self._calls is not None and _ends_with(self._tokens, self.start_ids):
            self._engage(self._calls, "calls")


def _masked(logits: mx.array, allowed: mx.array) -> mx.array:
    """`logits` outside `allowed` at minus infinity: one op on the device, no sync. The grammar is a
    turn's first processor: one after it that forces a token (the test kit's scripts) gives it a
    finite logit, so the forced token wins and the grammar lets go at it (a rejected token)."""
    import mlx.core as mx

    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))


def _ends_with(ids: list[int], marker: tuple[int, ...]) -> bool:
    return bool(marker) and tuple(ids[-len(marker) :]) == marker
