"""Reasoning models on the real inference path: thinking kept apart, budgeted, and the cache kept across turns.

The tiny model's thinking template opens `<think>\n` in its generation prompt (as Qwen3.5's does), so each
forced script starts inside the thought.
"""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import mlx_lm
import pytest

from mlx_subagents.agents.limits import Limits
from mlx_subagents.agents.session import ANSWER_NOW, AgentSession, workspace_for
from mlx_subagents.agents.spec import AgentSpec
from mlx_subagents.host.mlx.mlx_host import MlxModelHost
from mlx_subagents.host.protocol import GenerateArgs
from mlx_subagents.host.scripted import ScriptedHost
from mlx_subagents.runs.transcripts import read_transcript
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


@pytest.mark.slow
def test_thinking_off_renders_the_templates_switch(tiny_thinking_path: Path) -> None:
    _, tokenizer = mlx_lm.load(str(tiny_thinking_path))
    scripts = Recording(tokenizer, {"a": ["Hi."], "b": ["Hello."]})  # b forced too: a random model's free reply is long
    user = [{"role": "user", "content": "hello"}]

    async def go() -> Any:
        async with MlxModelHost(str(tiny_thinking_path), processor_factory=scripts) as host:
            off = await host.session("a").generate(user, GenerateArgs(thinking=0))
            on = await host.session("b").generate(user)
            return off, on

    off, _ = asyncio.run(go())
    assert (off.text, off.reasoning) == ("Hi.", "")
    assert tokenizer.decode(scripts.prompts[0]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tokenizer.decode(scripts.prompts[1]).endswith("<|im_start|>assistant\n<think>\n")


def test_token_counts_render_the_prompt_as_the_turn_does(tiny_thinking_path: Path) -> None:
    _, tokenizer = mlx_lm.load(str(tiny_thinking_path))
    scripts = Recording(tokenizer, {"off": ["Hi."], "on": ["Hello."]})
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]

    async def go() -> list[int]:
        async with MlxModelHost(str(tiny_thinking_path), processor_factory=scripts) as host:
            await host.session("off").generate(messages, GenerateArgs(thinking=0))
            await host.session("on").generate(messages, GenerateArgs(thinking=512))
            return [await host.count_tokens(messages, thinking=0), await host.count_tokens(messages, thinking=512)]

    counts = asyncio.run(go())
    assert counts == [len(scripts.prompts[0]), len(scripts.prompts[1])]
    assert counts[0] != counts[1]  # thinking off renders the template's switch: a different prompt


# --- without a model: scripted replies carry `reasoning` ------------------------------------------------


def scripted_run(tmp_path: Path, replies: list[Any], **limits: Any) -> tuple[Any, list[Any]]:
    host = ScriptedHost.from_replies(replies)
    events: list[Any] = []
    session = AgentSession(
        spec(tmp_path, ("ls",)), host, workspace_for(tmp_path), limits=Limits(**limits), on_event=events.append
    )
    return asyncio.run(session.run("what is here?")), events


LS = {"name": "ls", "arguments": {"path": "."}}


