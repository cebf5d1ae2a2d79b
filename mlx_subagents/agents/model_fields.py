"""An agent file's fields about its model: `model:`, `models:` (what its calls may name), `engine:`
with `engine_model:`, `temperature:` and `thinking:` or `effort:`, each read into one line naming the
file, the field and the fix when it is bad (`spec.py` reads the rest)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..host.protocol import DEFAULT_THINKING_TOKENS
from .claude import is_claude_model
from .frontmatter import agent_error as _fail
from .tool_fields import split_list

MAX_TEMPERATURE = 2.0
EXAMPLE_MODEL = "mlx-community/Qwen3-4B-Instruct-2507-4bit"
# `effort:` as a thinking budget per reply, in tokens: medium is the default budget.
EFFORT_THINKING = {"low": 1024, "medium": DEFAULT_THINKING_TOKENS, "high": 4 * DEFAULT_THINKING_TOKENS}
# A model named `<provider>/...` or `<provider>:...` with one of these runs remotely: refused,
# never swapped for a local model. `mlx/<id>` bypasses the check (e.g. `mlx/google/gemma-3-1b-it`).
REMOTE_PROVIDERS = frozenset(
    {
        "openai", "anthropic", "claude", "google", "gemini", "vertex", "vertex_ai", "ollama",
        "bedrock", "azure", "azure_ai", "groq", "mistral", "openrouter", "together",
        "together_ai", "fireworks", "fireworks_ai", "deepseek", "xai", "cohere", "perplexity",
        "cerebras", "sambanova", "replicate", "deepinfra", "lmstudio", "github-copilot",
    }
)  # fmt: skip


def parse_models(path: Path, value: Any) -> tuple[str, ...]:
    """`models:`: the models this agent's `subagent` calls may name (a comma-separated string or a list)."""
    if value is None:
        return ()
    items = [i for i in split_list(value) if i.strip()] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(item, str) and item.strip() for item in items):
        raise _fail(
            path,
            "field 'models' must be a comma-separated string or a list of model names",
            "e.g. models: qwen2.5-coder-7b, mlx-community/Qwen3-4B-Instruct-2507-4bit",
        )
    return tuple(dict.fromkeys(item.strip() for item in items))


def parse_model(path: Path, value: Any, claude: bool, warnings: list[str]) -> str | None:
    fix = f"use a local path, an MLX hub id like {EXAMPLE_MODEL}, or inherit"
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise _fail(path, "field 'model' must be non-empty text", fix)
    model = value.strip()
    if model.lower() == "inherit":
        return None
    if model.startswith("mlx/"):
        if not model[4:].strip():
            raise _fail(path, "field 'model': 'mlx/' names no model", fix)
        return model[4:].strip()
    if is_claude_model(model):
        if not claude:
            raise _fail(path, f"field 'model': '{model}' is a Claude model, not a local one", fix)
        note = f"model '{model}' is a remote Claude model; using the default local model"
        warnings.append(f"{path}: {note}")
        return None
    if (problem := remote_model(model)) is not None:
        raise _fail(path, f"field 'model': {problem}", f"{fix} (write mlx/{model} if it is a Hugging Face repo)")
    return model


def remote_model(model: str) -> str | None:
    """What is wrong with a model named `<provider>/...` of a remote provider (`openai/gpt-4o`): it
    runs elsewhere, so it is refused, never looked up as a hub id; None for any other name."""
    provider = re.split(r"[/:]", model, maxsplit=1)[0].lower()
    if provider != model.lower() and provider in REMOTE_PROVIDERS:
        return f"'{model}' is a remote '{provider}' model; only local MLX models run here"
    return None


def parse_engine(path: Path, engine: Any, model: Any) -> dict[str, str]:
    """`engine:` (an http(s) base URL) and `engine_model:` (the engine's model id) come together."""
    if engine is None and model is None:
        return {}
    example = "engine: http://gpu-box:8000/v1 and engine_model: <the engine's model id>"
    if not isinstance(engine, str) or not isinstance(model, str) or not engine.strip() or not model.strip():
        raise _fail(path, "fields 'engine' and 'engine_model' must both be given, as text", f"write {example}")
    url = urlsplit(engine.strip())
    if url.scheme not in ("http", "https") or not url.hostname:
        raise _fail(path, f"field 'engine': {engine.strip()!r} is not an http(s) URL", f"write {example}")
    return {"engine": engine.strip(), "engine_model": model.strip()}


def parse_temperature(path: Path, value: Any) -> float | None:
    if value is None:
        return None
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or not 0 <= value <= MAX_TEMPERATURE:
        problem = f"field 'temperature' must be a number from 0 to 2, got {value!r}"
        raise _fail(path, problem, "e.g. temperature: 0.2")
    return float(value)


def parse_thinking(value: Any) -> int | None:
    """`on`, `off` or a number of tokens (YAML reads a bare on/off as a boolean) -> tokens, 0 for off.

    Raises:
        ValueError: anything else, in a phrase naming what was given.
    """
    if value is None:
        return None
    text = str(value).strip().lower() if isinstance(value, (str, bool)) else None
    if text in ("on", "true"):
        return DEFAULT_THINKING_TOKENS
    if text in ("off", "false"):
        return 0
    if text is not None and text.isdigit():
        return int(text)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ValueError(f"must be on, off or a number of tokens, got {value!r}")


def parse_thinking_field(path: Path, value: Any, effort: Any = None) -> int | None:
    """`thinking:` in tokens, or `effort:` (Claude Code's, Codex's) mapped by `EFFORT_THINKING`."""
    if effort is not None:
        if value is not None:
            raise _fail(path, "fields 'effort' and 'thinking' both set the thinking budget", "keep one of them")
        if effort not in EFFORT_THINKING:
            raise _fail(path, f"field 'effort' must be low, medium or high, got {effort!r}", "e.g. effort: low")
        return EFFORT_THINKING[effort]
    try:
        return parse_thinking(value)
    except ValueError as exc:
        raise _fail(path, f"field 'thinking' {exc}", "e.g. thinking: 2048 (tokens per reply), on or off") from None
