"""What the benchmark scripts share: the vocabulary of their generated code, the tool results they
feed back, and how they name a model's architecture. Imported by sibling scripts run as
`python benchmarks/NAME.py` (their folder is on `sys.path`)."""

from __future__ import annotations

from pathlib import Path

from mlx_subagents.host import Generation
from mlx_subagents.host.loading import read_config
from mlx_subagents.host.protocol import Message

VERBS = ("load", "parse", "read", "build", "check", "resolve", "merge", "save", "apply", "validate")
NOUNS = ("config", "settings", "profile", "session", "cache", "token", "model", "path", "limits", "env")
TYPES = ("str", "int", "Path", "dict[str, Any]", "list[str]", "bool", "Settings", "Config")


def tool_message(generation: Generation, name: str, result: str) -> Message:
    """A planned call's result, answering the model's call id when it made one."""
    call_id = generation.tool_calls[0].id if generation.tool_calls else "call_0"
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": result}


def model_arch(model: Path) -> str:
    """`model_type` from the config, looking inside `text_config` for multimodal layouts."""
    config = read_config(model)
    return str(config.get("model_type") or (config.get("text_config") or {}).get("model_type", "?"))
