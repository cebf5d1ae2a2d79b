"""A reply as it streams, read off the host's events (`HostEvent`): its text and reasoning as the
agent's `text` and `reasoning` events (kept, for a reply a cut ends early), its prefill as a `prefill`
event, and its tokens so far as `decode` reports. The one reader of the host's events (`session.py`
makes one per reply).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..events import EventData, EventKind, PrefillData, ReasoningData, TextData
from ..host.protocol import HostEvent, PrefillBegun, ReasoningDelta, TextCallback, TextDelta, TokensSoFar

# A decoding reply's `decode` event: at its first token, then at most this often (seconds).
DECODE_EVERY_S = 1.0


@dataclass
class Streamed:
    """What a reply has streamed so far, read off the host's events (`HostEvent`): its text and
    reasoning (kept if a cut ends it early) as `text` and `reasoning` events and to `on_text`, its
    prefill as a `prefill` event, its tokens so far as `decode` reports (`Decoding`)."""

    emit: Callable[[EventKind, EventData], None]
    on_text: TextCallback | None
    decoding: Decoding
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)

    def __call__(self, event: HostEvent) -> None:
        match event:
            case TextDelta(text=piece):
                self.text.append(piece)
                self.emit("text", TextData(text=piece))
                if self.on_text is not None:
                    self.on_text(piece)
            case ReasoningDelta(text=piece):
                self.reasoning.append(piece)
                self.emit("reasoning", ReasoningData(text=piece))
            case PrefillBegun(tokens=tokens, cached=cached):
                self.emit("prefill", PrefillData(tokens=tokens, cached=cached))
            case TokensSoFar(n=n):
                self.decoding(n)


@dataclass
class Decoding:
    """Turns the host's running count of a reply's tokens into `decode` reports: at the first token,
    then at most every `DECODE_EVERY_S`, with the rate since the first."""

    report: Callable[[int, float], None]
    first: tuple[float, int] | None = None  # (when, tokens) at the first report
    reported: float = 0.0

    def __call__(self, tokens: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first, self.reported = (now, tokens), now
            self.report(tokens, 0.0)
        elif now - self.reported >= DECODE_EVERY_S:
            self.reported = now
            since, at = self.first
            self.report(tokens, round((tokens - at) / (now - since), 1))
