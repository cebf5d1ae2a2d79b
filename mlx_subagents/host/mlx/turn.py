"""A turn: one request for one reply, and everything the scheduler keeps of it on its way through
the host (waiting, prefilling, decoding, finished; `scheduler.py`), with where its outputs go."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..calls.grammar import Constrainer
from ..kv.kv_pool import CacheState
from ..protocol import Message, Reply, ToolSchema
from .drafted import DraftCounts, DraftedStream
from .drafts import LookupDrafter
from .prefill import PrefillGroup
from .single import SingleStream


@dataclass(frozen=True)
class TurnOutput:
    """What a turn's caller learns from a step (`Scheduler.step` returns them; the outbox hands them
    over): its prefill begun (`prefill`: the tokens it computes, those its cache holds), its new text
    (detokenized on the mlx thread, call markup and reasoning still in it) with the tokens generated so
    far, and at its end its reply (`reply`) or what it failed with (`error`)."""

    text: str = ""
    tokens: int = 0
    prefill: tuple[int, int] | None = None
    reply: Reply | None = None
    error: BaseException | None = None

    def then(self, later: TurnOutput) -> TurnOutput:
        """This output and a `later` one of the same turn, as one (the text of both, in order)."""
        return TurnOutput(
            self.text + later.text,
            later.tokens or self.tokens,
            self.prefill or later.prefill,
            later.reply or self.reply,
            later.error or self.error,
        )

    @property
    def ended(self) -> bool:
        return self.reply is not None or self.error is not None


@dataclass(frozen=True)
class OutputSink:
    """Where a turn's outputs go: `receive`, run on the caller's event loop (None: on the mlx thread, for
    a caller that steps the scheduler itself). `streams`: the caller reads its text as it comes and its
    prefill begun (else it learns only the end)."""

    loop: asyncio.AbstractEventLoop | None
    receive: Callable[[TurnOutput], None]
    streams: bool = True


@dataclass(frozen=True)
class Request:
    messages: list[Message]
    tools: list[ToolSchema] | None
    max_tokens: int
    temperature: float
    thinking: int | None = None  # a thinking model's budget (0: off); None: no thought to watch
    grammar_tools: list[ToolSchema] | None = None  # the tools each started call is constrained to
    answer_schema: dict[str, Any] | None = None  # the schema the answer is constrained to
    require_call: bool = False  # the reply must be calls to `grammar_tools`
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    seed: int | None = None
    store_prompt: bool = False  # its conversation is kept in the disk tier (`PrefillStage.store_prompt`)

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """What the template is rendered with: thinking off passes its switch."""
        return {"enable_thinking": False} if self.thinking == 0 else {}


@dataclass(eq=False)  # compared by identity: a turn holds caches, not values
class Turn:
    """A request for one reply on its way through the scheduler."""

    name: str
    state: CacheState
    request: Request
    cancel: threading.Event
    sink: OutputSink | None = None  # None: its outputs only in what `Scheduler.step` returns
    ids: list[int] = field(default_factory=list)
    text: str = ""
    max_tokens: int = 0
    cache: list[Any] | None = None
    n_cached: int = 0
    pos: int = 0
    stops: list[tuple[int, str]] = field(default_factory=list)  # (position, "prefix" | "snapshot")
    generated: list[int] = field(default_factory=list)
    detokenizer: Any = None
    uid: int | None = None
    prefix: list[int] = field(default_factory=list)  # system prompt + tools, shareable
    started: float = 0.0
    prompt_s: float = 0.0
    waited: bool = False
    error: Exception | None = None  # raised by this turn's own logits processor inside the batch
    sampler: Any = None
    processors: list[Any] = field(default_factory=list)
    grammar: Constrainer | None = None  # among the processors: what it held the reply to
    grammar_row: Any = None  # the grammar as its batch row's processor (for the row's first step)
    stream: SingleStream | DraftedStream | None = None  # decoding on the single path, outside the batch
    drafts: DraftCounts = field(default_factory=DraftCounts)  # its tokens drafted and kept (`drafted.py`)
    drafter: LookupDrafter = field(default_factory=LookupDrafter)  # its drafts, in the batch or alone
    streamed: bool = False  # its first text is out (or in the outbox)
    fed: int = 0  # how many of `generated` the detokenizer has had
    queued: bool = False  # in the scheduler's outbox: tokens not streamed yet
    group: PrefillGroup | None = None  # prefilled with others as one padded batch (its cache is the group's)
    fresh: bool = True  # no slice of its last prompt segment yet (it may still join a group)
    token_s: float = 0.0  # its last solo slice's seconds per token
    prefill_wait_s: float = 0.0  # time it spent while other turns' prompts were prefilled
    told: bool = False  # its sink was told its prefill began (`_tell_prefill`)
    shared: tuple[int, Any] | None = None  # the shared prefix its cache starts from: (tokens, prefix); None: not opened

    @property
    def final_length(self) -> int:
        return len(self.ids) + self.max_tokens

    def failed(self, exc: Exception) -> None:
        """Keep the first exception of this turn's own processors in the batch: it fails only this turn."""
        if self.error is None:
            self.error = exc
