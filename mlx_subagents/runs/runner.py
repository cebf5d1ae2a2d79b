"""Runs tasks: resolves agents and models, owns the resident hosts, applies limits.

One resident host per model id, started on first use and shared by every task that names that
model. The CLI and Python callers both come through here:

    async with Runner(cwd=".") as runner:
        one = await runner.run(TaskSpec("scout", "where is auth handled?"))
        many = await runner.parallel([TaskSpec("scout", "map auth"), TaskSpec("reviewer", "review db.py")])
        chain = await runner.chain([TaskSpec("scout", "find the parser"), TaskSpec("planner", "plan: {previous}")])
        flow = await runner.workflow("fix-bug", input="the date parser drops time zones")
        more = await runner.resume(one.run_id, "and where is it tested?")
        chat = await runner.open_task("orchestrator")          # a multi-turn task (`subagent chat`)
        first = await chat.ask("where is auth handled?")
        scout = await runner.start(TaskSpec("scout", "map auth"))  # in the background: returns at once
        scout.send("also look at the middleware")               # reaches it at its next turn
        done = await scout.wait()

Every request is checked whole (agents, trust, size caps, workflow graph, models loaded) before any
task starts. Every task is saved as a transcript unless `save_transcripts` is off.

Delegation: an agent whose file grants `subagent` gets the `subagent` tool, whose children run
through this same runner (same hosts, caps and concurrency limit) as `parent > child` labels, one
level deeper; a session at `max_depth` is refused. A child's run is saved inside its parent's run
folder (`runs/<parent-id>/runs/<child-id>/`), so `last` stays the run a person started.

Background tasks (`start`, and `subagent` with `background: true`) run as asyncio tasks on the
runner's loop, on a `TaskBoard` per parent (`runner.board` for top-level ones), sharing the hosts,
batching, KV pool and the process-wide slots with everything else. `close()` cancels what still runs.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Optional

from pydantic import AliasChoices, ConfigDict, Field, TypeAdapter, ValidationError

from ..agents.compaction import CompactionSettings
from ..agents.context import ProjectContext, load_project_context
from ..agents.discovery import AgentCatalog, discover_agents, require_trust
from ..agents.inbox import Inbox
from ..agents.schema_output import check_schema
from ..agents.session import DEFAULT_MAX_TURNS, Limits, system_prompt
from ..agents.spec import AgentSpec
from ..caps import DEFAULT_CONCURRENCY, CapItem, cap_answer, check_concurrency, check_request
from ..errors import InputTooLargeError, RequestError, RunNotFoundError, SubagentError
from ..events import Event, EventSink, ignore_event
from ..host import make_host
from ..host.protocol import DEFAULT_THINKING_TOKENS, ModelHost, ProcessorFactory, TextCallback
from ..results import Mode, MultiRunResult, RunResult
from ..tools import Tool, Workspace
from ..tools.background import make_background_tools
from ..tools.subagent import READ_MORE, Delegation, SubagentTool
from ..userfiles import first_error, load_file
from .board import TaskBoard
from .execution import Execution, Parent, PlannedTask
from .handle import TaskHandle, close_open_tool_calls
from .options import RunOptions
from .slots import Slots, lend
from .transcripts import RunRecorder, TaskEntry, load_run, read_transcript
from .workflow import Workflow, check_agents, find_workflow, load_workflow, render_prompt

DEFAULT_MODEL = "mlx-community/Qwen3-4B-Instruct-2507-4bit"
MODEL_ENV = "MLX_SUBAGENTS_MODEL"
PREVIOUS = "{previous}"


def on_engine(url: str, model: str) -> str:
    """How a task's model names a model id on an engine: `URL MODEL_ID` (a URL holds no space)."""
    return f"{url} {model}"


def split_engine(model: str) -> tuple[str | None, str]:
    """(engine URL or None, model id) of a task's model string."""
    url, space, model_id = model.partition(" ")
    return (url, model_id) if space and url.startswith(("http://", "https://")) else (None, model)


def default_model() -> str:
    return os.environ.get(MODEL_ENV) or DEFAULT_MODEL


PositiveInt = Annotated[Optional[int], Field(gt=0)]


