"""A turn: one request for one reply on its way through the scheduler's stages (`scheduler.py`): what
its caller asked, which never changes, one state per stage that only that stage writes, and what a
step hands its caller (`TurnOutput`, through its `OutputSink`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..calls.constrainer import Constrainer
from ..kv.kv_pool import CacheState
from ..protocol import Message, Reply, ToolSchema
from .drafted import DraftCounts, DraftedStream
from .drafts import LookupDrafter
from .prefill import PrefillState
from .single import SingleStream
from .turn_prompt import TurnPrompt


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
    client_schemas: bool = False  # its schemas are a client's: checked before admission (`Processors.check`)
    given: Message | None = None  # the session's last reply as presented: one sent back edited is not spliced

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """What the template is rendered with: thinking off passes its switch."""
        return {"enable_thinking": False} if self.thinking == 0 else {}


@dataclass(eq=False)
class DecodeState:
    """A turn's part that the decode stage writes (`decode_stage.py`, and its single path's streams),
    from its handover by the prefill stage on; after its end, a record for its reply."""

    cache: list[Any] | None  # its cache on the single path (None in the batch, which holds it)
    shared: tuple[int, Any] | None = None  # the shared prefix its cache starts from (admission counts it)
    generated: list[int] = field(default_factory=list)
    uid: int | None = None  # its row in the batch
    prompt_s: float = 0.0  # from its admission to its first token
    wait_s: float = 0.0  # time it spent while other turns' prompts were prefilled
    error: Exception | None = None  # raised by this turn's own logits processor inside the batch
    sampler: Any = None
    processors: list[Any] = field(default_factory=list)
    grammar: Constrainer | None = None  # among the processors: what it held the reply to
    grammar_row: Any = None  # the grammar as its batch row's processor (for the row's first step)
    stream: SingleStream | DraftedStream | None = None  # decoding on the single path, outside the batch
    drafts: DraftCounts = field(default_factory=DraftCounts)  # its tokens drafted and kept (`drafted.py`)
    drafter: LookupDrafter = field(default_factory=LookupDrafter)  # its drafts, in the batch or alone

    def failed(self, exc: Exception) -> None:
        """Keep the first exception of this turn's own processors in the batch: it fails only this turn."""
        if self.error is None:
            self.error = exc


@dataclass(eq=False)
class OutboxState:
    """A turn's part that the outbox writes (`outbox.py`): how much of its text went out."""

    detokenizer: Any = None  # made at its first token, when its caller reads text
    streamed: bool = False  # its first words are out (or in the outbox): text past any leading whitespace
    fed: int = 0  # how many of its generated tokens the detokenizer has had
    queued: bool = False  # in the outbox: tokens not streamed yet
    told: bool = False  # its caller was told its prefill began


@dataclass(eq=False)  # compared by identity: a turn holds caches, not values
class Turn:
    """A request for one reply on its way through the scheduler's stages. What the caller asked
    (`request`, `cancel`, `sink`) and its prompt (`prompt`, as its caller made it off the mlx thread or
    the scheduler at submit; `ids`, `text`, `max_tokens`, set once when it is submitted) never change; each stage writes only its own part: the waiting stage (the scheduler
    and admission) `prefix` and `waited`, the prefill stage `prefill`, the decode stage `decode`, the
    outbox `out`. A waiting turn has neither a prefill nor a decode state; a prefilling one a prefill
    state only; a decoding one its decode state, the prefill state then a record."""

    name: str
    state: CacheState  # the session's cache, which the turn continues and leaves its own in
    request: Request
    cancel: threading.Event
    sink: OutputSink | None = None  # None: its outputs only in what `Scheduler.step` returns
    prompt: TurnPrompt | None = None  # made before submit (off the mlx thread), or at submit
    ids: list[int] = field(default_factory=list)
    text: str = ""
    max_tokens: int = 0
    prefix: list[int] = field(default_factory=list)  # system prompt + tools, shareable
    waited: bool = False
    prefill: PrefillState | None = None
    decode: DecodeState | None = None
    out: OutboxState = field(default_factory=OutboxState)

    @property
    def final_length(self) -> int:
        return len(self.ids) + self.max_tokens

    @property
    def generated(self) -> list[int]:
        """Its tokens so far (none before it decodes)."""
        return self.decode.generated if self.decode is not None else []

    @property
    def shared(self) -> tuple[int, Any] | None:
        """The shared prefix its cache starts from, as its stage holds it (None: not opened)."""
        if self.decode is not None:
            return self.decode.shared
        return self.prefill.shared if self.prefill is not None else None
