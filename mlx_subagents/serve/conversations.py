"""The conversations of the chat endpoints: which host session a request goes on in.

A chat API is stateless: each request carries the whole conversation again. The host keeps a KV
cache per session and prefills only what a session's cache does not hold yet (the common prefix of
token ids, `HostSession`). So a request that goes on from an earlier one (the same tools, the earlier
request's messages, then the reply and what is new) is sent to that request's session: its second
turn prefills only the reply and the new message. Matched by content, as mlx_lm.server's prompt cache
and llama.cpp's slots do, here at the level of messages; the host does the rest, token by token. A
request that asks an earlier one again or edits its last messages goes on in the session of the
conversation it has the most messages in common with (at least the tools and two): the host keeps
the common part of its cache. A request that has no such conversation starts a session of its own,
which the host starts from a shared prefix (the system prompt and tools) where one is held.

A session serves one turn at a time: a request that would go on from a busy one starts its own. Idle
conversations are spilled and evicted by the KV pool as the agents' sessions are; past
`MAX_CONVERSATIONS`, the least recently used is closed.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

from ..host.protocol import HostSession, Message, ModelHost, ToolSchema, Usage
from ..runs.hosts import SessionNames

# Conversations kept at once (each a host session); the least recently used idle one goes first.
MAX_CONVERSATIONS = 32
# The least a request must have in common with an idle conversation it does not extend to go on in its
# session: the tools and two messages (a system prompt alone is the host's shared prefix already).
MIN_COMMON = 3


@dataclass
class Conversation:
    """One conversation of a client on a host session, and what its turns cost."""

    name: str  # the host session's: `conversation#N`, whichever API its requests come by
    api: str  # its last request's
    model: str
    client: str  # its last request's client's id
    session: HostSession
    key: list[str]  # the tools, then each message of its last answered request, as canonical JSON
    asked: list[str] = field(default_factory=list)  # the same of the request it answers now
    busy: bool = True
    turns: int = 0
    usage: Usage = field(default_factory=Usage)  # its last turn's
    generated_tokens: int = 0  # over all its ended turns
    decoding: int = 0  # generated so far by the turn running now (`TokensSoFar`)
    last_used: float = field(default_factory=time.time)

    def summary(self) -> dict[str, Any]:
        """Its line in `subagent serve --status --json`."""
        return {
            "client": self.client,
            "session": self.name,
            "api": self.api,
            "model": self.model,
            "status": "running" if self.busy else "idle",
            "turns": self.turns,
            "prompt_tokens": self.usage.prompt_tokens,
            "cached_tokens": self.usage.cached_tokens,
            "generated_tokens": self.generated_tokens + (self.decoding if self.busy else 0),
            "idle_s": 0.0 if self.busy else round(time.time() - self.last_used, 1),
        }


def common_length(a: list[str], b: list[str]) -> int:
    """How many leading entries two keys share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def content_key(messages: list[Message], tools: list[ToolSchema] | None) -> list[str]:
    """What a request's conversation is compared by: its tools, then its messages, as canonical JSON."""
    dump = lambda value: json.dumps(value, sort_keys=True, ensure_ascii=False)  # noqa: E731
    return [dump(tools or []), *(dump(m) for m in messages)]


class Conversations:
    """Every conversation of the endpoints, by host session name."""

    def __init__(self, names: SessionNames, max_conversations: int = MAX_CONVERSATIONS) -> None:
        self.names = names
        self.max_conversations = max_conversations
        self.all: dict[str, Conversation] = {}
        self._numbers = itertools.count(1)

    def take(
        self,
        host: ModelHost,
        model: str,
        api: str,
        client: str,
        messages: list[Message],
        tools: list[ToolSchema] | None,
    ) -> tuple[Conversation, list[Conversation]]:
        """The conversation this request goes on in, now busy: the idle one on `model` whose last
        request its messages extend (the longest); else the idle one that has the most of its messages
        in common, at least the tools and two messages (the same conversation with its last messages
        edited or asked again: its session keeps the common part and prefills the rest, as llama.cpp's
        slots do); else a new one. Also the idle conversations to close to stay within
        `max_conversations` (the caller closes their sessions)."""
        key = content_key(messages, tools)
        best: Conversation | None = None
        best_rank = (False, MIN_COMMON - 1)
        for conv in self.all.values():
            if conv.busy or conv.model != model:
                continue
            n = common_length(conv.key, key)
            rank = (n == len(conv.key) < len(key), n)  # extensions first, then the most in common
            if rank > best_rank:
                best, best_rank = conv, rank
        if best is None:
            # Not named for its API: a request of the other API may go on in it (the same messages).
            name = self.names.claim(f"conversation#{next(self._numbers)}")
            best = Conversation(name, api, model, client, host.session(name), [])
            self.all[name] = best
        best.busy, best.asked, best.client, best.api = True, key, client, api
        return best, self._over()

    def release(self, conv: Conversation, usage: Usage | None) -> None:
        """`conv`'s turn ended: answered or cut (`usage`: what it spent; the next request goes on from this
        one), or failed (None: the next goes on from the one before, whose cache the session still holds)."""
        conv.busy, conv.last_used, conv.decoding = False, time.time(), 0
        if usage is not None:
            conv.key = conv.asked
            conv.turns += 1
            conv.usage = usage
            conv.generated_tokens += usage.generated_tokens

    def _over(self) -> list[Conversation]:
        """The least recently used idle conversations past the limit, forgotten here."""
        idle = sorted((c for c in self.all.values() if not c.busy), key=lambda c: c.last_used)
        over = idle[: max(0, len(self.all) - self.max_conversations)]
        for conv in over:
            del self.all[conv.name]
            self.names.release(conv.name)
        return over

    def summaries(self) -> list[dict[str, Any]]:
        return [c.summary() for c in self.all.values()]


__all__ = ["MAX_CONVERSATIONS", "Conversation", "Conversations", "content_key"]
