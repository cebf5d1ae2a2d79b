"""The test kit itself: tiny models load through real mlx-lm, and forcing drives real decoding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
)
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tool_parsers import json_tools

import mlx_subagents
from mlx_subagents.testing import (
    TEMPLATES,
    ForcedPrefix,
    ForcedProcessor,
    ForcedScripts,
    Script,
    make_forced_processor,
    make_tiny_model,
    tool_call_text,
)
from tests.helpers import unevaluated

IM_END = 1538
ADDED_IDS = {
    "<|endoftext|>": 1536,
    "<|im_start|>": 1537,
    "<|im_end|>": 1538,
    "<tool_call>": 1539,
    "</tool_call>": 1540,
    "<tool_response>": 1541,
    "</tool_response>": 1542,
    "<think>": 1543,
    "</think>": 1544,
}
LS_TOOL = {
    "type": "function",
    "function": {
        "name": "ls",
        "description": "List a directory.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
    },
}
REPLY = "Found 2 files: src/app.py and tests/test_app.py."
USER = [{"role": "user", "content": "List the files."}]


@pytest.fixture(params=["qwen3", "qwen35"])
def tiny(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    """Both tiny models, for behaviour that must hold on dense and hybrid caches alike."""
    return request.getfixturevalue(f"tiny_{request.param}")


def prompt_ids(tokenizer: Any, messages: list[dict[str, Any]] = USER) -> list[int]:
    return tokenizer.apply_chat_template(messages, tools=[LS_TOOL], add_generation_prompt=True)


def forced_generate(model: Any, tokenizer: Any, prompt: list[int], script: Script, **kwargs: Any) -> list[int]:
    """`generate_step` (greedy unless a sampler is given) with a forced script; returns the
    tokens up to and including EOS."""
    processor = make_forced_processor(tokenizer, script)
    out: list[int] = []
    steps = generate_step(mx.array(prompt), model, logits_processors=[processor], max_tokens=200, **kwargs)
    for token, _ in steps:
        out.append(int(token))
        if token in tokenizer.eos_token_ids:
            break
    return out


def test_folder_contents_and_configs(tiny_qwen3_path: Path, tiny_qwen35_path: Path) -> None:
    for path in (tiny_qwen3_path, tiny_qwen35_path):
        names = sorted(p.name for p in path.iterdir())
        assert names == [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    dense = json.loads((tiny_qwen3_path / "config.json").read_text())
    assert (dense["model_type"], dense["vocab_size"]) == ("qwen3", 1545)
    assert dense["eos_token_id"] == IM_END
    assert dense["max_position_embeddings"] == 4096
    hybrid = json.loads((tiny_qwen35_path / "config.json").read_text())
    assert hybrid["model_type"] == "qwen3_5"
    assert hybrid["text_config"]["max_position_embeddings"] == 4096
    assert hybrid["text_config"]["full_attention_interval"] == 2


def test_loads_through_mlx_lm(tiny_qwen3: tuple[Any, Any], tiny_qwen35: tuple[Any, Any]) -> None:
    sizes = []
    for model, tokenizer in (tiny_qwen3, tiny_qwen35):
        assert isinstance(tokenizer, TokenizerWrapper)
        assert tokenizer.has_tool_calling
        assert tokenizer.tool_parser is json_tools.parse_tool_call
        assert tokenizer.tool_call_start == "<tool_call>"
        assert tokenizer.tool_call_end == "</tool_call>"
        assert tokenizer.eos_token_ids == {IM_END}
        assert tokenizer.eos_token_id == IM_END
        params = tree_flatten(model.parameters())
        assert {v.dtype for _, v in params} == {mx.float32}
        sizes.append(sum(v.size for _, v in params))
    assert sizes == [172_992, 265_456]


def test_logits_are_not_degenerate(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    logits = model(mx.array([prompt_ids(tokenizer)]))[0, -1]
    assert logits.shape == (1545,)
    assert 0.3 < logits.std().item() < 10.0


def test_build_is_deterministic(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", "qwen3_5", seed=7)
    b = make_tiny_model(tmp_path / "b", "qwen3_5", seed=7)
    c = make_tiny_model(tmp_path / "c", "qwen3_5", seed=8)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_context_window_and_arch_validation(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m", "qwen3", context_window=1024)
    assert json.loads((path / "config.json").read_text())["max_position_embeddings"] == 1024
    with pytest.raises(ValueError, match="arch must be one of"):
        make_tiny_model(tmp_path / "bad", "llama")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="template must be one of"):
        make_tiny_model(tmp_path / "bad", template="gemma")  # type: ignore[arg-type]


def test_template_variants(tmp_path: Path) -> None:
    """Each variant writes its own template (or none); the default is the Qwen tools template."""
    configs = {}
    for template in TEMPLATES:
        folder = make_tiny_model(tmp_path / template, template=template)
        configs[template] = json.loads((folder / "tokenizer_config.json").read_text())
    assert "{%- if tools %}" in configs["tools"]["chat_template"]
    assert "'<tool_call>\\n<function=' + tool_call.name" in configs["coder"]["chat_template"]
    assert "tool" not in configs["no_tools"]["chat_template"].split("-#}", 1)[1]  # past its comment
    assert "raise_exception('System role not supported')" in configs["strict"]["chat_template"]
    assert "chat_template" not in configs["none"]
    default = json.loads((make_tiny_model(tmp_path / "default") / "tokenizer_config.json").read_text())
    assert default == configs["tools"]


@pytest.mark.parametrize(
    "text",
    [
        'def main(args):\n    return {"path": "src/app.py", "n": 42}\n',
        "  leading and trailing  \n\n\t",
        "café, naïve, 日本語, emoji 🙂 and a\u00a0nbsp",
        '<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>',
        "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n",
        "",
    ],
)
def test_tokenizer_round_trips(tiny_qwen3: tuple[Any, Any], tiny_qwen35: tuple[Any, Any], text: str) -> None:
    """Byte-level BPE round-trips any NFC text; both archs tokenize alike."""
    ids = tiny_qwen3[1].encode(text, add_special_tokens=False)
    assert tiny_qwen3[1].decode(ids) == text
    assert tiny_qwen35[1].encode(text, add_special_tokens=False) == ids


def test_added_tokens_are_single_ids(tiny: tuple[Any, Any]) -> None:
    _, tokenizer = tiny
    for text, token_id in ADDED_IDS.items():
        assert tokenizer.encode(text, add_special_tokens=False) == [token_id]
    text = "<|im_start|>assistant\n<tool_call>x</tool_call><|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    # Control tokens are special (hidden); the markup tokens survive skip_special_tokens.
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<tool_call>x</tool_call>"


def test_agent_text_is_compact(tiny_qwen3: tuple[Any, Any]) -> None:
    tokenizer = tiny_qwen3[1]
    assert len(tokenizer.encode(tool_call_text("read", {"path": "src/app.py"}))) == 20
    assert len(tokenizer.encode(REPLY)) == 17


def test_chat_template_renders_tools_and_calls(tiny: tuple[Any, Any]) -> None:
    _, tokenizer = tiny
    messages = [
        {"role": "system", "content": "You are a scout."},
        *USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "ls", "arguments": {"path": "."}}}],
        },
        {"role": "tool", "content": "a.py\nb.py"},
        {"role": "assistant", "content": "Two files."},
    ]
    text = tokenizer.apply_chat_template(messages, tools=[LS_TOOL], add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a scout.\n\n# Tools\n\nYou may call one or more functions to "
        "assist with the user query.\n\nYou are provided with function signatures within "
        "<tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "ls", "description": "List a directory.", '
        '"parameters": {"type": "object", "properties": {"path": {"type": "string"}}, '
        '"required": ["path"]}}}\n</tools>\n\nFor each function call, return a json object with '
        "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nList the files.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\na.py\nb.py\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nTwo files.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_without_tools(tiny_qwen3: tuple[Any, Any]) -> None:
    tokenizer = tiny_qwen3[1]
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nList the files.<|im_end|>\n<|im_start|>assistant\n"
    )
    only_user = tokenizer.apply_chat_template(USER, tokenize=False)
    assert only_user == "<|im_start|>user\nList the files.<|im_end|>\n"


def test_tool_call_text_matches_template(tiny_qwen3: tuple[Any, Any]) -> None:
    tokenizer = tiny_qwen3[1]
    arguments = {"path": "docs/café.md", "offset": 3, "flags": [True, None]}
    expected = (
        '<tool_call>\n{"name": "read", "arguments": '
        '{"path": "docs/café.md", "offset": 3, "flags": [true, null]}}\n</tool_call>'
    )
    assert tool_call_text("read", arguments) == expected
    call = {"type": "function", "function": {"name": "read", "arguments": arguments}}
    message = {"role": "assistant", "content": "", "tool_calls": [call]}
    text = tokenizer.apply_chat_template([message], tokenize=False)
    assert text == f"<|im_start|>assistant\n{expected}<|im_end|>\n"


def test_cache_trimmability(tiny_qwen3: tuple[Any, Any], tiny_qwen35: tuple[Any, Any]) -> None:
    dense = make_prompt_cache(tiny_qwen3[0])
    assert [type(c) for c in dense] == [KVCache, KVCache]
    assert can_trim_prompt_cache(dense)
    hybrid = make_prompt_cache(tiny_qwen35[0])
    assert [type(c) for c in hybrid] == [ArraysCache, KVCache, ArraysCache, KVCache]
    assert not can_trim_prompt_cache(hybrid)


def test_forced_generate_step_emits_script_then_eos(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    script_ids = tokenizer.encode(REPLY, add_special_tokens=False)
    out = forced_generate(model, tokenizer, prompt_ids(tokenizer), REPLY)
    assert out == [*script_ids, IM_END]
    assert tokenizer.decode(out[:-1]) == REPLY
    assert tokenizer.decode(out, skip_special_tokens=True) == REPLY


def test_forced_token_id_script(tiny_qwen3: tuple[Any, Any]) -> None:
    model, tokenizer = tiny_qwen3
    out = forced_generate(model, tokenizer, prompt_ids(tokenizer), [5, 6, 7])
    assert out == [5, 6, 7, IM_END]


def test_forced_with_temperature_sampler(tiny_qwen35: tuple[Any, Any]) -> None:
    """Forcing survives the sampling an agent config may ask for, not just argmax."""
    model, tokenizer = tiny_qwen35
    sampler = make_sampler(temp=1.0, top_p=0.9, min_p=0.05, top_k=20)
    out = forced_generate(model, tokenizer, prompt_ids(tokenizer), REPLY, sampler=sampler)
    assert out == [*tokenizer.encode(REPLY), IM_END]


def test_forced_tool_call_parses_and_rerenders(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    arguments = {"path": "src", "limit": 20}
    prompt = prompt_ids(tokenizer)
    out = forced_generate(model, tokenizer, prompt, tool_call_text("ls", arguments))
    text = tokenizer.decode(out, skip_special_tokens=True)
    start, end = text.index(tokenizer.tool_call_start), text.index(tokenizer.tool_call_end)
    inner = text[start + len(tokenizer.tool_call_start) : end]
    assert tokenizer.tool_parser(inner, [LS_TOOL]) == {"name": "ls", "arguments": arguments}
    # The template re-renders the call to exactly the tokens that were generated (plus "\n").
    call = {"type": "function", "function": {"name": "ls", "arguments": arguments}}
    history = [*USER, {"role": "assistant", "content": "", "tool_calls": [call]}]
    rerendered = tokenizer.apply_chat_template(history, tools=[LS_TOOL])
    assert rerendered == [*prompt, *out, *tokenizer.encode("\n")]


def test_batch_generator_matches_generate_step(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    prompts = [
        prompt_ids(tokenizer),
        prompt_ids(tokenizer, [{"role": "user", "content": "A longer, different question here?"}]),
    ]
    expected = forced_generate(model, tokenizer, prompts[0], REPLY)
    generator = BatchGenerator(model, max_tokens=100, stop_tokens=[[IM_END]])
    uids = generator.insert(prompts, logits_processors=[[make_forced_processor(tokenizer, REPLY)] for _ in prompts])
    outputs: dict[int, list[int]] = {uid: [] for uid in uids}
    finished: dict[int, str] = {}
    for _ in range(200):
        for response in generator.next_generated():
            outputs[response.uid].append(response.token)
            if response.finish_reason:
                finished[response.uid] = response.finish_reason
        if len(finished) == len(uids):
            break
    generator.close()
    assert finished == {uid: "stop" for uid in uids}
    assert [outputs[uid] for uid in uids] == [expected, expected]


def test_forced_scripts_factory(tiny_qwen3: tuple[Any, Any]) -> None:
    tokenizer = tiny_qwen3[1]
    scripts = ForcedScripts(tokenizer, {"a": ["first", [9, 8]], "b": []})
    assert scripts.remaining("a") == 2
    [first] = scripts("a", [1, 2, 3])
    [second] = scripts("a", [1, 2, 3])
    assert first.token_ids == tokenizer.encode("first", add_special_tokens=False)
    assert (second.token_ids, second.eos_token_id) == ([9, 8], IM_END)
    assert scripts("a", []) == []
    assert scripts("b", []) == []
    assert scripts("unknown", []) == []
    assert scripts.remaining("a") == 0


def test_forced_processor_masks_all_but_one_token() -> None:
    class Tok:
        eos_token_id = 3

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [int(c) for c in text]

    processor = make_forced_processor(Tok(), "21")
    logits = mx.zeros((1, 5))
    picks = []
    for length in (4, 5, 6, 7, 8):  # the first call fixes the prompt length at 4
        row = processor(list(range(length)), logits)[0].tolist()
        assert sum(v == 0.0 for v in row) == 1 and row.count(float("-inf")) == 4
        picks.append(row.index(0.0))
    assert picks == [2, 1, 3, 3, 3]
    with pytest.raises(RuntimeError, match="fresh one per request"):
        processor(list(range(3)), logits)


def test_a_forced_token_wins_over_a_mask_before_it() -> None:
    """The grammar masks first; a script it rejects is still said (and the grammar lets go there)."""
    prefix = ForcedPrefix([2])
    masked = mx.array([[0.5, 1.0, -mx.inf, 3.0]])  # the grammar ruled token 2 out
    for processor in (make_forced_processor(Tok4(), "2"), prefix):
        row = processor(list(range(4)), masked)[0].tolist()
        assert row.index(max(row)) == 2 and row[2] == float(mx.finfo(mx.float32).min)
        assert row.count(float("-inf")) == 3
    assert prefix(list(range(5)), masked)[0].tolist() == masked[0].tolist()  # said: the model decides


class Tok4:
    eos_token_id = 3

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(c) for c in text]


def forced_picks(processor: ForcedProcessor, contexts: list[mx.array], vocab: int) -> list[int]:
    """The token `processor` leaves unmasked for each context, called in order and evaluated only
    at the end; every context and every answer must still be pending after its call."""
    outputs = []
    for context in contexts:
        logits = mx.zeros((1, vocab)) + 0  # lazy too
        out = processor(context, logits)
        assert unevaluated(context, out)
        outputs.append(out)
    mx.eval(outputs)
    picks = []
    for out in outputs:
        row = out[0].tolist()
        assert row.count(0.0) == 1 and row.count(float("-inf")) == vocab - 1
        picks.append(row.index(0.0))
    return picks


def lazy_contexts(prompt: list[int], steps: list[list[int]]) -> list[mx.array]:
    """The growing token context of a decode, unevaluated: the prompt, then `steps[i]` more each call."""
    context = mx.array(prompt, dtype=mx.uint32) + 0
    contexts = [context]
    for new in steps:
        context = mx.concatenate([context, mx.array(new, dtype=mx.uint32) + 0])
        contexts.append(context)
    return contexts


def test_forced_processor_never_evaluates_and_resumes_after_an_override() -> None:
    # Script 5 6 7 8 6 9 then EOS 3. The emitted tokens stray from it where another processor
    # (the thought budget) overrode the script: 2 is not in it (the script moves one on), 8 and
    # later 6 are (it resumes after their next occurrence).
    processor = ForcedProcessor([5, 6, 7, 8, 6, 9], eos_token_id=3)
    emitted = [[5], [2], [8], [6], [9], [3], [3]]
    picks = forced_picks(processor, lazy_contexts([1, 1, 1, 1], emitted), vocab=12)
    assert picks == [5, 6, 7, 6, 9, 3, 3, 3]

    processor = ForcedProcessor([5, 6, 7, 8, 6, 9], eos_token_id=3)
    picks = forced_picks(processor, lazy_contexts([1, 1], [[5], [6], [6], [9]]), vocab=12)
    assert picks == [5, 6, 7, 9, 3]  # the second 6 skips 7 and 8: its next occurrence is index 4


def test_forced_processor_takes_several_new_tokens_at_once() -> None:
    processor = ForcedProcessor([5, 6, 7, 8, 6, 9], eos_token_id=3)
    contexts = lazy_contexts([1, 1, 1], [[5, 2, 8], [], [6, 9, 3, 3], [3]])
    assert forced_picks(processor, contexts, vocab=12) == [5, 6, 6, 3, 3]
    with pytest.raises(RuntimeError, match="fresh one per request"):
        processor(contexts[3], mx.zeros((1, 12)))

    empty = ForcedProcessor([], eos_token_id=3)  # nothing to say: EOS from the start
    assert forced_picks(empty, lazy_contexts([1], [[4, 4], [3]]), vocab=12) == [3, 3, 3]


@pytest.mark.slow
@pytest.mark.process
def test_cli_builds_a_model(tmp_path: Path) -> None:
    out = tmp_path / "cli-model"
    root = str(Path(mlx_subagents.__file__).resolve().parents[1])
    pythonpath = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "mlx_subagents.testing.tiny_model", str(out)]
    result = subprocess.run(
        [*command, "--arch", "qwen3_5", "--context-window", "2048"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": pythonpath},
        check=True,
    )
    assert result.stdout == f"{out}\n"
    assert "RuntimeWarning" not in result.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_5"
    assert config["text_config"]["max_position_embeddings"] == 2048
