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

Each rule has a module of its own; the preparer applies them in that order: `tool_grants.py` (the
tools a parent passes on, a call's narrowing, plan mode), `model_choice.py` (the model and the models a
call may name), `project_files.py` (the settings files' hooks, skills, memory and the project's
instructions, each read once per runner, a project's after the user's consent), `agent_mcp.py` (an
agent's MCP servers, a project's started after consent) and `isolation.py`. What it yields is in
`prepared.py`.

It also decides each task's bash sandbox (`sandbox_for`): the run's `--sandbox`, else the agent's file,
else on for a project agent; a sandboxed parent's children are sandboxed too. The network: the run's
`--network`, else a built-in or user agent's `network: allow` (a project file's never counts); a child
has it only if its parent does. A continued task keeps the sandbox it ran with (`keep_sandbox`).

The preparer also owns what resolution keeps for the runner's life: the consent given and its `HostPool`
(one host per model, the resident models sharing one KV budget; `hosts.py`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from ..agents.discovery import AgentCatalog
from ..agents.limits import DEFAULT_MAX_TURNS, Limits
from ..agents.prompt import system_prompt
from ..agents.schema_output import check_schema
from ..agents.session_tools import session_tools
from ..agents.skills import SkillChoice, choose_skills
from ..agents.spec import AgentSpec, sandbox_default
from ..caps import CapItem, check_request
from ..errors import AgentNotFoundError, InputTooLargeError, RequestError
from ..home import state_home
from ..host.protocol import DEFAULT_THINKING_TOKENS, ModelHost, ProcessorFactory, ToolSchema
from ..tools import Sandbox, Tool, Workspace
from ..tools.mcp import McpServers
from ..tools.mcp_config import McpServerConfig
from ..tools.mcp_requests import ClientPolicy
from .agent_mcp import AgentMcp, with_servers
from .consent import Consent
from .hosts import HostPool
from .isolation import isolation_of
from .model_choice import ModelChoice
from .model_grants import check_fits, check_granted
from .options import RunOptions
from .prepared import Parent, PreparedTask, SetUpFailure
from .project_files import ProjectFiles
from .tasks import ModelRef, TaskSpec
from .tool_grants import check_grant, granted_tools, narrowed, plan_tools

T = TypeVar("T")


class Unanswered(Exception):
    """A consent question the preparer's `ask` has not answered yet: asked, then the request prepared again."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


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
        # Receives one line per settings problem that blocks nothing (project hooks not allowed).
        self.on_warning: Callable[[str], None] = lambda _line: None
        # A task's `subagent` and background tools, as its session gets them (the runner makes them).
        self.board_tools: Callable[[PreparedTask], dict[str, Tool]] = lambda _task: {}
        self.cwd = cwd or Path.cwd()
        self.consent = Consent(
            everything=options.assume_yes,
            agents=options.assume_yes or options.yes_agents,
            interactive=interactive,
            confirm=self.confirm,
            on_warning=lambda line: self.on_warning(line),
        )
        self.models = ModelChoice(options, self.pool, lambda line: self.on_warning(line))
        self.project = ProjectFiles(options, self.cwd, self.consent, lambda line: self.on_warning(line))
        mcp = McpServers(self.cwd, log_dir=state_home() / "logs", policy=ClientPolicy(options.assume_yes))
        self.mcp = AgentMcp(self.cwd, mcp, self.consent)
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
        model = self.models.model_for(spec, task.model, inherited=parent.model if parent else None)
        if delegated or parent is not None:
            if task.model and not self.options.engine:  # a model the call chose: only a granted one
                check_granted(task.model, self.models.granted_models(parent), parent.spec if parent else None)
            self.models.check_local(model, named=bool(task.model))
        skills = choose_skills(
            spec.skills, self.project.usable_skills(self.catalog.skills), parent.skills if parent else None
        )
        if task.single_shot:  # one reply: nothing to load a skill with
            skills = SkillChoice()
        self.mcp.allow(spec)
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
        workspace, memory = self.project.memory(spec, workspace)
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
            hooks=self.project.settings_hooks(workspace.root) + spec.hooks,
            parent=parent.label if parent else None,
            context="\n\n".join(filter(None, (self.project.project_context(spec, workspace), memory))),
            skills=resolved.skills,
            mcp_tools=await self.mcp.tools(spec, workspace),
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
        (`task_tools.board_tools`); a call of it anyway gets this error."""
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

    @property
    def hosts(self) -> dict[ModelRef, ModelHost]:
        """The resident hosts by model (the pool's: a shared pool's are every client's)."""
        return self.pool.hosts

    def model_for(self, spec: AgentSpec, override: str | None = None, inherited: ModelRef | None = None) -> ModelRef:
        """A task's model (`ModelChoice.model_for`)."""
        return self.models.model_for(spec, override, inherited)

    def granted_models(self, parent: Parent | None) -> tuple[str, ...]:
        """The models a call of `parent` may name for a child (`ModelChoice.granted_models`)."""
        return self.models.granted_models(parent)

    def offered_models(self, parent: Parent | None) -> tuple[str, ...]:
        """The granted models a call's schema offers by name (`ModelChoice.offered_models`)."""
        return self.models.offered_models(parent)

    def runs_on(self, parent: Parent | None, agents: Sequence[str]) -> list[tuple[str, str, str]]:
        """What each of `agents` runs on as `parent`'s child when the call names no model, and why."""
        return self.models.runs_on(parent, [(name, self.catalog.get(name)) for name in agents])

    async def host_for(self, model: ModelRef) -> ModelHost:
        """The resident host for a model, loaded (or, on an engine, reached) on first use."""
        return await self.pool.get(model)

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


def _per_task(workspace: Workspace | Sequence[Workspace], n_tasks: int) -> list[Workspace]:
    return [workspace] * n_tasks if isinstance(workspace, Workspace) else list(workspace)
