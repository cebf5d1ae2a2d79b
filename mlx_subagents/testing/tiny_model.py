"""Build tiny random Qwen-style model folders that the real `mlx_lm.load` loads offline.

No machine running the tests can download weights, so the tests make their own: a few hundred
thousand fp32 parameters, a byte-level BPE tokenizer trained on generated agent-like text and a
Qwen tools chat template. The weights are noise; `forced.py` makes them say something useful.

    python -m mlx_subagents.testing.tiny_model OUT [--arch qwen3|qwen3_5|gemma3_text] [--seed N]
        [--context-window N] [--template tools|coder|no_tools|strict|thinking|none] [--head-dim N]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import random
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal

Arch = Literal["qwen3", "qwen3_5", "gemma3_text"]
ARCHS: tuple[Arch, ...] = ("qwen3", "qwen3_5", "gemma3_text")
# gemma3_text: Gemma 3's text model, every other layer on a sliding window this short, so that a prompt
# of a few hundred tokens rotates its cache (mlx-lm's `RotatingKVCache`).
TINY_SLIDING_WINDOW = 64
# Chat templates, one per path the host takes: Qwen-style with tools (native tool mode), Qwen3-Coder-style
# XML calls (native, another parser), ChatML that drops tools (prompted, like SmolLM2), Gemma-style strict
# alternation without system (prompted and normalised), Qwen3.5-style thinking (opens a thought, renders
# reasoning_content, `enable_thinking` switch), and none at all (refused at load).
Template = Literal["tools", "coder", "no_tools", "strict", "thinking", "none"]
TEMPLATES: tuple[Template, ...] = ("tools", "coder", "no_tools", "strict", "thinking", "none")
_TEMPLATE_FILES = {
    "tools": "chat_template.jinja",
    "coder": "chat_template_coder.jinja",
    "no_tools": "chat_template_no_tools.jinja",
    "strict": "chat_template_strict.jinja",
    "thinking": "chat_template_thinking.jinja",
}

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# Control tokens: hidden by `decode(..., skip_special_tokens=True)`, as in Qwen.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Markup tokens: single ids but kept in decoded text, so tool calls stay parseable.
MARKUP_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
BPE_VOCAB_SIZE = 1536
# Qwen's pre-tokenizer split (single digits, words with one leading non-letter, punctuation
# runs), as transformers 5 rebuilds it for qwen3_5: our tokenizer.json matches, so both archs agree.
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_SHARED_TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "torch_dtype": "float32",
}


def make_tiny_model(
    out_dir: Path,
    arch: Arch = "qwen3",
    *,
    seed: int = 0,
    context_window: int = 4096,
    template: Template = "tools",
    head_dim: int = 16,
) -> Path:
    """Write config, random weights and tokenizer files into `out_dir`; return it.

    `head_dim`: the width of each attention head. The default 16 is narrower than mlx's `quantize`
    takes (groups of 32 or 64), so a quantized KV cache falls back on it; 64 quantizes as real models do.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_json = _trained_tokenizer_json()
    added = {t["content"]: t["id"] for t in json.loads(tokenizer_json)["added_tokens"]}
    vocab_size = max(added.values()) + 1  # exact: a sampled id always decodes
    config = model_config(arch, vocab_size, context_window, added[EOS_TOKEN], added[PAD_TOKEN], head_dim)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(template), indent=2))
    _write_weights(config, out_dir / "model.safetensors", seed)
    return out_dir


def model_config(
    arch: Arch, vocab_size: int, context_window: int, eos_id: int, pad_id: int, head_dim: int = 16
) -> dict[str, Any]:
    """The HF-style `config.json`; qwen3_5 nests its text model under `text_config` like Qwen3.5."""
    ids = {"bos_token_id": pad_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    text = {
        **_SHARED_TEXT_CONFIG,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": context_window,
    }
    if arch == "qwen3":
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **text,
            "num_hidden_layers": 2,
            "rope_theta": 1_000_000.0,
            **ids,
        }
    if arch == "gemma3_text":
        return {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            **text,
            "num_hidden_layers": 2,
            "sliding_window": TINY_SLIDING_WINDOW,
            "sliding_window_pattern": 2,
            "query_pre_attn_scalar": text["head_dim"],
            **ids,
        }
    return _qwen3_5_config(text, ids)


