"""A session's `generate` as the scheduler sees it, and what comes back: the turn's `Request` made
from the messages and `GenerateArgs`, the tools a `tool_choice` holds it to, and the receiver of the
turn's outputs on the caller's loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ...errors import SubagentError
from ..calls.call_schema import function_of
from ..calls.chat_format import ChatFormat
from ..protocol import GenerateArgs, Message, OnHostEvent, PrefillBegun, Reply, TextCallback, TokensSoFar, ToolSchema
from .turn import Request, TurnOutput


def make_request(
    chat: ChatFormat, tokenizer: Any, messages: list[Message], args: GenerateArgs, tools: list[ToolSchema] | None
) -> tuple[Request, bool]:
    """The turn's request, and whether its prompt opens a thought (a thinking model's generation
    prompt can): a thought, and its forced end marker, come on top of `max_tokens`, or within it
    (`thought_in_max_tokens`, its budget cut to leave the marker and one token of answer)."""
    budget = max(0, args.thinking) if chat.thinks else None
    max_tokens = args.max_tokens
    if budget is not None:
        marker = len(tokenizer.think_end_tokens)
        if args.thought_in_max_tokens:
            budget = min(budget, max(0, max_tokens - marker - 1))
        else:  # the thought, and its forced end marker, come on top of the reply limit
            max_tokens += budget + marker
    opened = chat.opened(budget) if budget is not None else False
    grammar = args.grammar and chat.grammar_kind is not None
    request = Request(
        *chat.present(messages, tools),
        max_tokens,
        args.temperature,
        budget,
        tools if grammar else None,
        args.answer_schema if grammar else None,
        top_p=args.top_p,
        # As many as the vocabulary or more keeps every token (mlx-lm's cut refuses it).
        top_k=args.top_k if args.top_k < tokenizer.vocab_size else 0,
        seed=args.seed,
        store_prompt=args.store_prompt,
        client_schemas=args.client_schemas,
    )
    if args.tool_choice != "auto" and tools:
        request = replace(request, grammar_tools=chosen_tools(tools, args.tool_choice, grammar), require_call=True)
    return request, opened


def chosen_tools(tools: list[ToolSchema], choice: str, grammar: bool) -> list[ToolSchema]:
    """The tools a reply must call (`tool_choice`: `required`, or a tool's name), held by the grammar."""
    if not grammar:
        raise SubagentError(
            f"tool_choice {choice!r} needs the grammar, which this model's call format or --grammar off leaves out; "
            "use tool_choice auto"
        )
    if choice == "required":
        return tools
    named = [t for t in tools if function_of(t)["name"] == choice]
    if not named:
        raise SubagentError(f"tool_choice names {choice!r}, which is not one of the tools; name one of them")
    return named


def receiver(
    future: asyncio.Future[Reply], visible: TextCallback | None, on_event: OnHostEvent | None
) -> Callable[[TurnOutput], None]:
    """A turn's outputs on the caller's loop: as host events (when it has `on_event`) its prefill begun,
    then each piece of new text (to `visible`, which splits off call markup and reasoning) and the
    tokens generated so far; at its end, its reply or error into `future`."""

    def receive(output: TurnOutput) -> None:
        if on_event is not None and output.prefill is not None:
            on_event(PrefillBegun(*output.prefill))
        if on_event is not None and visible is not None and output.text:
            visible(output.text)
            on_event(TokensSoFar(output.tokens))
        if output.ended and not future.done():
            future.set_result(output.reply) if output.error is None else future.set_exception(output.error)

    return receive
