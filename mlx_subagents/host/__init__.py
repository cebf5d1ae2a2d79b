"""Model hosts: the real `MlxModelHost` and the `ScriptedHost` replay backend."""

from .mlx_host import MlxModelHost, MlxSession, parse_bytes
from .protocol import Generation, HostSession, MalformedToolCall, ModelHost, ToolCall, Usage

__all__ = [
    "Generation",
    "HostSession",
    "MalformedToolCall",
    "MlxModelHost",
    "MlxSession",
    "ModelHost",
    "ToolCall",
    "Usage",
    "make_host",
    "parse_bytes",
]


def make_host(model: str, **kwargs: object) -> ModelHost:
    """`scripted:FILE` gives the replay host; anything else the real mlx host."""
    if model.startswith("scripted:"):
        from .scripted import ScriptedHost

        return ScriptedHost.from_model_id(model, context_window=kwargs.get("context_window"))  # type: ignore[arg-type]
    return MlxModelHost(model, **kwargs)  # type: ignore[arg-type]
