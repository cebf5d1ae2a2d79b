"""One request of a chat endpoint as a turn of a host session, whichever API it came in.

Both APIs' requests become a `ChatTurn` (messages in the host's OpenAI-style shape, tools, sampling,
limits), run here as one `HostSession.generate` of the conversation the request goes on in
(`conversations.py`): in the same batch as the agents' sessions, under the same KV budget and
admission, with the same prefill slicing. What the turn does comes back as events, in order (the
host's own `PrefillBegun` once its prompt is admitted, `TextDelta` and `ReasoningDelta` as they are
decoded, then `Finished` with the reply), which each API writes in its own shape, streamed or whole.

Stop sequences are watched here, in the visible text as it streams (`AnswerText`): at the first one the
turn is cut (the host stops it at its next token and keeps its cache), and the text ends before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from ..agents.schema_output import check_schema
from ..errors import GrammarError, SubagentError
from ..host.protocol import (
    DEFAULT_THINKING_TOKENS,
    GenerateArgs,
    HostEvent,
    Message,
    ModelHost,
    PrefillBegun,
    ReasoningDelta,
    Reply,
    TextDelta,
    TokensSoFar,
    ToolSchema,
    Usage,
)
from ..recent import Recent
from .api_errors import ApiError, api_error
from .conversations import Conversation, Conversations

log = logging.getLogger("mlx_subagents.serve")
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
VALID_SCHEMAS = 1024  # distinct tool and answer schemas remembered as checked (`checked_schema`)
# Stop sequences a request may give, and their length: each is looked for in the text held back after
# every token the reply streams, on the event loop that answers every client (a million of them held a
# GET /v1/models 5.4 s). OpenAI takes 4; a local server's clients may send a few more.
MAX_STOPS = 16
MAX_STOP_CHARS = 1024
# A request whose last message is the assistant's (a prefill): the chat template renders it as a closed
# message and the reply as a new one, not as the continuation the client asked for, so it is refused.
PREFILL = (
    "the conversation ends with an assistant message, which this server does not continue (a prefill); "
    "end it with a user message or a tool result"
)


@dataclass(frozen=True)
class ChatTurn:
    """A chat request in the host's terms.

    Args:
        messages: OpenAI-style chat messages (`role`, `content`, `tool_calls` with dict arguments,
            `tool_call_id`, `reasoning_content`), what the host renders.
        tools: OpenAI-style function tools; None offers none.
        max_tokens: the most tokens the answer may have (None: what the window leaves).
        stop: strings that end the answer where they appear (not included).
        thinking: tokens a thinking model may think (0: off).
        answer_schema: the JSON schema an answer without a call must satisfy (held by the grammar).
        tool_choice: `auto`, `required` (the reply calls tools) or a tool's name (the reply calls it).
        schema_fields: where the request has each schema the grammar holds (`schema_fields`), which a
            refusal of the grammar's names.
    """

    model: str
    messages: list[Message]
    tools: list[ToolSchema] | None = None
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    thinking: int = DEFAULT_THINKING_TOKENS
    answer_schema: dict[str, Any] | None = None
    tool_choice: str = "auto"
    stream: bool = False
    schema_fields: dict[tuple[str, str | None], str] = field(default_factory=dict)


@dataclass(frozen=True)
class Finished:
    """The reply (its text cut before `stop_sequence` when one ended it) and the conversation's session."""

    reply: Reply
    session: str
    stop_sequence: str | None = None


# What a turn does, in order: its prefill begins (the prompt admitted), its text and reasoning stream (the
# host's own events), it ends.
Event = PrefillBegun | TextDelta | ReasoningDelta | Finished


