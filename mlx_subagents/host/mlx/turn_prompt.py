"""A turn's prompt, made before the turn reaches the mlx thread: its conversation rendered through the
chat template and tokenized (spliced onto the ids its session's cache holds where it goes on from the
session's last reply), the shareable prefix it starts with, where its reply opens (a hybrid model's
snapshot), how it renders for the next turn, and how much of it the disk tier stores.

Tokenizing a long conversation takes seconds (a 1 MiB prompt about 6 s of a CPU core): on the mlx
thread, every session's decoding would wait for it. So a session makes its turn's prompt in a worker
thread (`MlxSession.generate`), from what its cache held when it asked (`Basis`), and the scheduler
takes it at submit if the session still holds that (`TurnPrompt.fits`); else, and for a turn submitted
without one, it makes it there, with the same code (`PromptMaker`). Nothing here touches mlx: a
tokenizer's encode (which lets go of the GIL while it runs) and a chat template are safe on any thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..calls.prompt import (
    RenderState,
    build_prompt,
    common_prefix,
    encode,
    generation_prompt_length,
    longest_token,
    make_render_state,
    render,
    split_tokens,
)
from ..kv.kv_pool import CacheState
from ..kv.prefix_store import PrefixStore, StoredPrompt
from ..protocol import Message, ToolSchema
from .config import SchedulerConfig


class Request(Protocol):
    """What a prompt is made of: a turn's `Request` (`turn.py`), as read here."""

    messages: list[Message]
    tools: list[ToolSchema] | None
    store_prompt: bool
    given: Message | None

    @property
    def template_kwargs(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Basis:
    """What a session held when its turn's prompt was made: how its last turn rendered (None: nothing to
    splice onto), the ids its cache holds, whether it has a cache of its own (in memory or spilled: no
    shared prefix is looked for) and its conversation as last stored on disk."""

    render: RenderState | None
    held: list[int]
    own: bool
    stored: StoredPrompt | None

    @classmethod
    def of(cls, state: CacheState) -> Basis:
        """A read of `state`, made on any thread: the mlx thread checks at submit that it still holds."""
        own = state.prompt_cache is not None or state.spill_path is not None
        return cls(state.render, state.token_ids, own, state.stored)


@dataclass(frozen=True)
class StoredLength:
    """How much of a turn's conversation (its messages, rendered without the generation prompt: `text`)
    the disk tier stores: `n` tokens of its ids, which a new process tokenizes the same, and whether they
    are all of text's tokens (`whole`); `prior` is the session's stored conversation it goes on from
    (its file is replaced), found from `last`, what the session had stored when this was measured."""

    last: StoredPrompt | None
    prior: StoredPrompt | None
    n: int
    whole: bool
    text: str

    def holds_for(self, last: StoredPrompt | None) -> bool:
        """Whether this length is right for a session that has `last` stored now: the same it was
        measured against, or measured from the whole text (right whatever it goes on from)."""
        return last is self.last or self.prior is None


@dataclass(frozen=True)
class TurnPrompt:
    """A turn's prompt as made from its session's `basis`: its ids and text, whether the ids were spliced
    onto the held ids, the system prompt and tools' ids it starts with ([]: none; None: not looked for, the
    session had a cache of its own), how it renders for the next turn (`render`, as a reply that stopped), where a
    hybrid model's snapshot goes (`reply_at`: before the generation prompt; None: no snapshot) and its
    stored length (None: not stored)."""

    ids: list[int]
    text: str
    basis: Basis
    spliced: bool
    prefix: list[int] | None
    render: RenderState
    reply_at: int | None
    stored: StoredLength | None

    def fits(self, state: CacheState) -> bool:
        """Whether `state` still holds what the prompt was made from: the same last turn's rendering and,
        for ids spliced onto the held ids, those ids (else it is made again: correct, and reusing as
        much of the cache as without the race)."""
        basis = self.basis
        if state.render is not basis.render:
            return False
        return not self.spliced or state.token_ids is basis.held or state.token_ids == basis.held


class PromptMaker:
    """Makes turns' prompts for one host's scheduler (any thread: it reads only the tokenizer, the config
    and the store's names)."""

    def __init__(self, tokenizer: Any, config: SchedulerConfig, trimmable: bool, store: PrefixStore | None) -> None:
        self.tokenizer, self.config, self.store = tokenizer, config, store
        self._trimmable = trimmable
        # Characters per token a prompt can have at most, twice over (a normalizer may change a few).
        self._max_chars_per_token = 2 * longest_token(tokenizer)
        self._splits = split_tokens(tokenizer)  # the tokens the tokenizer always splits at

    def make(self, request: Request, basis: Basis) -> TurnPrompt:
        """The turn's prompt (`build_prompt`: a text too long for the context window is refused before it
        is tokenized) and what the stages read of it later, all tokenized here."""
        req = request
        ids, text, spliced = build_prompt(
            self.tokenizer,
            req.messages,
            req.tools,
            basis.render,
            basis.held,
            req.template_kwargs,
            max_chars=self._max_chars_per_token * self.config.context_window,
            given=req.given,
        )
        prefix = None if basis.own else (self.prefix_ids(req, ids) or [])
        reply_at = None
        if self.config.reuse and not self._trimmable:
            reply_at = len(ids) - generation_prompt_length(self.tokenizer, req.messages, req.tools, req.template_kwargs)
        stored = self.stored_length(req, ids, basis.stored) if self.stores(req) else None
        after = make_render_state(req.messages, req.tools, text, True)
        return TurnPrompt(ids, text, basis, spliced, prefix, after, reply_at, stored)

    def prefix_ids(self, request: Request, ids: list[int]) -> list[int] | None:
        """The tokens of the system prompt and tools, when the prompt starts with them."""
        messages = request.messages
        if not (self.config.reuse and self.config.share_prefix and messages and messages[0].get("role") == "system"):
            return None
        text = render(
            self.tokenizer,
            messages[:1],
            request.tools,
            generation_prompt=False,
            template_kwargs=request.template_kwargs,
        )
        prefix = encode(self.tokenizer, text)
        ok = 0 < len(prefix) < len(ids) - 1 and ids[: len(prefix)] == prefix
        return prefix if ok else None

    def stores(self, request: Request) -> bool:
        """Whether the turn's conversation goes to the disk tier (a recurrent layer's cannot)."""
        return request.store_prompt and self.store is not None and self._trimmable

    def prior(self, ids: list[int], last: StoredPrompt | None) -> StoredPrompt | None:
        """`last`, the session's stored conversation, if `ids` go on from it (its file is replaced)."""
        assert self.store is not None
        if last and last.n_tokens < len(ids) and self.store.path_for(ids[: last.n_tokens]) == last.path:
            return last
        return None

    def stored_length(self, request: Request, ids: list[int], last: StoredPrompt | None) -> StoredLength:
        """How many of `ids` a new process tokenizes the same from the turn's messages (up to the last one),
        and whether that is all of their tokens. Where the text goes on from `prior` (the session's stored
        conversation, which `ids` go on from) at a token the tokenizer always splits at (`split_tokens`),
        only the text after it is tokenized, and a stored conversation that stopped short (a reply
        tokenized otherwise than its text) stops there again without tokenizing anything."""
        prior = self.prior(ids, last)
        text = render(
            self.tokenizer,
            request.messages,
            request.tools,
            generation_prompt=False,
            template_kwargs=request.template_kwargs,
        )
        before = start = 0
        if (
            prior is not None
            and prior.text
            and text.startswith(prior.text)
            and text.startswith(self._splits, len(prior.text))
        ):
            if not prior.whole:
                return StoredLength(last, prior, prior.n_tokens, False, text)
            before, start = prior.n_tokens, len(prior.text)
        fresh = encode(self.tokenizer, text[start:])
        n = before + common_prefix(ids[before:], fresh)
        return StoredLength(last, prior, n, n == before + len(fresh), text)
