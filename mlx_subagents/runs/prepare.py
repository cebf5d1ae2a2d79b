"""The one path from a task to what runs it: agent, grants, caps, schema, model, host, prompt fit.

Every way a task starts comes through `Preparer`: the four modes, a background start, a chat's
task, a saved task continued and every delegated child. Each is checked by the same rules in the
same order, the cheap checks of the whole request first, so that nothing loads when a check fails:

    agent     the catalog's agent, after the user's consent for a project agent (once per agent)
    grants    the parent's `agents:` list; the child's tools capped at the parent's
    caps      task and request sizes (`caps.check_request`)
    schema    the task's or the agent's output schema is a valid JSON schema
    model     the task's own, `--model`, the agent's, the parent's, `$MLX_SUBAGENTS_MODEL`, the default;
              a delegated child's must be on this machine (never downloaded mid-delegation)
    host      the resident host of that model, loaded (or reached) on first use
    fit       the agent's system prompt takes at most half the model's context window

The preparer also owns what resolution keeps for the runner's life: the consent given, one host
per model (the resident models sharing one KV budget) and the project's instructions per workspace
(so every session's prompt is byte-identical).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..agents.context import ProjectContext, load_project_context
from ..agents.discovery import AgentCatalog, require_trust
from ..agents.schema_output import check_schema
from ..agents.session import DEFAULT_MAX_TURNS, Limits, system_prompt
from ..agents.spec import AgentSpec
from ..caps import CapItem, check_request
from ..errors import AgentNotFoundError, InputTooLargeError, RequestError
from ..host import SharedKVBudget, make_host
from ..host.loading import resolve_model_path
from ..host.protocol import DEFAULT_THINKING_TOKENS, ModelHost, ProcessorFactory
from ..tools import Workspace
from .options import RunOptions
from .tasks import ModelRef, TaskSpec, default_model


@dataclass(frozen=True)
class Parent:
    """A session that may start sub-agents: who it is, its depth and model, where its children are saved.

    Args:
        depth: how many parents it has (0: started by a person).
        run_folder: its run's folder (children are saved under `run_folder/runs/`); None when nothing is saved.
        thinking: its thinking budget, which its children without a `thinking:` of their own take.
    """

    spec: AgentSpec
    label: str
    depth: int
    model: ModelRef
    run_folder: Path | None
    thinking: int | None = None


@dataclass(frozen=True)
class PreparedTask:
    """A task checked and resolved, its model loaded: what a plan, a handle or a child runs.

    Args:
        task: the task as asked (its label final: `parent > scout` for a child).
        spec: the agent as its parent may run it (tools capped at the parent's).
        denied: tools its file grants that its parent may not pass on, with the error a call gets.
        depth: how many parents it has (0: started by a person).
        context: the project's instructions for its system prompt.
    """

    task: TaskSpec
    spec: AgentSpec
    model: ModelRef
    host: ModelHost
    workspace: Workspace
    limits: Limits
    depth: int = 0
    timeout: float | None = None
    schema: dict[str, Any] | None = None
    denied: dict[str, str] = field(default_factory=dict)
    context: str = ""

    @property
    def label(self) -> str:
        return self.task.label

    def as_parent(self, run_folder: Path | None) -> Parent:
        """This task as the parent of the children it delegates to."""
        return Parent(self.spec, self.label, self.depth, self.model, run_folder, self.limits.thinking)


@dataclass(frozen=True)
class SetUpFailure:
    """A task of a request whose children fail alone (a parallel delegation) that could not be prepared."""

    task: TaskSpec
    model: str
    error: BaseException


@dataclass(frozen=True)
class _Resolved:
    """A task after the checks that load nothing: its agent, tools, schema and model."""

    task: TaskSpec
    spec: AgentSpec
    denied: dict[str, str]
    schema: dict[str, Any] | None
    model: ModelRef


class Preparer:
    """Resolves tasks for one runner, and holds its consent, hosts and project instructions.

    Args:
        catalog: the agents tasks may name.
        interactive, confirm: whether a person can be asked before a project agent runs, and how.
        processor_factory: logits processors for every real host (the test kit's forced scripts).
        hosts: hosts the caller made itself, by model (an in-memory `ScriptedHost`, another runner's
            hosts): started at their first use like ours (`start` is idempotent), never stopped here.
    """

    def __init__(
        self,
        options: RunOptions,
        catalog: AgentCatalog,
        *,
        interactive: bool = False,
        confirm: Callable[[str], bool] | None = None,
        processor_factory: ProcessorFactory | None = None,
        hosts: dict[ModelRef, ModelHost] | None = None,
    ) -> None:
        self.options = options
        self.catalog = catalog
        self.interactive = interactive
        self.confirm = confirm
        self.processor_factory = processor_factory
        self.hosts: dict[ModelRef, ModelHost] = dict(hosts or {})
        self._given = set(self.hosts)
        self._unstarted = set(self.hosts)
        self._host_lock = asyncio.Lock()
        self._kv_budget = SharedKVBudget(options.kv_budget)  # one budget across the resident models
        self._trusted: set[str] = set()
        self._contexts: dict[Path, ProjectContext] = {}

    # -- a whole request --------------------------------------------------------------------------------

    async def prepare(
        self,
        tasks: Sequence[TaskSpec],
        *,
        workspace: Workspace | Sequence[Workspace],
        parent: Parent | None = None,
        shared_input: str = "",
        delegated: bool = False,
    ) -> list[PreparedTask]:
        """Check a whole request and load its models; the first failure raises and nothing runs.

        Args:
            workspace: where the tasks work: one folder for all, or one per task.
            parent: the session delegating these tasks (None: tasks a person started).
            shared_input: text every task receives besides its own (a workflow's `--input`).
            delegated: tasks a model (or an MCP client) chose: a model of their own must be local, and
                their own limits only narrow the ones they would have.
        """
        places = _per_task(workspace, len(tasks))
        resolved = [self._resolve(t, parent, delegated) for t in tasks]
        check_request([CapItem(r.task.label, r.task.task, r.spec) for r in resolved], shared_input)
        loaded = [await self._load(r, parent, w, delegated) for r, w in zip(resolved, places)]
        for fit in {(p.spec.name, p.host.model_id): p for p in loaded}.values():
            await self.check_prompt_fits(fit)
        return loaded

    async def prepare_each(
        self,
        tasks: Sequence[TaskSpec],
        *,
        workspace: Workspace | Sequence[Workspace],
        parent: Parent | None = None,
        delegated: bool = False,
    ) -> list[PreparedTask | SetUpFailure]:
        """A request whose tasks fail alone (a parallel delegation): a task that cannot be prepared
        (an unknown agent, a model that cannot load, a prompt too long) is a `SetUpFailure` in its
        place, and so is a task the parent's grants refuse. The request's size still refuses it whole."""
        out: list[PreparedTask | SetUpFailure] = []
        for task, place in zip(tasks, _per_task(workspace, len(tasks))):
            model = ""
            try:
                resolved = self._resolve(task, parent, delegated)
                model = str(resolved.model)
                prepared = await self._load(resolved, parent, place, delegated)
                await self.check_prompt_fits(prepared)
                out.append(prepared)
            except Exception as exc:
                out.append(SetUpFailure(task, model, exc))
        ready = [p for p in out if isinstance(p, PreparedTask)]
        if ready:
            check_request([CapItem(p.label, p.task.task, p.spec) for p in ready])
        return out

    # -- the steps ---------------------------------------------------------------------------------------

    def _resolve(self, task: TaskSpec, parent: Parent | None, delegated: bool = False) -> _Resolved:
        spec = self.agent(task.agent, parent)
        denied: dict[str, str] = {}
        if parent is not None:
            spec, denied = granted_tools(parent.spec, spec)
        schema = task.schema if task.schema is not None else spec.output_schema
        if schema is not None:
            check_schema(schema, f"output schema of task '{task.label}'")
        model = self.model_for(spec, task.model, inherited=parent.model if parent else None)
        if delegated or parent is not None:
            self.check_local(model, named=bool(task.model))
        return _Resolved(task, spec, denied, schema, model)

    async def _load(
        self, resolved: _Resolved, parent: Parent | None, workspace: Workspace, delegated: bool = False
    ) -> PreparedTask:
        spec, task = resolved.spec, resolved.task
        limits, timeout = self.limits(spec, task, parent), task.timeout or self.options.timeout
        if delegated:  # a caller's own limits narrow what the task would have, never widen it
            limits = replace(limits, max_turns=min(limits.max_turns, self.limits(spec, None, parent).max_turns))
            timeout = min((t for t in (task.timeout, self.options.timeout) if t), default=None)
        return PreparedTask(
            task=task,
            spec=spec,
            model=resolved.model,
            host=await self.host_for(resolved.model),
            workspace=workspace,
            limits=limits,
            depth=parent.depth + 1 if parent else 0,
            timeout=timeout,
            schema=resolved.schema,
            denied=resolved.denied,
            context=self.project_context(spec, workspace),
        )

    def agent(self, name: str, parent: Parent | None = None) -> AgentSpec:
        """The named agent, if `parent` may start it, after the user's consent if it is a project agent.

        An unknown agent is never called ungranted: its error lists the agents the parent may start."""
        try:
            spec = self.catalog.get(name)
        except AgentNotFoundError:
            if parent is None or parent.spec.agents is None:
                raise
            may = ", ".join(n for n in parent.spec.agents if n in self.catalog.agents) or "none"
            raise AgentNotFoundError(f"unknown agent '{name}'; '{parent.spec.name}' may start: {may}") from None
        if parent is not None:
            check_grant(parent, [spec.name])  # before the consent: never ask about an agent that cannot run
        if spec.name not in self._trusted:  # ask once per agent, not once per task
            require_trust(spec, assume_yes=self.options.assume_yes, interactive=self.interactive, confirm=self.confirm)
            self._trusted.add(spec.name)
        return spec

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
        if not (override or options.model) and spec.engine and spec.engine_model:
            return ModelRef(spec.engine_model, spec.engine)
        named = override or options.model or spec.model
        return ModelRef(named) if named else inherited or ModelRef(default_model())

    async def host_for(self, model: ModelRef) -> ModelHost:
        """The resident host for a model, loaded (or, on an engine, reached) on first use."""
        async with self._host_lock:
            if model in self._unstarted:
                self._unstarted.discard(model)
                await self.hosts[model].start()
            elif model not in self.hosts:
                kwargs = self.options.host_kwargs()
                if model.engine:
                    # --timeout bounds the start too: an engine's start-up probe waits no longer.
                    kwargs.update(engine=model.engine, api_key=self.options.api_key, start_timeout=self.options.timeout)
                elif not model.model.startswith("scripted:"):
                    kwargs["kv_budget"] = self._kv_budget
                    kwargs["prefix_cache"] = self.options.prefix_cache
                    if self.processor_factory is not None:
                        kwargs["processor_factory"] = self.processor_factory
                host = make_host(model.model, **kwargs)
                await host.start()
                self.hosts[model] = host
            return self.hosts[model]

    def check_local(self, model: ModelRef, *, named: bool = False) -> None:
        """Refuse a delegated task's model unless it is on this machine, before any task starts:
        fetching gigabytes mid-delegation would stall its parent for minutes; and a model the call
        `named` itself on an engine run cannot be checked there, so it is refused (fail closed)."""
        if named and self.options.engine:
            raise RequestError(
                f"model '{model.model}': this run's models are on the engine {self.options.engine}; a task's own "
                "model must be a local one, so leave model out"
            )
        if model.engine or model in self.hosts or model.model.startswith("scripted:"):
            return
        resolve_model_path(model.model, local_only=True)

    def project_context(self, spec: AgentSpec, workspace: Workspace) -> str:
        """The project's instructions for an agent's system prompt, read once per workspace (so every
        session's prompt is byte-identical); "" for an agent with `context: none`."""
        if spec.context == "none":
            return ""
        if workspace.root not in self._contexts:
            self._contexts[workspace.root] = load_project_context(workspace.root)
        return self._contexts[workspace.root].text

    async def check_prompt_fits(self, task: PreparedTask) -> None:
        """Refuse an agent whose system prompt takes more than half the model's context window
        (the rest is for the work), naming the numbers and the file to shorten."""
        spec, host = task.spec, task.host
        prompt = system_prompt(spec, task.workspace, task.context)
        n_tokens = await host.count_tokens([{"role": "system", "content": prompt}])
        if n_tokens > host.context_window // 2:
            raise InputTooLargeError(
                f"agent '{spec.name}' has a system prompt of {n_tokens:,} tokens, over half the context window of "
                f"{host.context_window:,} tokens of {host.model_id}; shorten the body of {spec.path}"
            )

    def limits(self, spec: AgentSpec, task: TaskSpec | None = None, parent: Parent | None = None) -> Limits:
        """A task's limits: its own, else the run's, else the agent's, else the defaults; its thinking
        budget: the run's, else the agent's, else its parent's (a parent's reasoning setting reaches
        the children that set none), else the default."""
        options = self.options
        inherited = parent.thinking if parent is not None else None
        thinking = (options.thinking, spec.thinking, inherited)
        return Limits(
            max_turns=(task and task.max_turns) or options.max_turns or spec.max_turns or DEFAULT_MAX_TURNS,
            max_output_tokens=(task and task.max_output_tokens) or options.max_output_tokens,
            thinking=next((t for t in thinking if t is not None), DEFAULT_THINKING_TOKENS),
        )

    async def close(self) -> None:
        """Stop the hosts this preparer started (the caller's own stay as they are)."""
        hosts = [host for model, host in self.hosts.items() if model not in self._given]
        self.hosts = {model: host for model, host in self.hosts.items() if model in self._given}
        for host in hosts:
            await host.stop()


def _per_task(workspace: Workspace | Sequence[Workspace], n_tasks: int) -> list[Workspace]:
    return [workspace] * n_tasks if isinstance(workspace, Workspace) else list(workspace)


def check_grant(parent: Parent, agents: Sequence[str]) -> None:
    """Refuse children the parent's `agents:` list does not name."""
    granted = parent.spec.agents
    if granted is not None and (refused := sorted({a.strip().lower() for a in agents} - set(granted))):
        raise RequestError(
            f"'{parent.spec.name}' may not start {', '.join(repr(n) for n in refused)}: the agents: list in "
            f"{parent.spec.path} names only {', '.join(granted) or 'none'}; add the agent there to grant it"
        )


def granted_tools(parent: AgentSpec, child: AgentSpec) -> tuple[AgentSpec, dict[str, str]]:
    """The child as its parent may run it: its tools capped at the parent's, unless the parent's
    `agents:` list grants it its full tools (`worker!`); and, per tool it lost, the error its calls get."""
    if child.name in parent.full_tools_for:
        return child, {}
    kept = tuple(tool for tool in child.tools if tool in parent.tools)
    if kept == child.tools:
        return child, {}
    why = (
        f"Error: {{tool}} is not available to '{child.name}' here: its parent '{parent.name}' lacks it, and a "
        f"sub-agent's tools never exceed its parent's without a grant (agents: [{child.name}!] in {parent.path})"
    )
    lost = {tool: why.format(tool=tool) for tool in child.tools if tool not in kept}
    return child.model_copy(update={"tools": kept}), lost


def withhold(task: PreparedTask, denied: Mapping[str, str]) -> PreparedTask:
    """A saved child continued as its parent ran it: the tools its parent withheld stay withheld (each
    call gets the error it got then), since a continuation prepares the agent again from its file."""
    if not denied:
        return task
    spec = task.spec.model_copy(update={"tools": tuple(t for t in task.spec.tools if t not in denied)})
    return replace(task, spec=spec, denied={**task.denied, **denied})