class AnswerText:
    """The answer's visible text as it streams, as the whole answer has it: without the whitespace
    around it, and ended before the first stop sequence. What could still turn out to be the start of
    a stop sequence, or trailing whitespace, is held back until the text after it comes."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # everything passed on
        self._pending = ""
        self.hit: str | None = None  # the stop sequence that ended it

    def feed(self, piece: str) -> str:
        """What of `piece` can go out now ("" once a stop sequence appeared)."""
        if self.hit is not None:
            return ""
        pending = self._pending + piece
        if not self.text:
            pending = pending.lstrip()
        found = [(pending.find(s), s) for s in self.stops if s in pending]
        if found:
            at, self.hit = min(found)
            out, self._pending = pending[:at].rstrip(), ""
        else:
            cut = max(0, len(pending) - self.hold)
            out = pending[:cut].rstrip()
            self._pending = pending[len(out) :]
        self.text += out
        return out

    def flush(self) -> str:
        """What was held back, at the end of the answer."""
        out, self._pending = self._pending.rstrip(), ""
        self.text += out
        return out


class TurnRun:
    """One turn running on a conversation's session: `next()` gives what it does, in order, until
    `Finished`; `cancel()` ends it (its client went away) and frees its place in the batch at once."""

    def __init__(self, turn: ChatTurn, conversation: Conversation, conversations: Conversations) -> None:
        self.turn, self.conversation, self.conversations = turn, conversation, conversations
        self.stops = AnswerText(turn.stop)
        self.reasoning = ""  # streamed so far: a reply cut at a stop sequence keeps it
        self._queue: asyncio.Queue[Event | ApiError] = asyncio.Queue()
        self._stopped = asyncio.Event()  # a stop sequence appeared
        self._task = asyncio.ensure_future(self._run())

    async def next(self) -> Event:
        """The turn's next event; a failure is raised as its `ApiError`."""
        item = await self._queue.get()
        if isinstance(item, ApiError):
            raise item
        return item

    def cancel(self) -> None:
        self._task.cancel()

    async def _run(self) -> None:
        conv, turn, stops = self.conversation, self.turn, self.stops
        generating = asyncio.ensure_future(conv.session.generate(turn.messages, self._args(), tools=turn.tools))
        stopped = asyncio.ensure_future(self._stopped.wait())
        usage: Usage | None = None
        try:
            await asyncio.wait([generating, stopped], return_when=asyncio.FIRST_COMPLETED)
            if stops.hit is None:
                reply = generating.result()
                usage = reply.usage
                self._put(TextDelta(stops.flush()))
                self._put(Finished(reply, conv.name))
            else:  # the host ends the turn at its next token, keeping its cache
                usage = await _cut_short(generating, conv)
                self._put(Finished(Reply(stops.text, usage=usage, reasoning=self.reasoning), conv.name, stops.hit))
        except asyncio.CancelledError:
            usage = await _cut_short(generating, conv)
            raise
        except Exception as exc:
            error = schema_refusal(turn, exc) if isinstance(exc, GrammarError) else api_error(exc)
            if error.status >= 500:
                log.exception("a chat request failed on session %s", conv.name)
            self._queue.put_nowait(error)
        finally:
            stopped.cancel()
            self.conversations.release(conv, usage)

    def _args(self) -> GenerateArgs:
        turn, stops = self.turn, self.stops

        def on_event(event: HostEvent) -> None:
            match event:
                case TextDelta(text=piece):
                    self._put(TextDelta(stops.feed(piece)))
                    if stops.hit is not None:
                        self._stopped.set()
                case ReasoningDelta(text=piece):
                    self.reasoning += piece
                    self._put(event)
                case PrefillBegun():
                    self._put(event)
                case TokensSoFar(n=n):  # for --status while it runs
                    self.conversation.decoding = n

        return GenerateArgs(
            max_tokens=turn.max_tokens or 1 << 30,  # the host fits it to what the window leaves
            temperature=turn.temperature,
            top_p=turn.top_p,
            top_k=turn.top_k,
            seed=turn.seed,
            on_event=on_event,
            thinking=turn.thinking,
            answer_schema=turn.answer_schema,
            tool_choice=turn.tool_choice,
            store_prompt=True,  # a client may come back to it after a restart
            thought_in_max_tokens=True,  # both APIs count the thought in max_tokens
            client_schemas=True,  # checked under tighter limits before it is admitted
        )

    def _put(self, event: Event) -> None:
        if not isinstance(event, (TextDelta, ReasoningDelta)) or event.text:
            self._queue.put_nowait(event)


class Lenient(BaseModel):
    """A request's part: what a client sends and this server does not use is ignored, not refused."""

    model_config = ConfigDict(extra="ignore")


M = TypeVar("M", bound=BaseModel)


def validated(kind: type[M], body: dict[str, Any], reference: str) -> M:
    """`body` as a `kind`; the first thing wrong is one `ApiError` naming its field."""
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
        loc, message = errors[0]["loc"], errors[0]["msg"]
        # A union's members each fail, named after the field (`stop`, then `str` and `list[str]`): say them all.
        members = [e["loc"][len(loc) - 1] for e in errors if e["loc"][: len(loc) - 1] == loc[:-1]]
        if len(loc) > 1 and len(set(members)) > 1 and all(isinstance(m, str) for m in members):
            given = repr(errors[0]["input"])
            given = given if len(given) <= 60 else f"{given[:57]}..."
            loc, message = loc[:-1], f"{given} is none of the accepted forms ({', '.join(dict.fromkeys(members))})"
        where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".") or "body"
        raise ApiError(400, f"{where}: {message}; see the {reference} reference", where) from None


def visible_content(reply: Reply) -> str:
    """The reply's text, and any call markup the parser could not read: the client sees what was said."""
    return "\n".join([reply.text, *(bad.raw for bad in reply.malformed_tool_calls)]).strip()


def checked_schema(schema: Any, where: str) -> None:
    """`check_schema`, once per distinct schema: a client sends its tools again with every request (Claude
    Code a score of them), and checking one takes jsonschema milliseconds per turn. A schema that passed
    is remembered by its digest (`VALID_SCHEMAS` of them: a schema's text may be megabytes); one that did
    not is checked again, for its error naming `where`."""
    try:
        digest = hashlib.sha256(json.dumps(schema, sort_keys=True).encode()).digest()
    except (TypeError, ValueError, RecursionError):
        digest = None
    if digest is not None and _VALID.get(digest):
        return
    check_schema(schema, where)
    if digest is not None:
        _VALID.put(digest, True)


