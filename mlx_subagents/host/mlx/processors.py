"""A turn's logits processors and sampler, made as it starts to decode (`DecodeStage.begin`): the
processor factory's (the test kit's forcing scripts), its grammar first of them (compiled once per host,
`calls/grammar.py`), the thought budget last; one sampler per setting, shared by every turn that has it;
its draws seeded where its request names a seed.
"""

from __future__ import annotations

import threading
from typing import Any

from ..calls.constrainer import Constrainer
from ..calls.grammar import Grammars
from ..calls.thinking import prompt_opens_thought, thought_budget
from ..protocol import ProcessorFactory
from .turn import Request, Turn


class Processors:
    """The host's grammars and samplers, and what each turn decodes with.

    Args:
        call_format: (grammar kind, start, end) of the model's calls, which a grammar needs.
    """

    def __init__(self, tokenizer: Any, call_format: tuple[Any, str, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.call_format = call_format
        self._grammars: Grammars | None = None  # made at the first request with a grammar
        self._lock = threading.Lock()  # making it: a client's grammar is checked off the mlx thread
        # One sampler per (temperature, top_p, top_k): mlx-lm samples the rows sharing one as one batch.
        self._samplers: dict[tuple[float, float, int], Any] = {}

    def make(self, turn: Turn, factory: ProcessorFactory | None) -> tuple[list[Any], Any, Constrainer | None]:
        """The processors a turn entering the decode stage decodes with (`factory`'s, its grammar before
        them, its thought budget after), its sampler and its grammar; its draws seeded from here where it
        asks. The decode stage writes them on the turn's decode state (no other module writes it)."""
        request = turn.request
        processors = factory(turn.name, turn.ids) if factory else []
        sampler = self.sampler(request.temperature, request.top_p, request.top_k)
        if request.seed is not None:
            import mlx.core as mx

            # Its draws follow from here (alone in the batch: exactly); any integer is a seed, mlx takes 64 bits.
            mx.random.seed(request.seed % 2**64)
        grammar = None
        if (request.grammar_tools or request.answer_schema is not None) and (grammar := self._grammar(turn)):
            grammar.known = turn.decode.generated  # type: ignore[union-attr]  # the tokens this loop has read: no sync
            grammar.limit = turn.max_tokens  # a call still open near it is closed
            processors = [grammar, *processors]
        if request.thinking is not None and (budget := thought_budget(self.tokenizer, request.thinking, turn.ids)):
            processors = [*processors, budget]  # last: closing the thought wins over other processors
        return processors, sampler, grammar

    def _grammar(self, turn: Turn) -> Constrainer | None:
        """The turn's grammar for its calls and answer: first of its processors (a processor after it that
        forces a token wins, and the grammar lets go there: no check on the device of what the others
        left), before the thought budget, so a thought is closed even mid-call."""
        request = turn.request
        opened = prompt_opens_thought(self.tokenizer, turn.ids)
        thinks = bool(request.thinking)  # None: not a thinking model; 0: thinking off
        return self.grammars().processor(
            request.grammar_tools,
            request.answer_schema,
            opened,
            thinks,
            require_call=request.require_call,
            client=request.client_schemas,
        )

    def check(self, request: Request) -> None:
        """Build and check a client's grammar before its turn is admitted, off the mlx thread (`Grammars.check`):
        what it cannot hold is refused there (`GrammarError`), and what it can is compiled for the turn."""
        if request.grammar_tools or request.answer_schema is not None:
            self.grammars().check(request.grammar_tools, request.answer_schema, request.require_call)

    def grammars(self) -> Grammars:
        """The host's grammars, made at the first request with one (from the mlx thread or a client's check)."""
        with self._lock:
            if self._grammars is None:
                assert self.call_format is not None, "a request with a grammar needs the host's call format"
                self._grammars = Grammars(self.tokenizer, *self.call_format)
            return self._grammars

    def sampler(self, temperature: float, top_p: float = 1.0, top_k: int = 0) -> Any:
        """The sampler of `temperature`, `top_p` and `top_k`, one object for every turn that has them: mlx-lm
        samples a batch whose rows share one sampler with one call, and row by row otherwise."""
        sampled = temperature > 0  # greedy: top_p and top_k change nothing
        key = (temperature, top_p if sampled else 1.0, max(0, top_k) if sampled else 0)
        if key not in self._samplers:
            from mlx_lm.sample_utils import make_sampler

            self._samplers[key] = make_sampler(temp=key[0], top_p=key[1] if key[1] < 1 else 0.0, top_k=key[2])
        return self._samplers[key]
