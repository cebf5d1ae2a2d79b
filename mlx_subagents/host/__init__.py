"""Model hosts: the real `MlxModelHost`, `EngineHost` (an OpenAI-compatible engine) and the
`ScriptedHost` replay backend."""

from .mlx_host import MlxModelHost, MlxSession, SharedKVBudget, parse_bytes
from .protocol import GenerateArgs, HostSession, MalformedToolCall, ModelHost, Reply, ToolCall, Usage

__all__ = [
    "GenerateArgs",
    "HostSession",
    "MalformedToolCall",
    "MlxModelHost",
    "MlxSession",
    "ModelHost",
    "Reply",
    "SharedKVBudget",
    "ToolCall",
    "Usage",
    "make_host",
    "parse_bytes",
]


def make_host(model: str, *, engine: str | None = None, api_key: str | None = None, **kwargs: object) -> ModelHost:
    """An engine the user named gives `EngineHost` (`model` is the engine's id); `scripted:FILE`
    the replay host; anything else the real mlx host."""
    if engine is not None:
        from .engine_host import EngineHost

        window, start = kwargs.get("context_window"), kwargs.get("start_timeout")
        return EngineHost(engine, model, api_key=api_key, context_window=window, start_timeout=start)  # type: ignore[arg-type]
    if model.startswith("scripted:"):
        from .scripted import ScriptedHost

        return ScriptedHost.from_model_id(model, context_window=kwargs.get("context_window"))  # type: ignore[arg-type]
    return MlxModelHost(model, **kwargs)  # type: ignore[arg-type]
