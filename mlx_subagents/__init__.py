"""Coding sub-agents on a local MLX model, in one process.

The Python API, as the CLI uses it:

    from mlx_subagents import Runner, TaskSpec

    async with Runner(cwd=".") as runner:
        result = await runner.run(TaskSpec("scout", "where is auth handled?"))
        print(result.output)

The layers, each importing only the ones below it: the front ends (`cli` > `serve` > `mcp_server`) > `runs`
(many agents: plan, run, hold, record) > `agents` (one agent: its file, its prompt, its loop) >
`host`, `tools`, `models` > the vocabulary in this folder (errors, events, results, caps, ...).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Each name of the API and the module it comes from, imported when first used: a command that only
# talks to `subagent serve` (an attached `subagent run`) loads none of the runner, the hosts or mlx.
_EXPORTS = {
    "AgentSpec": ".agents.spec",
    "GenerateArgs": ".host.protocol",
    "MlxModelHost": ".host.mlx.mlx_host",
    "MultiRunResult": ".results",
    "RunOptions": ".runs.options",
    "RunResult": ".results",
    "Runner": ".runs.runner",
    "ScriptedHost": ".host.scripted",
    "SubagentError": ".errors",
    "TaskHandle": ".runs.task",
    "TaskSpec": ".runs.tasks",
    "discover_agents": ".agents.discovery",
}

if TYPE_CHECKING:
    from .agents.discovery import discover_agents
    from .agents.spec import AgentSpec
    from .errors import SubagentError
    from .host.mlx.mlx_host import MlxModelHost
    from .host.protocol import GenerateArgs
    from .host.scripted import ScriptedHost
    from .results import MultiRunResult, RunResult
    from .runs.options import RunOptions
    from .runs.runner import Runner
    from .runs.task import TaskHandle
    from .runs.tasks import TaskSpec


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "AgentSpec",
    "GenerateArgs",
    "MlxModelHost",
    "MultiRunResult",
    "RunOptions",
    "RunResult",
    "Runner",
    "ScriptedHost",
    "SubagentError",
    "TaskHandle",
    "TaskSpec",
    "__version__",
    "discover_agents",
]