def test_the_same_call_a_third_time_is_not_run_and_the_model_is_told(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x")
    result, events = scripted_run(tmp_path, [{"tool_calls": [LS]}] * 4 + ["a.txt is here."])
    assert (result.status, result.output) == ("completed", "a.txt is here.")
    results = [e.data for e in events if e.kind == "tool_result"]
    assert [r["is_error"] for r in results] == [False, False, True, True]
    assert results[2]["output"] == (
        "Error: you are repeating yourself: this is call number 3 in a row of ls with these same arguments, "
        "and it was not run again. Do something else, or give your final answer. "
        "What the call returned the first time:\n" + results[0]["output"]
    )
    assert "a.txt" in results[0]["output"]


def test_the_fifth_same_call_in_a_row_ends_the_task(tmp_path: Path) -> None:
    other = {"name": "ls", "arguments": {"path": "./."}}
    replies = [{"tool_calls": [LS]}, {"tool_calls": [other]}] + [{"tool_calls": [LS]}] * 5 + ["never"]
    result, _ = scripted_run(tmp_path, replies)
    assert (result.status, result.stop_reason) == ("failed", "repetition")
    assert result.error == "the model called ls with the same arguments 5 times in a row"
    assert result.usage.turns == 7  # the call in between reset the count


def test_an_answer_of_reasoning_alone_is_sent_back_once(tmp_path: Path) -> None:
    host_replies = [{"reasoning": "Thinking it over."}, {"reasoning": "Now then.", "content": "It is a.txt."}]
    result, _ = scripted_run(tmp_path, host_replies)
    assert (result.status, result.output, result.reasoning) == ("completed", "It is a.txt.", "Now then.")

    result, _ = scripted_run(tmp_path, [{"reasoning": "Hmm."}, {"reasoning": "Hmm again."}])
    assert (result.status, result.stop_reason, result.output) == ("failed", "empty_answer", "")
    assert result.error == "the model's reply held only reasoning, twice; no answer was given"


def test_the_answer_sent_back_after_reasoning_alone_asks_for_the_answer(tmp_path: Path) -> None:
    host = ScriptedHost.from_replies([{"reasoning": "Thinking it over."}, "Done."])
    session = AgentSession(spec(tmp_path, ("ls",)), host, workspace_for(tmp_path))
    asyncio.run(session.run("go"))
    sent = host.history["scout"][1]
    assert sent[-2] == {"role": "assistant", "content": "", "reasoning_content": "Thinking it over."}
    assert sent[-1] == {"role": "user", "content": ANSWER_NOW}


def test_run_json_keeps_reasoning_in_its_own_field(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    model = write_script([{"reasoning": "The list shows it.", "content": "It is in a.py."}])
    code, out, err = run_cli("run", "scout", "where?", "-m", model, "-C", str(tmp_path), "--json")
    data = json.loads(out)
    assert code == 0, err
    assert (data["output"], data["reasoning"]) == ("It is in a.py.", "The list shows it.")


def test_run_events_stream_reasoning_deltas(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    model = write_script([{"reasoning": "The list shows it.", "content": "It is in a.py."}])
    code, out, err = run_cli("run", "scout", "where?", "-m", model, "-C", str(tmp_path), "--events")
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert code == 0, err
    assert [e["data"]["text"] for e in events if e["kind"] == "reasoning"] == ["The list shows it."]
    assert [e["data"]["text"] for e in events if e["kind"] == "message"] == ["It is in a.py."]


def test_parallel_and_chain_see_only_the_visible_text(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    model = write_script(
        {
            "agents": {
                "scout": {"replies": [{"reasoning": "secret thought", "content": "src/auth.py"}]},
                "reviewer": {"replies": [{"reasoning": "another thought", "content": "fine"}]},
            }
        }
    )
    code, out, err = run_cli(
        "chain",
        "-s",
        "scout",
        "find auth",
        "-s",
        "reviewer",
        "review {previous}",
        "-m",
        model,
        "-C",
        str(tmp_path),
        "--json",
    )
    assert code == 0, err
    scout, reviewer = json.loads(out)["results"]
    assert (scout["output"], scout["reasoning"]) == ("src/auth.py", "secret thought")
    assert reviewer["task"] == "review src/auth.py"
    code, out, err = run_cli(
        "parallel", "-t", "scout", "a", "-t", "reviewer", "b", "-m", model, "-C", str(tmp_path), "--json"
    )
    assert code == 0, err
    assert [(r["output"], r["reasoning"]) for r in json.loads(out)["results"]] == [
        ("src/auth.py", "secret thought"),
        ("fine", "another thought"),
    ]


def test_schema_and_delegation_see_only_the_visible_text(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "required": ["files"]}')
    answer = {"reasoning": "not JSON {at all", "content": '{"files": ["a.py"]}'}
    model = write_script([answer])
    code, out, err = run_cli("run", "scout", "a", "-m", model, "-C", str(tmp_path), "--schema", str(schema), "--json")
    assert code == 0, err
    assert json.loads(out)["parsed"] == {"files": ["a.py"]}

    delegate = {"tool_calls": [{"name": "subagent", "arguments": {"agent": "scout", "task": "look"}}]}
    model = write_script(
        {
            "agents": {
                "orchestrator": {"replies": [delegate, "done"]},
                "scout": {"replies": [{"reasoning": "child's thought", "content": "child's answer"}]},
            }
        },
        name="parent.json",
    )
    code, out, err = run_cli("run", "orchestrator", "help", "-m", model, "-C", str(tmp_path), "--json")
    assert code == 0, err
    transcript = read_transcript(Path(json.loads(out)["transcript"]))
    [result] = [m["content"] for m in transcript.messages if m["role"] == "tool"]
    assert result.startswith("child's answer") and "child's thought" not in result


def test_the_chat_folds_the_reasoning_and_think_shows_it(
    tmp_path: Path, write_script: Any, run_cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = write_script({"agents": {"orchestrator": {"replies": [{"reasoning": "I thought.", "content": "answer"}]}}})
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/think\n/exit\n"))
    code, out, err = run_cli("chat", "-m", model, "-C", str(tmp_path))
    assert code == 0, err
    assert out.split("\n")[:2] == ["> answer", "> I thought."]
    assert "(thought: 10 characters; /think shows it)" in err


def test_show_prints_the_reasoning_apart(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    model = write_script([{"reasoning": "The list shows it.", "content": "It is in a.py."}])
    assert run_cli("run", "scout", "where?", "-m", model, "-C", str(tmp_path))[0] == 0
    code, out, _ = run_cli("show", "last")
    assert code == 0
    lines = out.splitlines()
    at = lines.index("thinking: The list shows it.")
    assert lines[at + 1] == "assistant: It is in a.py."