def _qwen3_5_config(text: dict[str, Any], ids: dict[str, int]) -> dict[str, Any]:
    """Qwen3.5's config: a hybrid (linear attention layers, every second one full attention) whose text
    model is nested under `text_config`, as a vision-language checkpoint's is."""
    layer_types = ["linear_attention", "full_attention"] * 2
    text_config = {
        "model_type": "qwen3_5_text",
        **text,
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,  # informational; mlx-lm derives it from the interval
        "full_attention_interval": 2,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
        },
        **ids,
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": True,
        "text_config": text_config,
        **ids,
    }


def tokenizer_config(template: Template = "tools") -> dict[str, Any]:
    """`tokenizer_config.json`: a generic fast tokenizer, so transformers uses tokenizer.json as is
    (except for qwen3_5, which transformers 5 always rebuilds as `Qwen3_5Tokenizer`)."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
    }
    if template != "none":
        text = resources.files(__package__).joinpath(_TEMPLATE_FILES[template]).read_text("utf-8")
        config["chat_template"] = text.rstrip()
    return config


def resize_tiny_model(
    path: Path, *, hidden_size: int | None = None, num_layers: int | None = None, seed: int = 0
) -> Path:
    """Scale a tiny model's width and depth (for benchmarks); the tokenizer and template stay.

    Raises:
        ValueError: a size the architecture cannot take, in one line naming the option.
    """
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    if hidden_size is not None:
        head_dim = 16 if hidden_size < 256 else 64
        if hidden_size % head_dim:
            raise ValueError(f"hidden_size {hidden_size} must be a multiple of {head_dim}")
        heads = hidden_size // head_dim
        text.update(
            hidden_size=hidden_size,
            intermediate_size=3 * hidden_size,
            head_dim=head_dim,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
        )
    if num_layers is not None:
        if "text_config" in config:
            if num_layers % 2:
                raise ValueError("num_layers must be even for qwen3_5 (linear / full attention pairs)")
            text["layer_types"] = ["linear_attention", "full_attention"] * (num_layers // 2)
        text["num_hidden_layers"] = num_layers
    (path / "config.json").write_text(json.dumps(config, indent=2))
    _write_weights(config, path / "model.safetensors", seed)
    return path


def _write_weights(config: dict[str, Any], path: Path, seed: int) -> None:
    """Instantiate the mlx-lm class and save its own parameter names, which load strictly."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    shapes = {name: value.shape for name, value in tree_flatten(model.parameters())}
    weights = _random_weights(shapes, seed)
    mx.eval(weights)
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})


