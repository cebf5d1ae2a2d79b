"""The one path from a task to what runs it: agent, grants, caps, schema, model, host, prompt fit.

Every way a task starts comes through `Preparer`: the four modes, a background start, a chat's
task, a saved task continued and every delegated child. Each is checked by the same rules in the
same order, the cheap checks of the whole request first, so that nothing loads when a check fails:

    agent     the catalog's agent, after the user's consent for a project agent (once per agent)
    grants    the parent's `agents:` list; the child's tools capped at the parent's; in plan mode (its
              own, its parent's or the run's) only the read-only tools
    caps      task and request sizes (`caps.check_request`)
    schema    the task's or the agent's output schema is a valid JSON schema
    model     the task's own, `--model`, the agent's, the parent's, `$MLX_SUBAGENTS_MODEL`, the default;
              a delegated child's own must be granted (`model_grants.py`) and on this machine (never
              downloaded mid-delegation); one not resident yet must fit the memory the others leave
    host      the resident host of that model, loaded (or reached) on first use
    fit       the agent's system prompt takes at most half the model's context window
    isolation the task's `isolation`, else its agent's; `worktree` only where a worktree can be made
              (git, a repository with a commit, nothing in progress): else one line, never the shared tree

It also hands each task its hooks (`settings_hooks`, read once per runner): the user's settings file's,
the project's after the user's consent (as for project agents), then the agent file's own.

It also decides each task's bash sandbox (`sandbox_for`): the run's `--sandbox`, else the agent's file,
else on for a project agent; a sandboxed parent's children are sandboxed too. The network: the run's
`--network`, else a built-in or user agent's `network: allow` (a project file's never counts); a child
has it only if its parent does. A continued task keeps the sandbox it ran with (`keep_sandbox`).

The preparer also owns what resolution keeps for the runner's life: the consent given, its `HostPool`
(one host per model, the resident models sharing one KV budget; `hosts.py`) and the project's instructions per workspace
(so every session's prompt is byte-identical).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from ..agents.context import ProjectContext, load_project_context
from ..agents.discovery import AgentCatalog
from ..agents.hooks import (
    SETTINGS_FILE,
    Hooks,
    find_project_settings,
    load_settings_hooks,
    project_hooks,
    read_settings,
)
from ..agents.memory import memory_block, memory_folder, start_memory
from ..agents.schema_output import check_schema
from ..agents.session import DEFAULT_MAX_TURNS, Limits, session_tools, system_prompt
from ..agents.skills import SkillChoice, choose_skills
from ..agents.spec import AgentSpec, remote_model, sandbox_default
from ..caps import CapItem, check_request
from ..errors import AgentNotFoundError, ConfirmationRequired, InputTooLargeError, RequestError
from ..home import state_home
from ..host.mlx.loading import resolve_model_path
from ..host.protocol import DEFAULT_THINKING_TOKENS, ModelHost, ProcessorFactory, ToolSchema
from ..tools import MEMORY_TOOLS, READ_ONLY_TOOLS, Sandbox, Tool, Workspace
from ..tools.mcp import (
    PREFIX,
    McpServerConfig,
    McpServers,
    agent_servers,
    load_config,
    matches,
    parse_server,
    pattern_server,
)
from ..tools.mcp_requests import ClientPolicy
from ..tools.skill import Skill
from .consent import Consent
from .hosts import HostPool
from .model_grants import check_fits, check_granted, granted_models, imported_names, on_this_machine
from .options import RunOptions
from .tasks import SCRIPTED, ModelRef, TaskSpec, default_model
from .worktrees import check_isolation

T = TypeVar("T")


class Unanswered(Exception):
    """A consent question the preparer's `ask` has not answered yet: asked, then the request prepared again."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


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
    sandbox: Sandbox | None = None
    plan: bool = False
    # The skills it is offered: its children are offered no others.
    skills: tuple[str, ...] = ()
    # Its own prepared task, which a fork of it continues (None: a parent outside the runner's plans).
    task: PreparedTask | None = None