@dataclass(frozen=True)
class TaskSpec:
    """One task to run: which agent, what to do, and optional per-task overrides.

    Built directly by callers; a tasks file is validated into the same class (`load_tasks_file`),
    where `max_tokens` is accepted for `max_output_tokens`, as on the command line.

    Args:
        max_output_tokens: generated tokens over the whole task.
        timeout: wall-clock seconds for the whole task.
        schema: a JSON schema the final answer must satisfy (else the agent's `output_schema`).
    """

    __pydantic_config__ = ConfigDict(extra="forbid")

    agent: Annotated[str, Field(min_length=1)]
    task: Annotated[str, Field(min_length=1)]
    label: str = ""
    model: Optional[str] = None
    max_turns: PositiveInt = None
    max_output_tokens: Annotated[
        Optional[int], Field(gt=0, validation_alias=AliasChoices("max_output_tokens", "max_tokens"))
    ] = None
    timeout: Annotated[Optional[float], Field(gt=0)] = None
    schema: Optional[dict[str, Any]] = None
    step_id: Optional[str] = None


_TASK = TypeAdapter(TaskSpec)


def load_tasks_file(path: Path) -> list[TaskSpec]:
    """Tasks from YAML or JSON: a list of `{agent, task, label?, model?, max_turns?, max_tokens?, timeout?}`,
    or a mapping with that list under `tasks`."""
    data = load_file(Path(path), "yaml", "tasks file", RequestError)
    if isinstance(data, dict) and set(data) == {"tasks"}:
        data = data["tasks"]
    if not isinstance(data, list):
        raise RequestError(
            f"{path}: expected a list of tasks (each with 'agent' and 'task'), or 'tasks:' with that list"
        )
    tasks = []
    for i, item in enumerate(data):
        try:
            tasks.append(_TASK.validate_python(item))
        except ValidationError as exc:
            raise RequestError(f"{path}: {first_error(exc, ('tasks', i))}") from None
    return tasks


def label_tasks(tasks: Sequence[TaskSpec]) -> list[TaskSpec]:
    """Fill in labels: the agent's name, or `agent-N` when several unlabelled tasks share an agent."""
    tasks = [replace(t, agent=t.agent.strip().lower()) for t in tasks]
    shared = Counter(t.agent for t in tasks if not t.label)
    seen: Counter[str] = Counter()
    labelled = []
    for t in tasks:
        if not t.label:
            seen[t.agent] += 1
            t = replace(t, label=f"{t.agent}-{seen[t.agent]}" if shared[t.agent] > 1 else t.agent)
        labelled.append(t)
    duplicates = sorted(label for label, n in Counter(t.label for t in labelled).items() if n > 1)
    if duplicates:
        raise RequestError(f"duplicate task label(s): {', '.join(duplicates)}; give each task its own label")
    return labelled


