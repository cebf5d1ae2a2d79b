"""Reasoning models on the real inference path: thinking kept apart, budgeted, and the cache kept across turns.

The tiny model's thinking template opens `<think>\n` in its generation prompt (as Qwen3.5's does), so each
forced script starts inside the thought.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import mlx_lm
import pytest

from mlx_subagents.agents import AgentSpec
from mlx_subagents.host.mlx_host import MlxModelHost
from mlx_subagents.session import AgentSession, Limits, workspace_for
from mlx_subagents.testing import ForcedScripts, tool_call_text

SYSTEM = "You find things in code."


def spec(tmp_path: Path, tools: tuple[str, ...] = ("ls", "write")) -> AgentSpec:
    return AgentSpec(
        name="scout", description="finds", tools=tools, system_prompt=SYSTEM, source="builtin", path=tmp_path
    )


class Recording(ForcedScripts):
    """ForcedScripts that also keeps each request's prompt ids."""

    def __init__(self, tokenizer: Any, scripts: dict[str, list[str]]) -> None:
        super().__init__(tokenizer, scripts)
        self.prompts: list[list[int]] = []

    def __call__(self, session_name: str, prompt_ids: Any) -> list[Any]:
        self.prompts.append(list(prompt_ids))
        return super().__call__(session_name, prompt_ids)


def test_think_call_think_answer_runs_the_tool_once_and_reuses_the_cache(
    tiny_thinking_path: Path, tmp_path: Path
) -> None:
    _, tokenizer = mlx_lm.load(str(tiny_thinking_path))
    (tmp_path / "a.txt").write_text("x\n")
    hidden = tool_call_text("write", {"path": "b.txt", "content": "no"})
    first = f"I could write {hidden} but no, list first.\n</think>\n\n" + tool_call_text("ls", {"path": "."})
    second = "The listing shows a.txt.\n</think>\n\nThe workspace holds a.txt."
    scripts = Recording(tokenizer, {"scout": [first, second]})
    events: list[Any] = []

    async def go() -> Any:
        async with MlxModelHost(str(tiny_thinking_path), processor_factory=scripts) as host:
            session = AgentSession(spec(tmp_path), host, workspace_for(tmp_path), on_event=events.append)
            return await session.run("what is here?"), session.messages

    result, messages = asyncio.run(go())
    assert (result.status, result.output) == ("completed", "The workspace holds a.txt.")
    assert result.reasoning == "The listing shows a.txt."
    assert not (tmp_path / "b.txt").exists()  # the call inside the thought was not run
    assert [e.data["name"] for e in events if e.kind == "tool_call"] == ["ls"]
    assert messages[2]["reasoning_content"] == f"I could write {hidden} but no, list first."
    assert messages[2]["content"] == "" and messages[2]["tool_calls"][0]["function"]["name"] == "ls"
    assert messages[4] == {
        "role": "assistant",
        "content": "The workspace holds a.txt.",
        "reasoning_content": "The listing shows a.txt.",
    }
    streamed = "".join(e.data["text"] for e in events if e.kind == "reasoning")
    assert streamed == f"I could write {hidden} but no, list first.\nThe listing shows a.txt.\n"
    # Turn two's prompt starts with everything turn one held (its prompt and reply, EOS included): only the
    # tool result and the new generation prompt are prefilled.
    held = len(scripts.prompts[0]) + len(tokenizer.encode(first, add_special_tokens=False)) + 1
    assert result.usage.cached_tokens == held
    assert (
        result.usage.input_tokens - result.usage.cached_tokens
        == len(scripts.prompts[0]) + len(scripts.prompts[1]) - held
    )


@pytest.mark.parametrize("batching", [True, False])
def test_a_thought_past_its_budget_is_closed_and_the_task_completes(
    batching: bool, tiny_thinking_path: Path, tmp_path: Path
) -> None:
    _, tokenizer = mlx_lm.load(str(tiny_thinking_path))
    thought = "the file may be in src or in tests or in docs and I should look at all of them first"
    scripts = Recording(tokenizer, {"scout": [f"{thought}\n</think>\n\nIt is in src."]})
    budget = 5

    async def go() -> Any:
        async with MlxModelHost(str(tiny_thinking_path), processor_factory=scripts, batching=batching) as host:
            session = AgentSession(spec(tmp_path), host, workspace_for(tmp_path), limits=Limits(thinking=budget))
            return await session.run("where?")

    result = asyncio.run(go())
    assert (result.status, result.output) == ("completed", "It is in src.")
    cut = tokenizer.decode(tokenizer.encode(thought, add_special_tokens=False)[:budget])
    assert result.reasoning == cut.strip()
    # five thought tokens, the forced </think>, then the answer's tokens after the script's own </think>, then EOS
    answer = tokenizer.encode("\n\nIt is in src.", add_special_tokens=False)
    assert result.usage.output_tokens == budget + 1 + len(answer) + 1


def test_thinking_off_renders_the_templates_switch(tiny_thinking_path: Path) -> None:
    _, tokenizer = mlx_lm.load(str(tiny_thinking_path))
    scripts = Recording(tokenizer, {"a": ["Hi.", "Hello."]})
    user = [{"role": "user", "content": "hello"}]

    async def go() -> Any:
        async with MlxModelHost(str(tiny_thinking_path), processor_factory=scripts) as host:
            off = await host.session("a").generate(user, thinking=0)
            on = await host.session("b").generate(user)
            return off, on

    off, _ = asyncio.run(go())
    assert (off.text, off.reasoning) == ("Hi.", "")
    assert tokenizer.decode(scripts.prompts[0]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tokenizer.decode(scripts.prompts[1]).endswith("<|im_start|>assistant\n<think>\n")
