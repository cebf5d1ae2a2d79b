"""Coding sub-agents on a local MLX model, in one process.

The Python API, as the CLI uses it:

    from mlx_subagents import Runner, TaskSpec

    async with Runner(cwd=".") as runner:
        result = await runner.run(TaskSpec("scout", "where is auth handled?"))
        print(result.output)

The layers, each importing only the ones below it: the front ends (`cli`, `mcp_server`) > `runs`
(many agents: plan, run, hold, record) > `agents` (one agent: its file, its prompt, its loop) >
`host`, `tools`, `models` > the vocabulary in this folder (errors, events, results, caps, ...).
"""

__version__ = "0.1.0"

from .agents.discovery import discover_agents
from .agents.spec import AgentSpec
from .errors import SubagentError
from .host.mlx_host import MlxModelHost
from .host.protocol import GenerateArgs
from .host.scripted import ScriptedHost
from .results import MultiRunResult, RunResult
from .runs.options import RunOptions
from .runs.runner import Runner
from .runs.task import TaskHandle
from .runs.tasks import TaskSpec

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