@dataclass
class Runner:
    """Resolves agents, starts hosts once per model, runs tasks.

    Args:
        options: the run's shared options (model, limits, scope, depth, host settings).
        save_transcripts: write every task under `$MLX_SUBAGENTS_HOME/runs/` (or `home`/runs).
        processor_factory: logits processors for every real host (the test kit's forced scripts).
    """

    cwd: Path
    options: RunOptions = field(default_factory=RunOptions)
    catalog: AgentCatalog | None = None
    interactive: bool = False
    confirm: Callable[[str], bool] | None = None
    compaction: CompactionSettings = field(default_factory=CompactionSettings)
    on_event: EventSink = ignore_event
    save_transcripts: bool = True
    home: Path | None = None
    processor_factory: ProcessorFactory | None = None

    def __post_init__(self) -> None:
        self.cwd = Path(self.cwd).resolve()
        self.workspace = Workspace(self.cwd)
        if self.catalog is None:
            self.catalog = discover_agents(self.cwd, scope=self.options.scope)
        self._hosts: dict[str, ModelHost] = {}
        self._host_lock = asyncio.Lock()
        self._executions: set[Execution] = set()
        self._background: set[Execution] = set()
        self._board: TaskBoard | None = None
        self._started: list[TaskHandle] = []  # every background task, for `close`
        self._trusted: set[str] = set()
        self._slots: Slots | None = None
        self._contexts: dict[Path, ProjectContext] = {}
        self._slots_loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> Runner:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancel the background tasks still running (their transcripts saved), then stop the hosts."""
        for handle in self._started:
            handle.cancel("the runner closed")
        for handle in self._started:
            await handle.join()
        hosts, self._hosts = list(self._hosts.values()), {}
        for host in hosts:
            await host.stop()

    # -- resolution -----------------------------------------------------------------------------------

    def agent(self, name: str) -> AgentSpec:
        """The named agent, after the user's consent if it is a project agent."""
        assert self.catalog is not None
        spec = self.catalog.get(name)
        if spec.name not in self._trusted:  # ask once per agent, not once per task
            require_trust(spec, assume_yes=self.options.assume_yes, interactive=self.interactive, confirm=self.confirm)
            self._trusted.add(spec.name)
        return spec

    def model_for(self, spec: AgentSpec, override: str | None = None, inherited: str | None = None) -> str:
        """A task's own model, else `--model`, else the agent's (its `engine:` and `engine_model:`, or
        its `model:`), else its parent's (`inherited`), else `$MLX_SUBAGENTS_MODEL` or the default.
        With `--engine`, every task's model is a model id on that engine (see `on_engine`)."""
        if self.options.engine:
            model = override or self.options.model or spec.engine_model or split_engine(inherited or "")[1]
            if not model:
                raise RequestError("--engine needs --model, the engine's model id (or engine_model: in the agent file)")
            return on_engine(self.options.engine, model)
        if not (override or self.options.model) and spec.engine and spec.engine_model:
            return on_engine(spec.engine, spec.engine_model)
        return override or self.options.model or spec.model or inherited or default_model()

    def project_context(self, spec: AgentSpec, workspace: Workspace) -> str:
        """The project's instructions for an agent's system prompt, read once per workspace (so every
        session's prompt is byte-identical); "" for an agent with `context: none`."""
        if spec.context == "none":
            return ""
        if workspace.root not in self._contexts:
            self._contexts[workspace.root] = load_project_context(workspace.root)
        return self._contexts[workspace.root].text

    async def check_prompt_fits(self, spec: AgentSpec, host: ModelHost, workspace: Workspace) -> None:
        """Refuse an agent whose system prompt takes more than half the model's context window
        (the rest is for the work), naming the numbers and the file to shorten."""
        prompt = system_prompt(spec, workspace, self.project_context(spec, workspace))
        n_tokens = await host.count_tokens([{"role": "system", "content": prompt}])
        if n_tokens > host.context_window // 2:
            raise InputTooLargeError(
                f"agent '{spec.name}' has a system prompt of {n_tokens:,} tokens, over half the context window of "
                f"{host.context_window:,} tokens of {host.model_id}; shorten the body of {spec.path}"
            )

    @property
    def slots(self) -> Slots:
        """The process-wide slots and writer turns, made in the event loop that uses them."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:
            self._slots, self._slots_loop = Slots(self.options.concurrency), loop
        return self._slots

    async def host_for(self, model: str) -> ModelHost:
        """The resident host for a model, loaded (or, on an engine, reached) on first use."""
        async with self._host_lock:
            if model not in self._hosts:
                kwargs = self.options.host_kwargs()
                engine, model_id = split_engine(model)
                if engine:
                    kwargs.update(engine=engine, api_key=self.options.api_key)
                elif self.processor_factory is not None and not model.startswith("scripted:"):
                    kwargs["processor_factory"] = self.processor_factory
                host = make_host(model_id, **kwargs)
                await host.start()
                self._hosts[model] = host
            return self._hosts[model]

    # -- the four modes --------------------------------------------------------------------------------

    async def run(self, task: TaskSpec) -> RunResult:
        """Run one task and return its result; an unexpected error in it is raised, not returned."""
        outcome = await self._execute("single", label_tasks([task]), concurrency=1, raise_errors=True)
        return outcome.results[0]

    async def parallel(self, tasks: Sequence[TaskSpec], *, concurrency: int = DEFAULT_CONCURRENCY) -> MultiRunResult:
        """Run up to 8 independent tasks, `concurrency` (1-4) at a time; results in input order."""
        check_concurrency(concurrency, engine=bool(self.options.engine))
        return await self._execute("parallel", label_tasks(tasks), concurrency=concurrency)

    async def chain(self, steps: Sequence[TaskSpec]) -> MultiRunResult:
        """Run steps in order, `{previous}` in a step's task being the previous step's answer.

        The chain stops at the first step that does not complete; `error` says where and why.
        """
        tasks, needs, renders = _plan_chain(label_tasks(steps))
        return await self._execute("chain", tasks, concurrency=1, needs=needs, renders=renders)

    async def workflow(
        self, workflow: Workflow | str | Path, input: str = "", *, concurrency: int = DEFAULT_CONCURRENCY
    ) -> MultiRunResult:
        """Run a workflow (a `Workflow`, a TOML file or a named workflow) on an input.

        A step starts as soon as its needs are done; results come back in step order.
        """
        check_concurrency(concurrency, engine=bool(self.options.engine))
        if not isinstance(workflow, Workflow):
            workflow = load_workflow(find_workflow(str(workflow), self.cwd))
        assert self.catalog is not None
        check_agents(workflow, self.catalog)
        from ..agents.schema_output import load_schema

        ids = {step.id: i for i, step in enumerate(workflow.steps)}
        tasks = [
            TaskSpec(
                agent=s.agent,
                task=s.prompt,
                label=s.id,
                model=s.model,
                max_turns=s.max_turns,
                max_output_tokens=s.max_tokens,
                timeout=s.timeout,
                step_id=s.id,
                schema=load_schema(path) if (path := workflow.schema_path(s)) else None,
            )
            for s in workflow.steps
        ]

        def render(step_index: int) -> Callable[[Sequence[RunResult]], str]:
            step = workflow.steps[step_index]
            return lambda results: render_prompt(step, input, {n: results[ids[n]].output for n in step.needs})

        needs = [tuple(ids[n] for n in s.needs) for s in workflow.steps]
        renders = [render(i) for i in range(len(tasks))]
        return await self._execute(
            "workflow", label_tasks(tasks), concurrency=concurrency, needs=needs, renders=renders, shared_input=input
        )

    async def resume(
        self, run_id: str, message: str, *, task: str | None = None, schema: dict[str, Any] | None = None
    ) -> RunResult:
        """Continue a saved task's conversation with a new message: a new generation of that task.

        Args:
            run_id: a run id, a unique prefix of one, or `last`.
            task: the task's label, step id or 1-based position, when the run has several.
        """
        if schema is not None:
            check_schema(schema, "schema")
        handle = await self.reopen(run_id, task=task)
        return await handle.ask(message, schema=schema, timeout=self.options.timeout, raise_errors=True)

    # -- background tasks -------------------------------------------------------------------------------

    @property
    def board(self) -> TaskBoard:
        """The board of top-level background tasks (`start` without a board)."""
        if self._board is None:
            self._board = TaskBoard(self, self.workspace)
        return self._board

    async def start(
        self,
        task: TaskSpec,
        *,
        board: TaskBoard | None = None,
        after: TaskHandle | None = None,
        render: Callable[[RunResult], str] | None = None,
    ) -> TaskHandle:
        """Start a task in the background and return its handle at once; everything is checked first
        (agent, grants, caps, schema, model loaded, the board's cap), as for `run`.

        Args:
            board: the parent's board (default: `runner.board`, top-level tasks).
            after, render: a chain step: run when `after` completed, its task `render(after's result)`.
        """
        return (await self._start_all([task], board or self.board, chain=False, after=after, render=render))[0]

    async def start_background(self, call: Delegation, board: TaskBoard) -> list[TaskHandle]:
        """A `subagent` call with `background: true`: its tasks (or chain steps, each waiting for the one
        before) started on the parent's board; nothing starts if any of them cannot."""
        tasks = [TaskSpec(agent=t.agent, task=t.task, label=t.label) for t in call.tasks]
        if call.mode == "chain" and tasks and PREVIOUS in tasks[0].task:
            _plan_chain(tasks)  # raises: step 1 has no previous step
        return await self._start_all(tasks, board, chain=call.mode == "chain", workspace=call.workspace)

    async def _start_all(
        self,
        tasks: list[TaskSpec],
        board: TaskBoard,
        *,
        chain: bool,
        workspace: Workspace | None = None,
        after: TaskHandle | None = None,
        render: Callable[[RunResult], str] | None = None,
    ) -> list[TaskHandle]:
        tasks = [replace(t, agent=t.agent.strip().lower(), label=t.label.strip()) for t in tasks]
        parent = board.parent
        if parent is not None:
            self._check_grant(parent, [t.agent for t in tasks])
        ids = board.plan_ids(tasks)
        try:
            handles = [await self._prepare(t, i, board, workspace or board.workspace) for t, i in zip(tasks, ids)]
            check_request([CapItem(h.label, t.task, h.spec) for h, t in zip(handles, tasks)])
        except BaseException:
            board.release(ids)
            raise
        self._started += handles
        for n, (handle, task) in enumerate(zip(handles, tasks)):
            board.add(handle)
            if chain and n:
                handle.launch(task.task, after=handles[n - 1], render=_previous(task.task))
            else:
                handle.launch(task.task, after=after, render=render)
        return handles

    async def _prepare(self, task: TaskSpec, task_id: str, board: TaskBoard, workspace: Workspace) -> TaskHandle:
        """A background task's handle, checked and its model loaded, not started."""
        parent = board.parent
        spec = self.agent(task.agent)
        withheld: dict[str, str] = {}
        if parent is not None:
            spec, withheld = granted_tools(parent.spec, spec)
        schema = task.schema if task.schema is not None else spec.output_schema
        if schema is not None:
            check_schema(schema, f"output schema of task '{task_id}'")
        model = self.model_for(spec, task.model, inherited=parent.model if parent else None)
        host = await self.host_for(model)
        await self.check_prompt_fits(spec, host, workspace)
        read_more = read_more_note(task_id) if parent is not None else None
        return TaskHandle(
            self,
            spec,
            model,
            host,
            workspace,
            label=f"{parent.label} > {task_id}" if parent else task_id,
            id=task_id,
            depth=parent.depth + 1 if parent else 0,
            home=parent.home if parent else self.home,
            owner=board,
            interactive=False,
            limits=self.limits(spec, task),
            timeout=task.timeout or self.options.timeout,
            schema=schema,
            withheld=withheld,
            read_more=read_more,
        )

    # -- multi-turn tasks -------------------------------------------------------------------------------

    async def open_task(self, agent: str, *, on_text: TextCallback | None = None) -> TaskHandle:
        """A new top-level task to drive message by message (`subagent chat`); its model is loaded now,
        its run is created at its first message.

        Args:
            on_text: receives the agent's reply text as it is generated.
        """
        spec = self.agent(agent)
        check_request([CapItem(spec.name, "", spec)])
        model = self.model_for(spec)
        host = await self.host_for(model)
        await self.check_prompt_fits(spec, host, self.workspace)
        return TaskHandle(self, spec, model, host, self.workspace, label=spec.name, on_text=on_text)

    async def reopen(self, run_id: str, *, task: str | None = None, on_text: TextCallback | None = None) -> TaskHandle:
        """A saved task, ready to take more messages (`resume`, `chat --resume`); its model is loaded now.

        Args:
            run_id: a run id, a unique prefix of one, or `last`.
            task: the task's label, step id or 1-based position, when the run has several.
        """
        record = load_run(run_id, self.home)
        entry = record.task(task)
        log = read_transcript(record.transcript_path(entry))
        if log.messages is None:
            raise RunNotFoundError(f"task '{entry.label}' of run {record.run_id} has no saved conversation to continue")
        spec = self.agent(log.meta["agent"])
        check_request([CapItem(entry.label, "", spec)])
        saved = log.meta["model"]  # on an engine, its model id: the agent's own engine or --engine takes it there
        model = self.model_for(spec, self.options.model or (None if saved == spec.engine_model else saved))
        host = await self.host_for(model)
        return TaskHandle(
            self,
            spec,
            model,
            host,
            Workspace(Path(log.meta["cwd"])),
            label=entry.label,
            record=record,
            entry=entry,
            messages=close_open_tool_calls(log.messages),
            generations=log.generations,
            on_text=on_text,
        )

    # -- delegation ---------------------------------------------------------------------------------

    async def delegate(self, call: Delegation, parent: Parent | None, board: TaskBoard | None = None) -> MultiRunResult:
        """Run a `subagent` tool call's children, labelled `parent > label`, one level below `parent`.

        Children fail alone (a failed result, never an exception); a request over a cap or with an
        unknown agent raises before anything starts, like any request. `parent` None: a call from
        outside the runner (`subagent mcp`), whose tasks run at the top level.

        Args:
            board: the parent's task board: the children that ran are kept there under ids (`scout#1`),
                so that the parent reads a cut answer with `subagent_output` (the cut note says how).
        """
        tasks = label_tasks([TaskSpec(agent=t.agent, task=t.task, label=t.label) for t in call.tasks])
        if parent is not None:
            tasks = [replace(t, label=f"{parent.label} > {t.label}") for t in tasks]
            self._check_grant(parent, [t.agent for t in tasks])
        if call.mode == "chain":
            tasks, needs, renders = _plan_chain(tasks)
            return await self._execute(
                "chain",
                tasks,
                concurrency=1,
                needs=needs,
                renders=renders,
                parent=parent,
                workspace=call.workspace,
                keep=board,
            )
        if call.mode == "single":
            return await self._execute(
                "single", tasks, concurrency=1, parent=parent, workspace=call.workspace, keep=board
            )
        failed = {i: r for i, t in enumerate(tasks) if (r := await self._set_up_fails(t, parent)) is not None}
        ready = [t for i, t in enumerate(tasks) if i not in failed]
        outcome = MultiRunResult(mode="parallel", succeeded=0, total=0, results=[])
        if ready:
            outcome = await self._execute(
                "parallel", ready, concurrency=DEFAULT_CONCURRENCY, parent=parent, workspace=call.workspace, keep=board
            )
        ran = iter(outcome.results)
        ran_ids = iter(outcome.task_ids or [None] * len(ready))
        results = [failed[i] if i in failed else next(ran) for i in range(len(tasks))]
        ids = [None if i in failed else next(ran_ids) for i in range(len(tasks))]
        return outcome.model_copy(
            update={"results": results, "succeeded": sum(r.ok for r in results), "total": len(results), "task_ids": ids}
        )

    async def _set_up_fails(self, task: TaskSpec, parent: Parent | None) -> RunResult | None:
        """A parallel child that cannot start (unknown agent or model) fails alone: its failed
        result, reported like any end; None when it can start."""
        model = ""
        try:
            spec = self.agent(task.agent)
            model = self.model_for(spec, task.model, inherited=parent.model if parent else None)
            await self.host_for(model)
        except Exception as exc:
            error = str(exc) if isinstance(exc, SubagentError) else f"{type(exc).__name__}: {exc}"
            data = {"status": "failed", "stop_reason": "error", "error": error}
            self.on_event(Event(kind="task_end", label=task.label, agent=task.agent, data=data))
            return RunResult(agent=task.agent, task=task.task, model=model, label=task.label, **data)  # type: ignore[arg-type]
        return None

    @staticmethod
    def _check_grant(parent: Parent, agents: Sequence[str]) -> None:
        """Refuse children the parent's `agents:` list does not name."""
        granted = parent.spec.agents
        if granted is not None and (refused := sorted(set(agents) - set(granted))):
            raise RequestError(
                f"'{parent.spec.name}' may not start {', '.join(repr(n) for n in refused)}: the agents: list in "
                f"{parent.spec.path} names only {', '.join(granted) or 'none'}; add the agent there to grant it"
            )

    def delegation_tools(self, parent: Parent, workspace: Workspace, board: TaskBoard | None = None) -> dict[str, Tool]:
        """`subagent` and the background tools (`subagent_status`, `_output`, `_send`, `_cancel`) on
        `board` for an agent whose file grants `subagent`, else nothing (the recursion cut).

        While its children run in the foreground, the parent lends its process slot (and writer turn) to them.
        """
        if "subagent" not in parent.spec.tools:
            return {}
        assert self.catalog is not None
        board = board or TaskBoard(self, workspace, parent=parent)

        async def delegate(call: Delegation) -> MultiRunResult:
            async with lend():
                return await self.delegate(call, parent, board)

        agents = {name: a.description for name, a in self.catalog.agents.items()}
        tool = SubagentTool(
            workspace,
            delegate=delegate,
            agents=agents,
            caller=parent.spec.name,
            depth=parent.depth,
            max_depth=self.options.max_depth,
            start=board.start_delegation,
        )
        return {"subagent": tool, **make_background_tools(workspace, board)}

    def cancel(self, *, background: bool = True) -> bool:
        """Abort every run in progress (Ctrl-C); False when nothing was running yet.

        Args:
            background: also the background tasks (`start`, `background: true`); a chat's first Ctrl-C
                stops only the turn.
        """
        executions = self._executions | (self._background if background else set())
        for execution in list(executions):
            execution.cancel()
        return bool(executions)

    # -- internals --------------------------------------------------------------------------------------

    async def _execute(
        self,
        mode: Mode,
        tasks: list[TaskSpec],
        *,
        concurrency: int,
        needs: list[tuple[int, ...]] | None = None,
        renders: list[Callable[[Sequence[RunResult]], str] | None] | None = None,
        shared_input: str = "",
        raise_errors: bool = False,
        parent: Parent | None = None,
        workspace: Workspace | None = None,
        keep: TaskBoard | None = None,
    ) -> MultiRunResult:
        """Check the whole request, load its models, then run it; nothing starts if a check fails.

        Args:
            parent, workspace: for a delegated request, the session that made it (the children run one
                level below it, on its model unless they name theirs, and are saved in its run folder)
                and the children's workspace (default: top level, in the runner's workspace and home).
            keep: the parent's board, where the finished children are kept under ids (see `delegate`).
        """
        workspace = workspace or self.workspace
        depth = parent.depth + 1 if parent else 0
        specs = [self.agent(t.agent) for t in tasks]
        withheld: list[dict[str, str]] = [{} for _ in specs]
        if parent is not None:
            specs, withheld = map(list, zip(*(granted_tools(parent.spec, s) for s in specs)))  # type: ignore[assignment]
        check_request([CapItem(t.label, t.task, s) for t, s in zip(tasks, specs)], shared_input)
        schemas = [t.schema if t.schema is not None else s.output_schema for t, s in zip(tasks, specs)]
        for t, schema in zip(tasks, schemas):
            if schema is not None:
                check_schema(schema, f"output schema of task '{t.label}'")
        models = [self.model_for(s, t.model, inherited=parent.model if parent else None) for t, s in zip(tasks, specs)]
        hosts = [await self.host_for(m) for m in models]
        for s, h in {(s.name, h.model_id): (s, h) for s, h in zip(specs, hosts)}.values():
            await self.check_prompt_fits(s, h, workspace)
        recorder = None
        if self.save_transcripts:
            entries = [
                TaskEntry(index=i, label=t.label, agent=s.name, step_id=t.step_id)
                for i, (t, s) in enumerate(zip(tasks, specs))
            ]
            recorder = RunRecorder(mode, workspace.root, entries, parent.home if parent else self.home)
        children_home = recorder.folder if recorder else None
        ids = keep.reserve_ids([t.agent for t in tasks]) if keep is not None else None
        parents = [Parent(s, t.label, depth, m, children_home) for t, s, m in zip(tasks, specs, models)]
        boards = [self._task_board(p, workspace) for p in parents]
        plan = [
            PlannedTask(
                index=i,
                label=t.label,
                spec=s,
                host=h,
                workspace=workspace,
                prompt=t.task,
                limits=self.limits(s, t),
                step_id=t.step_id,
                timeout=t.timeout or self.options.timeout,
                schema=schema,
                needs=needs[i] if needs else (),
                render=renders[i] if renders else None,
                extra_tools=self.delegation_tools(parents[i], workspace, boards[i]),
                withheld=withheld[i],
                context=self.project_context(s, workspace),
                inbox=boards[i].inbox,
                read_more=read_more_note(ids[i]) if ids else None,
            )
            for i, (t, s, h, schema) in enumerate(zip(tasks, specs, hosts, schemas))
        ]
        execution = Execution(
            mode,
            plan,
            concurrency=concurrency,
            compaction=self.compaction,
            on_event=self.on_event,
            open_transcript=recorder.transcript if recorder else (lambda _i: None),
            run_id=recorder.run_id if recorder else None,
            raise_errors=raise_errors,
            slots=self.slots,
        )
        results: list[RunResult] = []
        cancelled = False
        try:
            results = await self.track(execution)
        except asyncio.CancelledError:
            cancelled = True  # from outside the runner: an MCP client's cancel, the parent's turn stopped
            raise
        finally:
            for board in boards:  # a task's background children end with it
                await board.close("its parent task ended")
            if keep is not None and ids is not None:
                for task_id, item, done in zip(ids, plan, execution.uncapped):
                    if done is not None:
                        keep.add(self._finished(task_id, item, done, keep))
                keep.release([i for i, done in zip(ids, execution.uncapped) if done is None])
            if recorder is not None:
                done = results or [r for r in execution.results if r is not None]
                recorder.finish(
                    done,
                    interrupted=execution.cancelled or cancelled,
                    error=chain_stop(done) if mode == "chain" else None,
                )
        return MultiRunResult(
            mode=mode,
            succeeded=sum(r.ok for r in results),
            total=len(results),
            results=results,
            run_id=recorder.run_id if recorder else None,
            interrupted=execution.cancelled,
            error=chain_stop(results) if mode == "chain" else None,
            task_ids=list(ids) if ids else [],
        )

    async def track(self, execution: Execution, *, background: bool = False) -> list[RunResult]:
        """Run an execution as one of this runner's, so that `cancel()` reaches it."""
        executions = self._background if background else self._executions
        executions.add(execution)
        try:
            return await execution.run()
        finally:
            executions.discard(execution)

    def _finished(self, task_id: str, item: PlannedTask, result: RunResult, board: TaskBoard) -> TaskHandle:
        """A foreground child that ended, kept on its parent's board: its answer can be read, its
        conversation is not held (`subagent resume` continues it)."""
        handle = TaskHandle(
            self, item.spec, result.model, item.host, item.workspace, label=item.label, id=task_id, owner=board
        )
        handle.adopt(result, capped=cap_answer(result.output, None, read_more=item.read_more))
        return handle

    def _task_board(self, parent: Parent, workspace: Workspace) -> TaskBoard:
        """A task's board for its background children; its final answer waits while they run."""
        board = TaskBoard(self, workspace, parent=parent, inbox=Inbox())
        assert board.inbox is not None
        board.inbox.settle = board.settle
        return board

    def limits(self, spec: AgentSpec, task: TaskSpec | None = None) -> Limits:
        """A task's limits: its own, else the run's, else the agent's, else the defaults."""
        return Limits(
            max_turns=(task and task.max_turns) or self.options.max_turns or spec.max_turns or DEFAULT_MAX_TURNS,
            max_output_tokens=(task and task.max_output_tokens) or self.options.max_output_tokens,
            thinking=next(
                (t for t in (self.options.thinking, spec.thinking) if t is not None), DEFAULT_THINKING_TOKENS
            ),
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


def _plan_chain(
    tasks: list[TaskSpec],
) -> tuple[list[TaskSpec], list[tuple[int, ...]], list[Callable[[Sequence[RunResult]], str] | None]]:
    """Step ids, needs and `{previous}` renders for labelled chain steps."""
    if tasks and PREVIOUS in tasks[0].task:
        raise RequestError("step 1 uses {previous}, but there is no previous step; remove it from the first task")
    tasks = [replace(t, step_id=t.step_id or str(i + 1)) for i, t in enumerate(tasks)]

    def render(i: int) -> Callable[[Sequence[RunResult]], str]:
        return lambda results: tasks[i].task.replace(PREVIOUS, results[i - 1].output)

    needs = [(i - 1,) if i else () for i in range(len(tasks))]
    renders = [render(i) if i else None for i in range(len(tasks))]
    return tasks, needs, renders


def read_more_note(task_id: str) -> str:
    """How a parent agent reads the rest of a child's cut answer: with its tool, never from a path."""
    return READ_MORE.format(id=task_id)


def _previous(task: str) -> Callable[[RunResult], str]:
    """A background chain step's task, given the step before's result."""
    return lambda previous: task.replace(PREVIOUS, previous.output)


def chain_stop(results: Sequence[RunResult]) -> str | None:
    """`Chain stopped at step N: <reason>` for the first step that did not complete."""
    for i, result in enumerate(results):
        if not result.ok:
            return f"Chain stopped at step {i + 1}: {result.error or result.stop_reason}"
    return None