def _random_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, Any]:
    """Seeded draws from explicit keys (the global mlx RNG is left alone), scaled so the
    residual stream stays near unit size and tied-embedding logits have a std near 1."""
    import mlx.core as mx

    keys = mx.random.split(mx.random.key(seed), len(shapes))
    weights = {}
    for key, (name, shape) in zip(keys, sorted(shapes.items())):
        if name.endswith("A_log"):  # gated-delta decay rates: log of a rate in [1, 16)
            weights[name] = mx.log(mx.random.uniform(1.0, 16.0, shape, key=key))
        elif len(shape) == 1:  # RMSNorm gains and dt_bias start at one, as in mlx-lm
            weights[name] = mx.ones(shape)
        elif name.endswith("embed_tokens.weight"):
            weights[name] = mx.random.normal(shape, key=key) * shape[-1] ** -0.5
        else:  # Linear and depthwise Conv1d: mlx's default uniform(+-1/sqrt(fan_in))
            bound = math.prod(shape[1:]) ** -0.5
            weights[name] = mx.random.uniform(-bound, bound, shape, key=key)
    return weights


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    """Train the byte-level BPE once per process; it does not depend on arch or seed."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(random.Random(0)), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer.to_str()


_WORDS = (
    "the a an to of and or in on for with is are was be can will should must not this that it"
    " file files line lines code function class method test tests error errors found read write"
    " edit search find list run command output result results path paths directory project"
    " module package import return value values name names type types string number list dict"
    " true false none null agent task user assistant system tool tools call calls response"
    " answer question where how what why when which auth handled config settings change changes"
    " plan review fix bug issue summary done next step steps check see use using used make"
    " here there all each new old first last only also more than then if else from into"
    " please let me look at now I you we they have has had do does did"
).split()
_IDENTIFIERS = (
    "main app config user session token cache model host runner agent result args kwargs self"
    " path name data value items text count index offset limit prompt messages tools handler"
    " request response parse load save build run start stop get set update"
).split()
_DIRS = ("src", "tests", "lib", "app", "docs", "mlx_subagents", "scripts", "pkg", "core", "utils")
_EXTS = ("py", "md", "json", "toml", "yaml", "txt", "js", "ts", "sh", "rs")
_TOOLS = ("read", "grep", "find", "ls", "bash", "edit", "write")
_SHELL = ("git status", "git diff", "ls -la", "pytest -q", "python -m", "cat", "rg -n", "wc -l")
_TEMPLATE_TEXT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "</tools>\n\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def _corpus(rng: random.Random, size: int = 6000) -> Iterator[str]:
    """Agent-like training text: prose, paths, code, shell, JSON tool calls and schemas."""
    makers = (_sentence, _path, _code, _shell, _tool_call_json, _tool_schema_json, _grep_hit)
    yield _TEMPLATE_TEXT
    for _ in range(size):
        yield rng.choice(makers)(rng)


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
    text = " ".join(words)
    return rng.choice(("", "## ", "- ", "1. ")) + text[0].upper() + text[1:] + rng.choice(".?:\n")


def _path(rng: random.Random) -> str:
    parts = [rng.choice(_DIRS) for _ in range(rng.randint(0, 3))]
    parts.append(f"{rng.choice(_IDENTIFIERS)}_{rng.choice(_IDENTIFIERS)}.{rng.choice(_EXTS)}")
    return rng.choice(("", "./", "/home/user/project/")) + "/".join(parts)


def _code(rng: random.Random) -> str:
    fn, arg, other = (rng.choice(_IDENTIFIERS) for _ in range(3))
    return rng.choice(
        (
            f"def {fn}({arg}: str, {other}: int = {rng.randint(0, 99)}) -> dict:\n"
            f'    """{_sentence(rng)}"""\n    return {{"{arg}": {other}}}\n',
            f"class {fn.title()}{other.title()}:\n    def __init__(self, {arg}):\n        self.{arg} = {arg}\n",
            f"from {rng.choice(_DIRS)}.{fn} import {other}\nimport {arg}\n",
            f'    if {arg} is None:\n        raise ValueError(f"{{{arg}}} not found")\n',
            f"for i, {arg} in enumerate({other}s):\n    print(i, {arg}[{rng.randint(0, 9)}])\n",
        )
    )


def _shell(rng: random.Random) -> str:
    return f"$ {rng.choice(_SHELL)} {_path(rng)}\nexit code {rng.randint(0, 2)}"


def _tool_arguments(rng: random.Random) -> dict[str, Any]:
    choices: list[dict[str, Any]] = [
        {"path": _path(rng)},
        {"pattern": rng.choice(_IDENTIFIERS), "path": rng.choice(_DIRS)},
        {"command": f"{rng.choice(_SHELL)} {_path(rng)}"},
        {"path": _path(rng), "offset": rng.randint(1, 500), "limit": rng.randint(1, 200)},
        {"path": _path(rng), "old_text": _code(rng), "new_text": _code(rng)},
    ]
    return rng.choice(choices)


def _tool_call_json(rng: random.Random) -> str:
    call = {"name": rng.choice(_TOOLS), "arguments": _tool_arguments(rng)}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def _tool_schema_json(rng: random.Random) -> str:
    props = {k: {"type": "string", "description": _sentence(rng)} for k in _tool_arguments(rng)}
    schema = {
        "type": "function",
        "function": {
            "name": rng.choice(_TOOLS),
            "description": _sentence(rng),
            "parameters": {"type": "object", "properties": props, "required": sorted(props)},
        },
    }
    return json.dumps(schema)


def _grep_hit(rng: random.Random) -> str:
    return f"{_path(rng)}:{rng.randint(1, 999)}: {_code(rng).splitlines()[0]}"


def main(argv: Sequence[str] | None = None) -> None:
    """CLI entry: build one model folder and print its path."""
    parser = argparse.ArgumentParser(prog="python -m mlx_subagents.testing.tiny_model")
    parser.add_argument("out", type=Path, help="folder to write the model into")
    parser.add_argument("--arch", choices=ARCHS, default="qwen3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--context-window", type=int, default=4096)
    parser.add_argument("--template", choices=TEMPLATES, default="tools")
    parser.add_argument("--head-dim", type=int, default=16, help="attention head width (64: KV quantizes)")
    args = parser.parse_args(argv)
    path = make_tiny_model(
        args.out,
        args.arch,
        seed=args.seed,
        context_window=args.context_window,
        template=args.template,
        head_dim=args.head_dim,
    )
    print(path)


if __name__ == "__main__":
    main()
