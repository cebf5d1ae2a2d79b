"""Which model a task runs on, and which models a call may name: the task's own, `--model`, the
agent's file's (its `engine:` only where the user wrote that file), its parent's, the default; a
delegated task's own model granted (`model_grants.py`) and on this machine, never fetched mid-delegation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..agents.model_fields import remote_model
from ..agents.spec import AgentSpec
from ..errors import RequestError
from ..host.mlx.loading import resolve_model_path
from ..host.protocol import ModelHost
from .hosts import HostPool
from .model_grants import granted_models, imported_names, on_this_machine
from .options import RunOptions
from .prepared import Parent
from .tasks import SCRIPTED, ModelRef, default_model


class ModelChoice:
    """Chooses tasks' models for one runner, from its options and the resident hosts of its `pool`.

    Args:
        on_warning: receives one line for a project agent's `engine:`, once per agent.
    """

    def __init__(self, options: RunOptions, pool: HostPool, on_warning: Callable[[str], None]) -> None:
        self.options = options
        self.pool = pool
        self.on_warning = on_warning
        self._engine_refused: set[str] = set()  # project agents told once that their `engine:` is not honoured

    def model_for(self, spec: AgentSpec, override: str | None = None, inherited: ModelRef | None = None) -> ModelRef:
        """A task's own model, else `--model`, else the agent's (its `engine:` and `engine_model:`, or
        its `model:`), else its parent's (`inherited`), else `$MLX_SUBAGENTS_MODEL` or the default.
        With `--engine`, every task's model is a model id on that engine."""
        options = self.options
        if options.engine:
            model = override or options.model or spec.engine_model or (inherited.model if inherited else "")
            if not model:
                raise RequestError("--engine needs --model, the engine's model id (or engine_model: in the agent file)")
            return ModelRef(model, options.engine)
        if not (override or options.model) and (own := self.agent_engine(spec)) is not None:
            return own
        named = override or options.model
        if named and (problem := remote_model(named)) is not None:
            where = "--model" if named == options.model else f"task '{spec.name}': model"
            raise RequestError(
                f"{where}: {problem}; use a local folder, an MLX hub id, an imported name, mlx/{named} if it is a "
                "Hugging Face repo, or --engine URL for a model an OpenAI-compatible server runs"
            )
        named = named or spec.model
        return ModelRef(named) if named else inherited or ModelRef(options.default_model or default_model())

    def agent_engine(self, spec: AgentSpec, *, warn: bool = True) -> ModelRef | None:
        """The engine and model the agent's own file names (`engine:`, `engine_model:`), when the user
        wrote that file (a built-in or user agent). A project file's is one warning and none: every
        turn, with the user's API key as its bearer token, would go where the repository said."""
        if not (spec.engine and spec.engine_model):
            return None
        if spec.source != "project":
            return ModelRef(spec.engine_model, spec.engine)
        if warn and spec.name not in self._engine_refused:
            self._engine_refused.add(spec.name)
            self.on_warning(
                f"{spec.path}: 'engine: {spec.engine}' comes with the project, which cannot choose where the prompts "
                "(and your API key) go; it runs on the run's model (name an engine yourself with --engine URL)"
            )
        return None

    @property
    def hosts(self) -> dict[ModelRef, ModelHost]:
        """The resident hosts by model (the pool's: a shared pool's are every client's)."""
        return self.pool.hosts

    def granted_models(self, parent: Parent | None) -> tuple[str, ...]:
        """The models a call of `parent` (None: an MCP client) may name for a child (`model_grants.py`)."""
        return granted_models(self.options, parent.spec if parent else None, parent.model if parent else None)

    def offered_models(self, parent: Parent | None) -> tuple[str, ...]:
        """The granted models a call's schema offers by name, those on this machine only (one that is not
        would be refused: a call never downloads): none while only the run's own are granted (naming the
        model a child runs on anyway is no choice, and every field costs a small model's context); they
        are still accepted."""
        extra = (parent.spec.models if parent else ()) or self.options.allow_models or imported_names()
        if not extra or self.options.engine:
            return ()
        return tuple(name for name in self.granted_models(parent) if on_this_machine(name, self.hosts))

    def runs_on(self, parent: Parent | None, agents: Sequence[tuple[str, AgentSpec]]) -> list[tuple[str, str, str]]:
        """What each of `agents` runs on as `parent`'s child when the call names no model, and why."""
        options, inherited = self.options, parent.model if parent else None
        rows = []
        for name, spec in agents:
            model = self.model_for(spec, None, inherited=inherited)
            if options.engine or options.model:
                why = "the run's --model" + (f" on {options.engine}" if options.engine else "")
            elif self.agent_engine(spec, warn=False) is not None:
                why = "its file's engine:"
            elif spec.model:
                why = "its file's model:"
            elif inherited is not None:
                why = "yours: it runs on its parent's model"
            else:
                why = "the default"
            rows.append((name, str(model), why))
        return rows

    def check_local(self, model: ModelRef, *, named: bool = False) -> None:
        """Refuse a delegated task's model unless it is on this machine, before any task starts:
        fetching gigabytes mid-delegation would stall its parent for minutes; and a model the call
        `named` itself on an engine run cannot be checked there, so it is refused (fail closed)."""
        if named and self.options.engine:
            raise RequestError(
                f"model '{model.model}': this run's models are on the engine {self.options.engine}; a task's own "
                "model must be a local one, so leave model out"
            )
        if model.engine or model in self.pool or model.model.startswith(SCRIPTED):
            return
        resolve_model_path(model.model, local_only=True)
