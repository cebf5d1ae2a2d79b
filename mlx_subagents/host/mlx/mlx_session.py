"""`MlxSession`: one conversation on the resident model, with its own KV cache and the exact token ids
it holds. Its turns run on its host's mlx thread, in the scheduler (`request.py` makes each one's
request and receives its outputs); a fork takes its parent's state there before its first turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import replace
from typing import Any, Protocol

from ...deadlines import within
from ..calls.chat_format import ChatFormat
from ..kv.kv_pool import CacheState, KVPool
from ..protocol import GenerateArgs, Message, Reply, ToolSchema, Usage
from .drafted import DraftCounts
from .mlx_thread import Deliver, MlxThread
from .prompt_worker import PromptWorker
from .request import make_request, receiver
from .scheduler import Scheduler
from .turn import OutputSink, Turn

# How long a cancelled reply waits for the mlx thread to end its turn and say what it spent (one step).
CUT_WAIT_S = 5.0


class SessionHost(Protocol):
    """What a session reads of its host (`MlxModelHost`): the chat format and tokenizer its turns are
    made with, the worker that makes their prompts, the MlxThread and scheduler that run them, the KV
    pool and the host's sessions it leaves, and the drafts it counts."""

    chat: ChatFormat
    tokenizer: Any
    drafts: DraftCounts
    _mlx: MlxThread
    _scheduler: Scheduler
    _prompts: PromptWorker
    _pool: KVPool
    _sessions: dict[str, Any]

    @property
    def kv_bits(self) -> int: ...


class MlxSession:
    """A conversation on the host with its own KV cache (see `HostSession`).

    Cancelling `generate` stops the reply at its next token; a thinking model's thought (up to
    `GenerateArgs.thinking` tokens) comes on top of `max_tokens`, which bounds the answer.
    """

    def __init__(self, host: SessionHost, name: str, agent: str | None, fork_of: str = "") -> None:
        self._host = host
        self.name = name
        self.agent = agent
        self._state = CacheState()
        # A fork takes its parent's state now, on the mlx thread, ahead of any later turn of the
        # parent's (jobs run in order): its first turn awaits this.
        self._forking: asyncio.Future[Any] | None = None
        if fork_of:

            def start_fork(deliver: Deliver) -> None:
                host._scheduler.fork(self._state, fork_of)
                deliver(True, None)

            self._forking = host._mlx.submit(start_fork)
        self.cut: Usage | None = None
        # Its last reply as the template is given it (`ChatFormat.present`), for the next prompt's splice.
        self._given: Message | None = None

    @property
    def kv_bytes(self) -> int:
        return self._state.kv_bytes

    @property
    def kv_bits(self) -> int:
        """The host's KV cache setting, which every session of it has (16: not quantized)."""
        return self._host.kv_bits

    @property
    def held_tokens(self) -> int:
        """How many token ids the session's cache holds."""
        return len(self._state.token_ids)

    async def generate(
        self, messages: list[Message], args: GenerateArgs = GenerateArgs(), *, tools: list[ToolSchema] | None = None
    ) -> Reply:
        chat = self._host.chat
        request, opened = make_request(chat, self._host.tokenizer, messages, args, tools)
        request = replace(request, given=self._given)
        cancel, loop = threading.Event(), asyncio.get_running_loop()
        future: asyncio.Future[Reply] = loop.create_future()
        on_event = args.on_event
        visible = chat.visible_text(on_event, opened) if on_event is not None else None
        sink = OutputSink(loop, receiver(future, visible, on_event), streams=on_event is not None)

        self.cut = None
        if self._forking is not None:
            forking, self._forking = self._forking, None
            await forking
        turn = Turn(self.name, self._state, request, cancel, sink)
        if request.client_schemas:  # refused before it is admitted, off the mlx thread, if its grammar fails
            await asyncio.to_thread(self._host._scheduler.decode.processors.check, request)
        try:  # its prompt made off the mlx thread (`prompt_worker.py`), then queued there
            await self._host._prompts.submit(turn)
        except asyncio.CancelledError:
            cancel.set()  # queued all the same, it ends where it waits, having spent nothing
            raise
        try:
            reply = await asyncio.shield(future)
        except asyncio.CancelledError:
            cancel.set()  # the scheduler ends the turn at its next step and hands back what it spent
            with contextlib.suppress(Exception):
                self.cut = (await within(future, CUT_WAIT_S)).usage
            raise
        if visible is not None:
            visible.flush()
        drafts = self._host.drafts
        drafts.drafted, drafts.accepted = (
            drafts.drafted + reply.usage.drafted_tokens,
            drafts.accepted + reply.usage.accepted_tokens,
        )
        reasoning, text, calls, malformed = chat.split(reply.raw_text, tools, self._state.n_tool_calls, opened)
        self._state.n_tool_calls += len(calls)
        # An answer's grammar also allows calls: what it held the reply to is what the reply was.
        constrained = reply.constrained and ("calls" if calls else reply.constrained)
        given = replace(
            reply,
            text=text,
            tool_calls=calls,
            malformed_tool_calls=malformed,
            reasoning=reasoning,
            constrained=constrained or None,
        )
        self._given = chat.present([given.to_message()], None)[0][0]
        return given

    async def reset(self) -> None:
        """Forget the cache (the next turn prefills from scratch)."""
        self._given = None

        def drop() -> None:
            self._host._pool.forget(self.name)
            self._state.reset()

        await self._host._mlx.run(drop)

    async def close(self) -> None:
        await self.reset()
        self._host._sessions.pop(self.name, None)
