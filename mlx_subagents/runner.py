"""Runs tasks: resolves agents and models, owns the resident hosts, applies limits.

One resident host per model id, started on first use and shared by every
task that names that model. The CLI and Python callers both come through here.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .agents import AgentCatalog, AgentSpec, discover_agents, require_trust
from .compaction import CompactionSettings
from .events import EventSink, ignore_event
from .host import make_host
from .host.protocol import ModelHost
from .results import RunResult
from .session import DEFAULT_MAX_TURNS, AgentSession, Limits
from .tools import Workspace

DEFAULT_MODEL = "mlx-community/Qwen3-4B-Instruct-2507-4bit"
MODEL_ENV = "MLX_SUBAGENTS_MODEL"


def default_model() -> str:
    return os.environ.get(MODEL_ENV) or DEFAULT_MODEL


@dataclass(frozen=True)
class TaskSpec:
    """One task to run: which agent, what to do, and optional overrides."""

    agent: str
    task: str
    label: str = ""
    model: str | None = None
    max_turns: int | None = None


@dataclass
class Runner:
    """Resolves agents, starts hosts once per model, runs tasks.

    Args:
        model: forces one model for every task (`--model`); otherwise an agent's
            own `model`, then `$MLX_SUBAGENTS_MODEL`, then `DEFAULT_MODEL`.
        host_options: passed to each host (`context_window`, `processor_factory`, ...).
    """

    cwd: Path
    catalog: AgentCatalog | None = None
    model: str | None = None
    scope: str = "both"
    assume_yes: bool = False
    interactive: bool = False
    confirm: Callable[[str], bool] | None = None
    max_turns: int | None = None
    max_output_tokens: int | None = None
    compaction: CompactionSettings = field(default_factory=CompactionSettings)
    host_options: dict[str, Any] = field(default_factory=dict)
    on_event: EventSink = ignore_event

    def __post_init__(self) -> None:
        self.cwd = Path(self.cwd).resolve()
        self.workspace = Workspace(self.cwd)
        if self.catalog is None:
            self.catalog = discover_agents(self.cwd, scope=self.scope)  # type: ignore[arg-type]
        self._hosts: dict[str, ModelHost] = {}
        self._host_lock = asyncio.Lock()

    async def __aenter__(self) -> Runner:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        hosts, self._hosts = list(self._hosts.values()), {}
        for host in hosts:
            await host.stop()

    def agent(self, name: str) -> AgentSpec:
        """The named agent, after the user's consent if it is a project agent."""
        assert self.catalog is not None
        spec = self.catalog.get(name)
        require_trust(spec, assume_yes=self.assume_yes, interactive=self.interactive, confirm=self.confirm)
        return spec

    def model_for(self, spec: AgentSpec, override: str | None = None) -> str:
        return override or self.model or spec.model or default_model()

    async def host_for(self, model: str) -> ModelHost:
        """The resident host for a model, loaded on first use."""
        async with self._host_lock:
            if model not in self._hosts:
                host = make_host(model, **self.host_options)
                await host.start()
                self._hosts[model] = host
            return self._hosts[model]

    async def run(self, task: TaskSpec) -> RunResult:
        """Run one task on its agent's model and return its result."""
        spec = self.agent(task.agent)
        host = await self.host_for(self.model_for(spec, task.model))
        limits = Limits(
            max_turns=task.max_turns or self.max_turns or spec.max_turns or DEFAULT_MAX_TURNS,
            max_output_tokens=self.max_output_tokens,
        )
        session = AgentSession(
            spec=spec, host=host, workspace=self.workspace, label=task.label or spec.name,
            limits=limits, compaction=self.compaction, on_event=self.on_event,
        )
        return await session.run(task.task)