_VALID: Recent[bytes, bool] = Recent(VALID_SCHEMAS)  # the digests of schemas that passed


def function_tool(name: str, description: str | None, parameters: Any, where: str) -> ToolSchema:
    """A tool as the host takes it (OpenAI's function shape), its name and parameter schema checked:
    a schema that is not one is refused here, not decoded without a grammar."""
    if not TOOL_NAME.fullmatch(name):
        raise ApiError(400, f"{where}.name: {name!r} is not a tool name; use 1-64 letters, digits, _ or -", where)
    schema = {"type": "object", "properties": {}} if parameters is None else parameters
    try:
        checked_schema(schema, f"{where}: the parameters")
    except SubagentError as exc:
        raise ApiError(400, f"{exc}; send a JSON schema of an object", where) from None
    if schema.get("type", "object") != "object":
        raise ApiError(400, f"{where}: the parameters must be a schema of an object, not of {schema['type']!r}", where)
    function = {"name": name, "description": description or "", "parameters": schema}
    return {"type": "function", "function": function}


def named_once(tools: list[ToolSchema], name_at: str) -> list[ToolSchema]:
    """`tools`, each name given once (both APIs refuse two of one name: a call could not say which it
    means); `name_at` is where a tool's name is in the request, by its index (`tools[{}].name`)."""
    first: dict[str, int] = {}
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in first:
            where = name_at.format(i)
            message = f"{where}: {name!r} is the name of tools[{first[name]}] too; give each tool a name of its own"
            raise ApiError(400, message, where)
        first[name] = i
    return tools


def refuse_prefill(messages: list[Any]) -> None:
    """Refuse a conversation whose last message is the assistant's (`PREFILL`), in either API."""
    if messages and messages[-1].role == "assistant":
        where = f"messages[{len(messages) - 1}]"
        raise ApiError(400, f"{where}: {PREFILL}", where)


def stop_sequences(stops: list[str], where: str) -> tuple[str, ...]:
    """A request's stop sequences, at most `MAX_STOPS` of at most `MAX_STOP_CHARS` characters each."""
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"{where}: {len(stops):,} stop sequences; send at most {MAX_STOPS}", where)
    for i, stop in enumerate(stops):
        if len(stop) > MAX_STOP_CHARS:
            message = f"{where}[{i}]: a stop sequence of {len(stop):,} characters; send at most {MAX_STOP_CHARS:,}"
            raise ApiError(400, message, where)
    return tuple(stops)


def chosen_tool(choice: str, tools: list[ToolSchema] | None, where: str) -> str:
    """A `tool_choice` that forces a call (`required`, or a tool's name), checked against the tools."""
    names = [t["function"]["name"] for t in tools or []]
    if not names:
        raise ApiError(
            400, f"{where} asks for a call but the request has no tools; send tools, or tool_choice auto", where
        )
    if choice != "required" and choice not in names:
        raise ApiError(400, f"{where} names {choice!r}, which is not one of the tools ({', '.join(names)})", where)
    return choice


def schema_fields(tools: list[ToolSchema] | None, tool_at: str, answer_at: str) -> dict[tuple[str, str | None], str]:
    """Where a request has each schema the grammar holds: a tool's parameters (`tool_at`, by its index), the
    tools together, the answer's (`answer_at`), by `GrammarError.part` and tool."""
    fields: dict[tuple[str, str | None], str] = {("answer", None): answer_at, ("tools", None): "tools"}
    for i, tool in enumerate(tools or ()):
        fields["tool", tool["function"]["name"]] = tool_at.format(i)
    return fields


def schema_refusal(turn: ChatTurn, exc: GrammarError) -> ApiError:
    """The grammar's refusal of a request's schema (or its failure mid-reply), naming the field it is in."""
    where = turn.schema_fields.get((exc.part, exc.tool if exc.part == "tool" else None))
    return ApiError(400, f"{where}: {exc}" if where else str(exc), where)


def answer_schema(schema: Any, where: str) -> dict[str, Any]:
    """A JSON schema the answer is held to, checked."""
    try:
        checked_schema(schema, where)
    except SubagentError as exc:
        raise ApiError(400, f"{exc}; send a valid JSON schema", where) from None
    return schema


async def start_turn(host: ModelHost, turn: ChatTurn, conversations: Conversations, api: str, client: str) -> TurnRun:
    """The turn running on the conversation it goes on in (conversations over the limit closed first)."""
    conv, over = conversations.take(host, turn.model, api, client, turn.messages, turn.tools)
    for old in over:
        await old.session.close()
    return TurnRun(turn, conv, conversations)


async def _cut_short(generating: asyncio.Future[Reply], conv: Conversation) -> Usage:
    """Cancel the generation (if still running) and what it spent until it stopped."""
    if generating.done() and not generating.cancelled() and generating.exception() is None:
        return generating.result().usage
    generating.cancel()
    with contextlib.suppress(BaseException):
        await generating
    return conv.session.cut or Usage()


__all__ = [
    "ChatTurn",
    "Event",
    "Finished",
    "PrefillBegun",
    "ReasoningDelta",
    "AnswerText",
    "TextDelta",
    "TurnRun",
    "start_turn",
]
