"""A real model: SmolLM2-135M-Instruct, 4-bit, imported from its Q4_1 GGUF by the project's importer.

Where random models hide bugs: a real 49k-token byte-level BPE tokenizer, a real chat template,
real quantized weights. It decodes a few tokens a second on a CPU: the tests are few and short.
Locally they skip when the registry cannot be reached; under CI they must run (see conftest).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.agents.compaction import CompactionSettings, compact, fallback_summary
from mlx_subagents.agents.session import AgentSession, workspace_for
from mlx_subagents.agents.spec import AgentSpec
from mlx_subagents.host import GenerateArgs, MlxModelHost
from mlx_subagents.host.calls.chat_format import prompted_tools
from mlx_subagents.host.calls.prompt import render
from mlx_subagents.host.mlx.loading import resolve_model_path
from mlx_subagents.models.catalog import list_models
from mlx_subagents.testing import ForcedScripts, tool_call_text
from mlx_subagents.tools import make_tools

pytestmark = [pytest.mark.model, pytest.mark.slow]

PARIS = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
TERSE = {"role": "system", "content": "You are terse."}
# Short prompts (23 and 27 tokens, the system turn shared), padded to one length in the batch: each prompt
# token costs a forward on the CPU (the Paris question with the default system prompt was 42).
QUESTIONS = [
    [TERSE, {"role": "user", "content": "Capital of France?"}],
    [TERSE, {"role": "user", "content": "What is 2 + 2?"}],
]


def test_import_through_ollama_makes_a_4bit_model_the_catalog_lists(
    smollm2_home: Path, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = json.loads((smollm2_path / "import.json").read_text())
    gguf = Path(record["gguf"])
    assert record["source"] == "ollama:smollm2:135m" and gguf.name.startswith("sha256-")
    assert (record["architecture"], record["tokenizer_pre"], record["pre_tokenizer_fixed"]) == ("llama", "smollm", True)
    assert not [p for p in smollm2_path.parent.iterdir() if p.name.startswith(".")]  # no staging left

    monkeypatch.setenv("MLX_SUBAGENTS_HOME", str(smollm2_home))
    assert resolve_model_path("smollm2") == smollm2_path
    [info] = list_models(default="smollm2")
    assert (info.name, info.source, info.default, info.model_type) == ("smollm2", "imported", True, "llama")
    assert info.parameters == record["parameters"] == 134_515_008  # the catalog's count is the GGUF's
    assert info.quantization == "4-bit (group 32)" and info.context_window == 8192
    assert info.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert info.tool_mode == "prompted"  # its ChatML template drops `tools`


def test_tokenizer_round_trips_and_splits_like_llama_cpp(smollm2_path: Path) -> None:
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(smollm2_path)
    for text in (
        "def load_config(path: str) -> dict:\n    return {}\n",
        "Café, naïve, Straße; 東京 🙂 — \t tabs\n\n",
        "cafe\u0301 (decomposed: no normalizer may compose it)",
        "x = [1, 22, 333]  # numbers",
    ):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    # llama.cpp's `smollm` splitting: digits alone first, then GPT-2's pattern, so the indentation
    # before a number is one token (gguf2mlx's fallback pattern split it as 11 spaces + 1).
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode("            0,\n", add_special_tokens=False)]
    assert pieces == [" " * 12, "0", ",", "\n"]
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(PARIS, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith(
        "<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n<|im_start|>assistant\n"
    )


async def answers(path: Path, batching: bool) -> list[tuple[str, tuple[int, ...]]]:
    async with MlxModelHost(str(path), batching=batching, kv_budget=0) as host:
        sessions = [host.session(f"q{i}") for i in range(len(QUESTIONS))]
        replies = await asyncio.gather(
            *(s.generate(q, GenerateArgs(max_tokens=8)) for s, q in zip(sessions, QUESTIONS))
        )
    return [(g.text, tuple(g.token_ids)) for g in replies]


def test_greedy_answers_paris_and_batched_equals_serialized(smollm2_path: Path) -> None:
    batched = asyncio.run(answers(smollm2_path, batching=True))
    serialized = asyncio.run(answers(smollm2_path, batching=False))
    assert "Paris" in batched[0][0]
    assert [ids for _, ids in batched] == [ids for _, ids in serialized]  # token-identical on 4-bit weights
    assert all(len(ids) > 1 for _, ids in batched)


def test_compaction_writes_a_real_summary(smollm2_path: Path) -> None:
    messages = [
        {"role": "system", "content": "You are a coding assistant."},
        {"role": "user", "content": "Find where the config is loaded."},
        {"role": "assistant", "content": "I will read config.py."},
        {"role": "user", "content": "config.py: load_config reads settings.toml."},
        {"role": "assistant", "content": "Next I check who calls it."},
        {"role": "user", "content": "cli.py calls load_config."},
    ]

    async def go() -> tuple[object, str]:
        async with MlxModelHost(str(smollm2_path), kv_budget=0) as host:
            result = await compact(
                messages,
                host.session("parent"),
                lambda ms: host.count_tokens(ms),
                CompactionSettings(reserve_tokens=64, keep_recent_tokens=16),
                max_tokens=12,  # the model's words, not a long summary: each token is a forward on the CPU
            )
        return result, fallback_summary(messages[2:5])

    result, fallback = asyncio.run(go())
    assert result.n_summarized >= 2 and result.usage.generated_tokens > 0
    assert result.summary and result.summary != fallback  # the model's words, not the fallback
    assert result.messages[:2] == messages[:2] and result.messages[-1] == messages[-1]
    assert result.summary in result.messages[2]["content"]


def test_prompted_tool_call_through_the_real_tokenizer_runs_and_the_agent_completes(
    smollm2_path: Path, tmp_path: Path
) -> None:
    from mlx_lm.utils import load_tokenizer

    (tmp_path / "config.py").write_text("CONFIG = {}\n")
    spec = AgentSpec(
        name="scout",
        description="finds",
        tools=("ls",),
        system_prompt="You find files.",
        source="builtin",
        path=tmp_path,
    )
    answer = "The config is in config.py."
    replies = {"scout": [tool_call_text("ls", {"path": "."}), answer]}
    scripts = ForcedScripts(load_tokenizer(smollm2_path), replies)
    schemas = [tool.schema() for tool in make_tools(("ls",), workspace_for(tmp_path)).values()]

    async def go() -> tuple[Any, list[Any], str, str]:
        async with MlxModelHost(str(smollm2_path), processor_factory=scripts, kv_budget=0) as host:
            session = AgentSession(spec, host, workspace_for(tmp_path))
            result = await session.run("where is the config?")
            shown, tools = host.chat.present(session.messages[:2], schemas)
            return (
                result,
                session.messages,
                render(host.tokenizer, shown, tools, generation_prompt=True),
                host.tool_mode,
            )

    result, messages, prompt, mode = asyncio.run(go())
    assert mode == "prompted" and prompt.count(prompted_tools(schemas)) == 1
    assert prompt.startswith("<|im_start|>system\nYou find files.")
    assert (result.status, result.output) == ("completed", answer)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2]["tool_calls"][0]["function"]["name"] == "ls"
    assert "config.py" in messages[3]["content"]  # the real ls ran in the workspace