@dataclass(frozen=True)
class PreparedTask:
    """A task checked and resolved, its model loaded: what a plan, a handle or a child runs.

    Args:
        task: the task as asked (its label final: `parent > scout` for a child).
        spec: the agent as its parent may run it (tools capped at the parent's).
        denied: tools its file grants that its parent may not pass on, with the error a call gets.
        depth: how many parents it has (0: started by a person).
        context: the project's instructions for its system prompt.
        sandbox: where its `bash` may write and whether it has network (None: unsandboxed).
        plan: it runs in plan mode (read-only tools), and so do its children.
        hooks: the hooks that fire for it (the settings files', then its own file's).
        parent: its parent's label (None: started by a person).
        skills: the skills it is offered (and preloads).
        isolation: `worktree`: it runs in a worktree of its own, made when it starts (`runs/worktrees.py`).
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
    sandbox: Sandbox | None = None
    plan: bool = False
    hooks: Hooks = field(default_factory=Hooks)
    parent: str | None = None
    skills: SkillChoice = field(default_factory=SkillChoice)
    # The MCP tools it may call (`mcp__<server>__<tool>`), on the runner's running servers.
    mcp_tools: dict[str, Tool] = field(default_factory=dict)
    isolation: str = "none"

    @property
    def label(self) -> str:
        return self.task.label

    def as_parent(self, run_folder: Path | None) -> Parent:
        """This task as the parent of the children it delegates to."""
        return Parent(
            self.spec,
            self.label,
            self.depth,
            self.model,
            run_folder,
            self.limits.thinking,
            sandbox=self.sandbox,
            plan=self.plan,
            skills=self.skills.names(),
            task=self,
        )


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
    skills: SkillChoice
    plan: bool = False


class Preparer:
    """Resolves tasks for one runner, and holds its consent, hosts and project instructions.

    Args:
        catalog: the agents tasks may name.
        interactive, confirm: whether a person can be asked before a project agent runs, and how.
        ask: asks a person through a front end that must not block its event loop (a client of
            `subagent serve`): when given, a question is asked there, then the request is prepared
            again from the start with the answer (nothing has run before a question).
        processor_factory: logits processors for every real host (the test kit's forced scripts).
        hosts: hosts the caller made itself, by model (an in-memory `ScriptedHost`, another runner's
            hosts): started at their first use like ours (`start` is idempotent), never stopped here.
        pool: the resident hosts to take models from (`subagent serve`'s, shared with other runners);
            None: a pool of its own, made from `options`, stopped at `close`.
    """

    def __init__(
        self,
        options: RunOptions,
        catalog: AgentCatalog,
        *,
        interactive: bool = False,
        confirm: Callable[[str], bool] | None = None,
        ask: Callable[[str], Awaitable[bool]] | None = None,
        processor_factory: ProcessorFactory | None = None,
        hosts: dict[ModelRef, ModelHost] | None = None,
        cwd: Path | None = None,
        pool: HostPool | None = None,
    ) -> None:
        self.options = options
        self.catalog = catalog
        self.interactive = interactive
        self.ask = ask
        self._answers: dict[str, bool] = {}  # the questions `ask` answered, by their text
        self.confirm = self._answered if ask is not None else confirm
        self.processor_factory = processor_factory
        self._own_pool = pool is None
        self.pool = pool or HostPool(options, processor_factory, hosts)
        self._network_refused: set[str] = set()  # project agents told once that their `network: allow` is not honoured
        self._engine_refused: set[str] = set()  # project agents told once that their `engine:` is not honoured
        self._contexts: dict[Path, ProjectContext] = {}
        self._hooks: Hooks | None = None
        # Receives one line per settings problem that blocks nothing (project hooks not allowed).
        self.on_warning: Callable[[str], None] = lambda _line: None
        # A task's `subagent` and background tools, as its session gets them (the runner makes them).
        self.board_tools: Callable[[PreparedTask], dict[str, Tool]] = lambda _task: {}
        self._memories: dict[tuple[Path, bool], str] = {}
        self._project_skills: bool | None = None  # the user's answer about project skills, once asked
        self.cwd = cwd or Path.cwd()
        self.mcp = McpServers(self.cwd, log_dir=state_home() / "logs", policy=ClientPolicy(options.assume_yes))
        self.consent = Consent(
            everything=options.assume_yes,
            agents=options.assume_yes or options.yes_agents,
            interactive=interactive,
            confirm=self.confirm,
            on_warning=lambda line: self.on_warning(line),
        )
        self._mcp_config: dict[str, McpServerConfig] | None = None
        self._mcp_unreadable = False  # a configuration file (or a server in it) could not be read
        self._mcp_allowed: set[str] = set()  # project servers the user allowed to start
        # MCP servers a client brings (an editor's `session/new`): the top-level agents get them, after
        # the consent a project's `.mcp.json` needs (they are marked `project`).
        self.client_servers: list[McpServerConfig] = []

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
        where = {"workspace": workspace, "parent": parent, "shared_input": shared_input, "delegated": delegated}
        return await self._asking(lambda: self._prepare(tasks, **where))  # type: ignore[arg-type]

    async def _prepare(
        self,
        tasks: Sequence[TaskSpec],
        *,
        workspace: Workspace | Sequence[Workspace],
        parent: Parent | None,
        shared_input: str,
        delegated: bool,
    ) -> list[PreparedTask]:
        places = _per_task(workspace, len(tasks))
        resolved = [
            self.fork_of(t, parent, w) if t.fork else self._resolve(t, parent, delegated) for t, w in zip(tasks, places)
        ]
        check_request([CapItem(r.task.label, r.task.task, r.spec) for r in resolved], shared_input)
        loaded = [
            r if isinstance(r, PreparedTask) else await self._load(r, parent, w, delegated)
            for r, w in zip(resolved, places)
        ]
        for fit in {(p.spec.name, p.host.model_id): p for p in loaded if not p.task.fork}.values():
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
        place, and so is a task the parent's grants refuse. The request's size, and an output schema of
        its own that is not a valid JSON schema (a call's mistake, not a child's), still refuse it whole."""
        where = {"workspace": workspace, "parent": parent, "delegated": delegated}
        return await self._asking(lambda: self._prepare_each(tasks, **where))  # type: ignore[arg-type]

    async def _prepare_each(
        self,
        tasks: Sequence[TaskSpec],
        *,
        workspace: Workspace | Sequence[Workspace],
        parent: Parent | None,
        delegated: bool,
    ) -> list[PreparedTask | SetUpFailure]:
        for task in tasks:
            if task.schema is not None:
                check_schema(task.schema, f"output schema of task '{task.label}'")
        out: list[PreparedTask | SetUpFailure] = []
        for task, place in zip(tasks, _per_task(workspace, len(tasks))):
            model = ""
            try:
                if task.fork:
                    out.append(self.fork_of(task, parent, place))
                    continue
                resolved = self._resolve(task, parent, delegated)
                model = str(resolved.model)
                prepared = await self._load(resolved, parent, place, delegated)
                await self.check_prompt_fits(prepared)
                out.append(prepared)
            except Unanswered:
                raise
            except Exception as exc:
                out.append(SetUpFailure(task, model, exc))
        ready = [p for p in out if isinstance(p, PreparedTask)]
        if ready:
            check_request([CapItem(p.label, p.task.task, p.spec) for p in ready])
        return out

    async def _asking(self, work: Callable[[], Awaitable[T]]) -> T:
        """`work`, done again after each question it raised is answered through `ask`."""
        while True:
            try:
                return await work()
            except Unanswered as question:
                assert self.ask is not None
                self._answers[question.text] = bool(await self.ask(question.text))

    def _answered(self, question: str) -> bool:
        """The `confirm` of a preparer that asks through `ask`: the answer given, else `Unanswered`."""
        if question not in self._answers:
            raise Unanswered(question)
        return self._answers[question]

    # -- the steps ---------------------------------------------------------------------------------------

    def fork_of(self, task: TaskSpec, parent: Parent | None, workspace: Workspace) -> PreparedTask:
        """A fork's prepared task: its parent's, continued (the same agent as its parent may run it,
        tools, withheld tools, model, host, thinking, sandbox, hooks and skills), one level below it,
        in `workspace` (the parent's or a folder in it); its prompt is its parent's conversation."""
        if parent is None or parent.task is None:
            raise RequestError("a fork continues the session that asks for it; name an agent instead")
        base = parent.task
        schema = base.schema
        if task.schema is not None:  # its call's schema for its answer (its prompt's prefix stays its parent's)
            check_schema(task.schema, f"output schema of task '{task.label}'")
            schema = task.schema
        return replace(
            base,
            task=replace(task, agent=base.spec.name, model=None),
            workspace=base.workspace if workspace.root == base.workspace.root else workspace,
            limits=replace(base.limits, turns_before=0, answer_schema=schema if base.limits.grammar else None),
            schema=schema,
            depth=parent.depth + 1,
            parent=parent.label,
            isolation="none",
        )

    def _resolve(self, task: TaskSpec, parent: Parent | None, delegated: bool = False) -> _Resolved:
        spec = self.agent(task.agent, parent)
        if parent is None and self.client_servers:  # before plan mode, which takes their tools away too
            spec = with_servers(spec, self.client_servers)
        denied: dict[str, str] = {}
        plan = self.options.plan or spec.permission == "plan" or (parent is not None and parent.plan)
        if plan:  # first, so that a tool plan mode takes away is refused for that reason
            spec, denied = plan_tools(spec, denied)
        if parent is not None:
            spec, lost = granted_tools(parent.spec, spec)
            denied = {**lost, **denied}
        spec = narrowed(spec, task, denied)
        if task.thinking is not None and (delegated or parent is not None):
            self.check_thinking(spec, task, parent)
        schema = task.schema if task.schema is not None else spec.output_schema
        if schema is not None:
            check_schema(schema, f"output schema of task '{task.label}'")
        model = self.model_for(spec, task.model, inherited=parent.model if parent else None)
        if delegated or parent is not None:
            if task.model and not self.options.engine:  # a model the call chose: only a granted one
                check_granted(task.model, self.granted_models(parent), parent.spec if parent else None)
            self.check_local(model, named=bool(task.model))
        skills = choose_skills(spec.skills, self.usable_skills(), parent.skills if parent else None)
        if task.single_shot:  # one reply: nothing to load a skill with
            skills = SkillChoice()
        self.allow_mcp_servers(spec)
        return _Resolved(task, spec, denied, schema, model, skills, plan)

    async def _load(
        self, resolved: _Resolved, parent: Parent | None, workspace: Workspace, delegated: bool = False
    ) -> PreparedTask:
        spec, task = resolved.spec, resolved.task
        limits, timeout = self.limits(spec, task, parent), task.timeout or self.options.timeout
        if delegated:  # a caller's own limits narrow what the task would have, never widen it
            limits = replace(limits, max_turns=min(limits.max_turns, self.limits(spec, None, parent).max_turns))
            timeout = min((t for t in (task.timeout, self.options.timeout) if t), default=None)
        if task.single_shot:
            limits = replace(limits, max_turns=1)
        if limits.grammar and resolved.schema is not None:  # the answer is held to its schema too
            limits = replace(limits, answer_schema=resolved.schema)
        workspace, memory = self.memory(spec, workspace)
        depth = parent.depth + 1 if parent else 0
        check_fits(resolved.model, self.hosts)  # before it loads: weights that do not fit are one line
        return PreparedTask(
            task=task,
            spec=spec,
            model=resolved.model,
            host=await self.host_for(resolved.model),
            workspace=workspace,
            limits=limits,
            depth=depth,
            timeout=timeout,
            schema=resolved.schema,
            denied={**resolved.denied, **self.depth_denial(spec, depth)},
            sandbox=self.sandbox_for(spec, workspace, parent),
            plan=resolved.plan,
            hooks=self.settings_hooks(workspace.root) + spec.hooks,
            parent=parent.label if parent else None,
            context="\n\n".join(filter(None, (self.project_context(spec, workspace), memory))),
            skills=resolved.skills,
            mcp_tools=await self.mcp_tools(spec, workspace),
            isolation=isolation_of(spec, task, workspace, None if parent or delegated else self.options.isolation),
        )

    def check_thinking(self, spec: AgentSpec, task: TaskSpec, parent: Parent | None) -> None:
        """Refuse a delegated task's thinking budget over the one it would have: a call only narrows it."""
        budget = self.limits(spec, replace(task, thinking=None), parent).thinking
        if task.thinking is not None and task.thinking > budget:
            raise RequestError(
                f"task '{task.label}': thinking {task.thinking} is more than the {budget} tokens per reply "
                f"'{spec.name}' may think here; ask for at most {budget} (0: off), or leave thinking out"
            )

    def depth_denial(self, spec: AgentSpec, depth: int) -> dict[str, str]:
        """At the depth limit (or with `--max-depth 0`) an agent granted `subagent` is not offered it
        (`Runner.board_tools`); a call of it anyway gets this error."""
        max_depth = self.options.max_depth
        if "subagent" not in spec.tools or depth < max_depth:
            return {}
        return {
            "subagent": f"Error: delegation refused: this agent already runs at depth {depth} and the limit is "
            f"{max_depth} (max_depth); do the task yourself with your other tools"
        }

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
        if spec.source == "project":  # asked once per agent, not once per task
            self.consent.agent(spec.name, spec.path)
        return spec

    def sandbox_for(self, spec: AgentSpec, workspace: Workspace, parent: Parent | None = None) -> Sandbox | None:
        """The task's bash sandbox, None for none: the run's `--sandbox`, else the agent file's `sandbox:`,
        else on for a project agent (a project file may turn it on, never off: only the user can), and
        always on below a sandboxed parent. Its network: `network_for`, and a child's only if its
        parent has it. It writes in its tool's workspace, wherever that is (`make_tools`)."""
        on = self.options.sandbox
        if on is None:
            on = sandbox_default(spec) or (parent is not None and parent.sandbox is not None)
        if not on:
            return None
        network = self.network_for(spec) and (parent is None or parent.sandbox is None or parent.sandbox.network)
        return Sandbox(network=network)

    def network_for(self, spec: AgentSpec) -> bool:
        """Whether the agent's sandboxed bash keeps the network: the run's `--network`, else its file's
        `network: allow` when the user wrote that file (a built-in or user agent). A project file's is
        one warning and no network: like `sandbox: off`, it takes the user's word."""
        if self.options.network is not None:
            return self.options.network
        if spec.network and spec.source == "project":
            if spec.name not in self._network_refused:
                self._network_refused.add(spec.name)
                self.on_warning(
                    f"{spec.path}: 'network: allow' comes with the project, which cannot grant itself the network; "
                    "its bash runs without it (give it with --network allow)"
                )
            return False
        return spec.network

    def settings_hooks(self, root: Path) -> Hooks:
        """The settings files' hooks, read at the first task and kept for the runner's life: the user's
        (`$MLX_SUBAGENTS_HOME/settings.json`), then the project's (`.mlx-subagents/settings.json`,
        `.claude/settings.json` at or above the runner's folder, unless `--scope user`) once the user
        allows them: they come with the workspace and run commands, as a project agent does. Project
        hooks not allowed are left out with one warning; the run goes on. A project file is parsed as
        JSON to see whether it has hooks, and its hooks are checked only once allowed: each problem in it
        is one warning and the run goes on without that part; the user's own file is strict."""
        if self._hooks is not None:
            return self._hooks
        warnings: list[str] = []
        user = state_home() / SETTINGS_FILE
        hooks = load_settings_hooks(user, warnings)
        if self.options.scope != "user":
            user_level = {user.resolve(), (Path.home() / ".claude" / SETTINGS_FILE).resolve()}
            for path in find_project_settings((self.cwd or root).resolve(), user_level):
                if (found := read_settings(path, warnings)) is None:  # no hooks, or one warning
                    continue
                if not self.consent.hooks(path):
                    warnings.append(
                        f"the hooks in {path} did not run: they come with the project; re-run with --yes to allow them"
                    )
                    continue
                section, text = found
                hooks += project_hooks(section, path, text, warnings)  # checked only after consent
        self._hooks = hooks
        for line in warnings:
            self.on_warning(line)
        return hooks

    def usable_skills(self) -> dict[str, Skill]:
        """The skills agents may be offered: every user skill, and the project's once the user allowed them
        (`--yes`, or asked once): they come with the workspace, are instructions and may name scripts."""
        skills = self.catalog.skills
        project = [s.name for s in skills.values() if s.source == "project"]
        if project and self._project_skills is None:
            where = ", ".join(sorted({str(s.folder.parent) for s in skills.values() if s.source == "project"}))
            self._project_skills = self.consent.skills(", ".join(project), where)
        return {n: s for n, s in skills.items() if s.source != "project" or self._project_skills}

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

    def runs_on(self, parent: Parent | None, agents: Sequence[str]) -> list[tuple[str, str, str]]:
        """What each of `agents` runs on as `parent`'s child when the call names no model, and why."""
        options, inherited = self.options, parent.model if parent else None
        rows = []
        for name in agents:
            spec = self.catalog.get(name)
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

    async def host_for(self, model: ModelRef) -> ModelHost:
        """The resident host for a model, loaded (or, on an engine, reached) on first use."""
        return await self.pool.get(model)

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

    def memory(self, spec: AgentSpec, workspace: Workspace) -> tuple[Workspace, str]:
        """`(the workspace its tools get, its memory's part of the system prompt)`: with `memory:`, the
        head of its `MEMORY.md` (read once per run, so every session's prompt is byte-identical), and,
        for an agent that can edit files, its memory folder opened to its tools."""
        if spec.memory is None:
            return workspace, ""
        folder = memory_folder(spec.memory, spec.name, workspace.root)
        writable = any(tool in spec.tools for tool in MEMORY_TOOLS)
        key = (folder, writable)
        if key not in self._memories:
            if writable:
                start_memory(folder, spec.name)
            self._memories[key] = memory_block(folder, writable, workspace.root)
        return (replace(workspace, memory=folder) if writable else workspace), self._memories[key]

    def project_context(self, spec: AgentSpec, workspace: Workspace) -> str:
        """The project's instructions for an agent's system prompt, read once per workspace (so every
        session's prompt is byte-identical); "" for an agent with `context: none`."""
        if spec.context == "none":
            return ""
        if workspace.root not in self._contexts:
            self._contexts[workspace.root] = load_project_context(workspace.root)
        return self._contexts[workspace.root].text

    def mcp_servers(self, spec: AgentSpec) -> list[McpServerConfig]:
        """The MCP servers an agent may use: those its tools name (`mcp__github__*`, by default those its
        `mcpServers:` names or defines); inline definitions first, then `.mcp.json`, then the home's
        `mcp.json`, read only now that an agent names a server. A name defined nowhere is one warning,
        its tools absent; a file or server that cannot be read is one warning too (`load_config`)."""
        if not spec.mcp_inline and not any(pattern_server(tool) for tool in spec.tools):
            return []  # no configuration file is read for an agent that names no server
        if self._mcp_config is None:
            problems: list[str] = []
            self._mcp_config = load_config(self.cwd, warnings=problems)
            self._mcp_unreadable = bool(problems)
            for line in problems:
                self.mcp.warn(line)
        servers, missing = agent_servers(spec.tools, spec.mcp_inline, self._mcp_config)
        for name in missing:
            if self._mcp_unreadable:  # its file's warning said so: no second line for it
                self.mcp.failed.setdefault(name, "left out")
            if name not in self.mcp.failed:
                self.mcp.failed[name] = "not defined"
                self.mcp.warn(
                    f"{spec.path}: MCP server '{name}' is not defined in .mcp.json, the home's mcp.json or "
                    "mcpServers:; its tools are not offered"
                )
        return servers

    def allow_mcp_servers(self, spec: AgentSpec) -> None:
        """Ask once before a project `.mcp.json` starts processes, as for a project agent: `--yes`, or the
        prompt, naming the servers it starts; without either, nothing starts and the task is refused."""
        servers = [c for c in self.mcp_servers(spec) if c.project and c.name not in self._mcp_allowed]
        if not servers:
            return
        where = servers[0].where
        source = where if where == CLIENT_SERVERS else f"the project file {where}"
        names = ", ".join(c.summary() for c in servers)
        origin = f"{source} starts MCP server(s) {names} for agent '{spec.name}'"
        answer = self.consent.mcp_servers(f"mcp {where} {names}", origin)
        if answer is None:
            raise ConfirmationRequired(f"{origin}; they run unsandboxed, as you. Re-run with --yes to allow it.")
        if not answer:
            raise ConfirmationRequired(f"the MCP servers of {where} were not allowed to start (declined).")
        self._mcp_allowed.update(c.name for c in servers)

    async def mcp_tools(self, spec: AgentSpec, workspace: Workspace) -> dict[str, Tool]:
        """The MCP tools an agent's file grants, its servers started on first use (shared by the runner's agents)."""
        if not (servers := self.mcp_servers(spec)):
            return {}
        tools = await self.mcp.tools_for(servers, workspace)
        return {name: tool for name, tool in tools.items() if spec.grants(name)}

    async def check_prompt_fits(self, task: PreparedTask) -> None:
        """Refuse an agent whose system prompt and tools (their schemas are in every prompt) take more
        than half the model's context window (the rest is for the work), naming the numbers and what
        to shorten."""
        spec, host = task.spec, task.host
        prompt = system_prompt(spec, task.context, task.skills, host.context_window)
        system = [{"role": "system", "content": prompt}]
        schemas = self.tool_schemas(task)
        n_tokens = await host.count_tokens(system, schemas or None)
        if n_tokens > host.context_window // 2:
            n_prompt = await host.count_tokens(system)
            tools = f" and {len(schemas)} tool{'s' if len(schemas) > 1 else ''}" if schemas else ""
            fix = f"shorten the body of {spec.path}" + (" or grant it fewer tools" if schemas else "")
            raise InputTooLargeError(
                f"agent '{spec.name}' has a system prompt{tools} of {n_tokens:,} tokens ({n_prompt:,} of them the "
                f"prompt), over half the context window of {host.context_window:,} tokens of {host.model_id}; {fix}"
            )

    def tool_schemas(self, task: PreparedTask) -> list[ToolSchema]:
        """The schemas of the tools the task's session will offer (`session_tools`)."""
        extra = {**task.mcp_tools, **self.board_tools(task)}
        tools = session_tools(task.spec, task.workspace, task.sandbox, extra, task.skills)
        return [tool.schema() for tool in tools.values()]

    def limits(self, spec: AgentSpec, task: TaskSpec | None = None, parent: Parent | None = None) -> Limits:
        """A task's limits: its own, else the run's, else the agent's, else the defaults; its thinking
        budget: the run's, else the agent's, else its parent's (a parent's reasoning setting reaches
        the children that set none), else the default."""
        options = self.options
        inherited = parent.thinking if parent is not None else None
        thinking = (task.thinking if task else None, options.thinking, spec.thinking, inherited)
        return Limits(
            max_turns=(task and task.max_turns) or options.max_turns or spec.max_turns or DEFAULT_MAX_TURNS,
            max_output_tokens=(task and task.max_output_tokens) or options.max_output_tokens,
            thinking=next((t for t in thinking if t is not None), DEFAULT_THINKING_TOKENS),
            grammar=next((g for g in (options.grammar, spec.grammar) if g is not None), True),
        )

    async def close(self) -> None:
        """Stop the hosts this preparer started (the caller's own, and a shared pool's, stay as they are)."""
        if self._own_pool:
            await self.pool.close()
        await self.mcp.close()


def isolation_of(spec: AgentSpec, task: TaskSpec, workspace: Workspace, run: str | None = None) -> str:
    """A task's isolation: the call site's (the task's own, else the run's `--isolation`), else its agent
    file's; `worktree` checked here, so that a request that cannot be isolated is refused whole before
    anything starts."""
    isolation = task.isolation or run or spec.isolation or "none"
    if isolation == "worktree":
        check_isolation(workspace.root)
    return isolation


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
    kept = tuple(_kept_mcp(child.tools, parent))
    # Whatever the parent may not call, the child may not either (its denials pass down).
    mcp_denied = tuple(dict.fromkeys(child.mcp_denied + parent.mcp_denied))
    if kept == child.tools and mcp_denied == child.mcp_denied:
        return child, {}
    why = (
        f"Error: {{tool}} is not available to '{child.name}' here: its parent '{parent.name}' lacks it, and a "
        f"sub-agent's tools never exceed its parent's without a grant (agents: [{child.name}!] in {parent.path})"
    )
    lost = {tool: why.format(tool=tool) for tool in child.tools if tool not in kept}
    return child.model_copy(update={"tools": kept, "mcp_denied": mcp_denied}), lost


def _kept_mcp(tools: tuple[str, ...], parent: AgentSpec) -> list[str]:
    """A child's tools within its parent's: a built-in one if the parent has it; an MCP name if the
    parent may call it; a child's `mcp__s__*` narrowed to the parent's names on `s` (never widened)."""
    kept: list[str] = []
    for tool in tools:
        if not tool.startswith("mcp__"):
            narrowed = [tool] if tool in parent.tools else []
        elif tool.endswith("__*") and not any(matches(tool, p) or p == tool for p in parent.tools):
            narrowed = [p for p in parent.tools if p.startswith("mcp__") and matches(p, tool)]
        else:
            narrowed = [tool] if tool in parent.tools or parent.grants(tool) else []
        kept.extend(t for t in narrowed if t not in kept)
    return kept


# Where a client's MCP servers are said to come from (`McpServerConfig.where`), in the consent question.
CLIENT_SERVERS = "the editor's session"


def client_servers(definitions: Mapping[str, Any]) -> list[McpServerConfig]:
    """A client's MCP servers (`{name: definition}`, as `.mcp.json` writes them), marked the project's:
    they start after the same consent; each problem is one line naming the server."""
    return [parse_server(name, value, CLIENT_SERVERS, project=True) for name, value in definitions.items()]


def with_servers(spec: AgentSpec, servers: Sequence[McpServerConfig]) -> AgentSpec:
    """The agent with a client's MCP servers (an editor's, `subagent acp`): defined inline (over a
    configured server of the same name) and granted whole (`mcp__<name>__*`)."""
    grants = tuple(f"{PREFIX}{c.name}__*" for c in servers if f"{PREFIX}{c.name}__*" not in spec.tools)
    inline = tuple(c for c in spec.mcp_inline if c.name not in {s.name for s in servers})
    return spec.model_copy(update={"tools": spec.tools + grants, "mcp_inline": (*servers, *inline)})


def narrowed(spec: AgentSpec, task: TaskSpec, denied: Mapping[str, str]) -> AgentSpec:
    """The agent as its task narrows it: its tools to the task's `allowed_tools` (none for a single-shot
    task), its system prompt with the task's addition at its end. A call narrows, never widens: naming a
    tool the agent lacks here (or one its parent withholds) is refused in one line."""
    update: dict[str, Any] = {}
    if task.single_shot:
        update = {"tools": (), "mcp_inline": ()}
    elif task.allowed_tools is not None:
        asked = task.allowed_tools
        if missing := [t for t in asked if t not in spec.tools and not spec.grants(t)]:
            withheld = [t for t in missing if t in denied]
            why = f" (withheld from it here: {', '.join(withheld)})" if withheld else ""
            raise RequestError(
                f"task '{task.label}': allowed_tools names {', '.join(repr(t) for t in missing)}, which "
                f"'{spec.name}' does not have here{why}; its tools are {', '.join(spec.tools) or 'none'}: name only "
                "those, or leave allowed_tools out"
            )
        kept = [t for t in spec.tools if t in asked] + [t for t in asked if t not in spec.tools]
        update = {"tools": tuple(dict.fromkeys(kept))}
        if not any(t.startswith("mcp__") for t in kept):
            update["mcp_inline"] = ()
    if task.system_prompt.strip():
        update["system_prompt"] = f"{spec.system_prompt.rstrip()}\n\n{task.system_prompt.strip()}"
    return spec.model_copy(update=update) if update else spec


def plan_tools(spec: AgentSpec, denied: dict[str, str]) -> tuple[AgentSpec, dict[str, str]]:
    """The agent in plan mode: only its read-only tools (and `subagent`, whose children plan too); a
    call of a tool taken away gets an error saying why."""
    kept = tuple(tool for tool in spec.tools if tool in READ_ONLY_TOOLS or tool == "subagent")
    if kept == spec.tools:
        return spec, denied
    why = (
        "Error: {tool} is not available to '" + spec.name + "' in plan mode, which only looks: no edit, write "
        "or bash; describe the change in your answer instead"
    )
    lost = {tool: why.format(tool=tool) for tool in spec.tools if tool not in kept}
    return spec.model_copy(update={"tools": kept}), {**denied, **lost}


def keep_sandbox(task: PreparedTask, saved: Any) -> PreparedTask:
    """A saved task continued in the sandbox it ran with (its transcript's `sandbox` record): a child
    sandboxed by its parent stays sandboxed when resumed alone, and it keeps the network only if it
    had it then and would have it now. A continuation never widens a task's rights."""
    ran = Sandbox.from_record(saved)
    if ran is None:
        return task
    network = ran.network and (task.sandbox is None or task.sandbox.network)
    return replace(task, sandbox=Sandbox(network=network))


def withhold(task: PreparedTask, denied: Mapping[str, str]) -> PreparedTask:
    """A saved child continued as its parent ran it: the tools its parent withheld stay withheld (each
    call gets the error it got then), since a continuation prepares the agent again from its file."""
    if not denied:
        return task
    spec = task.spec.model_copy(update={"tools": tuple(t for t in task.spec.tools if t not in denied)})
    return replace(task, spec=spec, denied={**task.denied, **denied})
