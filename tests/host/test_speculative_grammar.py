"""Drafts of grammar-held rows (issue 67, `host/mlx/drafted_grammar.py`): a draft walked through the row's
grammar is cut at the first token the grammar refuses, each verified position gets the mask a step would
have given it, and after the verdict the grammar (its llguidance matcher included) is where a grammar
that never drafted would be: the same next mask, the same tokens taken, the rest of the call accepted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlx_subagents.host.calls.constrainer import Constrainer
from mlx_subagents.host.calls.grammar import Grammars
from mlx_subagents.host.mlx.drafted_grammar import HeldDraft
from mlx_subagents.testing import tool_call_text
from tests.host.test_grammar import FIND, READ


def fed(grammars: Grammars, script: list[int], n: int) -> Constrainer:
    """A grammar for the find and read tools that took the first `n` tokens of `script` one at a time, as a
    row that never drafted (the tokens the host has read)."""
    grammar = grammars.processor([READ, FIND], None, False)
    assert grammar is not None
    grammar.known = script[:n]
    grammar.to_step()
    return grammar


def next_mask(grammar: Constrainer, vocab: int) -> np.ndarray | None:
    return grammar.allowed(vocab) if grammar.running else None


# The script's tokens (the tiny tokenizer's): 0-3 "Here it is.", 4 "<tool_call>", 5-26 the call's JSON
# ('"}}\n' at 26), 27 "</tool_call>", 28-29 " Done.".
@pytest.mark.parametrize(
    ("start", "length", "kept", "cut"),
    [(0, 2, 1, False), (0, 12, 8, True), (4, 6, 0, True), (8, 8, 5, True), (22, 7, 2, False), (26, 3, 1, False)],
    ids=["free-kept-free", "free-kept-in-the-call", "at-the-marker", "inside-the-call", "past-the-end", "at-the-end"],
)
def test_a_draft_walked_through_the_grammar_comes_back_to_a_grammar_that_never_drafted(
    tiny_qwen3: Any, start: int, length: int, kept: int, cut: bool
) -> None:
    """A draft of the call's own tokens from several places (free text into the call, its start marker,
    inside it, across its end), a wrong token after it: each position's mask allows the next token and
    is the mask the row would get one token at a time; inside the call the wrong token stops the draft.
    After the verdict keeps some of it (`settle`), the grammar's next mask and state are those of a
    grammar that took only the kept tokens (its matcher rolled back, a stopped one too), and it goes on
    to accept the rest of the call as that one does."""
    tokenizer = tiny_qwen3[1]
    vocab = len(tokenizer.vocab)
    grammars = Grammars(tokenizer, "json", "<tool_call>", "</tool_call>")
    text = "Here it is." + tool_call_text("read", {"path": "README.md"}) + " Done."
    script = tokenizer.encode(text, add_special_tokens=False)
    assert len(script) == 30 and tokenizer.decode(script[4:5]) == "<tool_call>"
    wrong = tokenizer.encode("}", add_special_tokens=False)[0]
    draft = script[start + 1 : start + 1 + length]
    grammar = fed(grammars, script, start)
    walked = HeldDraft(grammar, script[start], [*draft, wrong, *draft], vocab)
    assert (walked.draft == draft) == cut and walked.draft[: len(draft)] == draft
    for j, mask in enumerate(walked.masks[: len(draft) + 1]):
        alone = next_mask(fed(grammars, script, start + 1 + j), vocab)
        assert (mask is None) == (alone is None) and (mask is None or np.array_equal(mask, alone))
        assert j >= len(draft) or mask is None or mask[draft[j]]
    walked.settle(1 + kept)
    never = fed(grammars, script, start + 1 + kept)
    assert grammar.fed == never.fed == script[: start + 1 + kept]
    assert grammar.running == never.running and grammar.engaged == never.engaged
    for token in script[start + 1 + kept :]:  # the rest of the reply: the same mask before each token
        mask, alone = next_mask(grammar, vocab), next_mask(never, vocab)
        assert (mask is None) == (alone is None) and (mask is None or np.array_equal(mask, alone))
        assert mask is None or mask[token]
        grammar.take(token), never.take(token)
    assert grammar.engaged == "calls" and not grammar.broken and not grammar.running


@pytest.mark.parametrize(
    ("beside", "limit"), [(0, 64), (1, 64), (0, 33)], ids=["alone", "then-beside-a-short-session", "near-its-limit"]
)
def test_a_grammar_held_session_drafts_on_the_single_path_with_the_tokens_of_drafts_off(
    tiny_qwen3_path: Path, beside: int, limit: int
) -> None:
    """A session whose reply must be a call decodes alone (the single path, `DraftedStream` walking each
    draft through its grammar), or first beside a shorter session (into the batch, then back alone when
    that one ends), or with a limit that leaves room for one call only (the grammar ends the reply after
    it: `Constrainer._close`, its state walked and settled too): it drafts and keeps some of its drafts,
    and its reply is the valid call it is with drafts off, token for token."""
    import asyncio

    import jsonschema

    from mlx_subagents.host import GenerateArgs, MlxModelHost
    from tests.host.test_batching import task
    from tests.host.test_draft_costs import fix_costs
    from tests.host.test_grammar import TASK, TOOLS

    async def go(draft: str) -> list[Any]:
        async with MlxModelHost(str(tiny_qwen3_path), draft=draft) as host:
            fix_costs(host)
            args = GenerateArgs(max_tokens=limit, tool_choice="required")
            held = host.session("held").generate(TASK, args, tools=TOOLS)
            free = [host.session(f"s{i}").generate(task(i), GenerateArgs(max_tokens=12)) for i in range(beside)]
            return list(await asyncio.gather(held, *free))

    off, on = asyncio.run(go("off")), asyncio.run(go("lookup"))
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    reply = on[0]
    assert reply.usage.accepted_tokens > 0 and off[0].usage.drafted_tokens == 0
    assert reply.tool_calls and reply.constrained == "calls" and reply.malformed_tool_calls == []
    for call in reply.tool_calls:
        schema = next(t for t in TOOLS if t["function"]["name"] == call.name)["function"]["parameters"]
        jsonschema.validate(call.arguments, schema)


def test_a_grammar_held_row_is_masked_at_the_plain_steps_between_its_drafted_ones(
    tiny_qwen3_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every row's drafter proposes only every other time it is asked, so the batch's steps alternate
    between drafted steps (the held row's draft masked by its walk) and plain ones (masked by the batch's
    `MaskBatch` again): the held row's reply is the valid call of drafts off, token for token."""
    import asyncio

    from mlx_subagents.host import GenerateArgs, MlxModelHost
    from mlx_subagents.host.mlx.drafts import LookupDrafter
    from tests.host.test_batching import task
    from tests.host.test_draft_costs import fix_costs
    from tests.host.test_grammar import TASK, TOOLS

    lookup, asked = LookupDrafter.propose, {}

    def every_other(self: LookupDrafter, tokens: Any) -> list[int]:
        asked[id(self)] = asked.get(id(self), 0) + 1
        return lookup(self, tokens) if asked[id(self)] % 2 else []

    monkeypatch.setattr(LookupDrafter, "propose", every_other)

    async def go(draft: str) -> list[Any]:
        async with MlxModelHost(str(tiny_qwen3_path), draft=draft) as host:
            fix_costs(host)
            free = host.session("free").generate(task(0), GenerateArgs(max_tokens=64))
            held = host.session("held").generate(TASK, GenerateArgs(max_tokens=64, tool_choice="required"), tools=TOOLS)
            return list(await asyncio.gather(free, held))

    off, on = asyncio.run(go("off")), asyncio.run(go("lookup"))
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert on[1].usage.accepted_tokens > 0
    assert on[1].tool_calls and on[1].constrained == "calls" and on[1].malformed_tool_calls == []
