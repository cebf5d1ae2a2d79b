"""Runs tasks: resolves agents and models, owns the resident hosts, applies limits.

One resident host per model id, started on first use and shared by every task that names that
model. The CLI and Python callers both come through here:

    async with Runner(cwd=".") as runner:
        one = await runner.run(TaskSpec("scout", "where is auth handled?"))
        many = await runner.parallel([TaskSpec("scout", "map auth"), TaskSpec("reviewer", "review db.py")])
        chain = await runner.chain([TaskSpec("scout", "find the parser"), TaskSpec("planner", "plan: {previous}")])
        flow = await runner.workflow("fix-bug", input="the date parser drops time zones")
        more = await runner.resume(one.run_id, "and where is it tested?")
        parent = await runner.open_session("orchestrator")   # a multi-turn parent (`subagent chat`)

Every request is checked whole (agents, trust, size caps, workflow graph, models loaded) before any
task starts. Every task is saved as a transcript unless `save_transcripts` is off.

Delegation: an agent whose file grants `subagent` gets the `subagent` tool, whose children run
through this same runner (same hosts, caps and concurrency limit) as `parent > child` labels, one
level deeper; a session at `max_depth` is refused. A child's run is saved inside its parent's run
folder (`runs/<parent-id>/runs/<child-id>/`), so `last` stays the run a person started.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .agents import AgentCatalog, AgentSpec, discover_agents, require_trust
from .caps import DEFAULT_CONCURRENCY, CapItem, check_concurrency, check_request
from .compaction import CompactionSettings
from .errors import RequestError, RunNotFoundError
from .events import EventSink, ignore_event
from .execution import Execution, PlannedTask
from .host import make_host
from .host.protocol import Message, ModelHost, TextCallback
from .results import Mode, MultiRunResult, RunResult
from .schema_output import check_schema
from .session import DEFAULT_MAX_TURNS, AgentSession, Limits
from .tools import Tool, Workspace
from .tools.subagent import Delegation, SubagentTool
from .transcripts import RunRecorder, TaskEntry, TaskTranscript, load_run, read_transcript
from .userfiles import first_error, load_file
from .workflow import Workflow, check_agents, find_workflow, load_workflow, render_prompt

DEFAULT_MODEL = "mlx-community/Qwen3-4B-Instruct-2507-4bit"
MODEL_ENV = "MLX_SUBAGENTS_MODEL"
PREVIOUS = "{previous}"
# Levels of sub-agents below the agent a person started; a session at this depth cannot delegate.
DEFAULT_MAX_DEPTH = 2
INTERRUPTED_TOOL_RESULT = "Error: this tool call was interrupted before it finished."


def default_model() -> str:
    return os.environ.get(MODEL_ENV) or DEFAULT_MODEL


@dataclass(frozen=True)
class TaskSpec:
    """One task to run: which agent, what to do, and optional per-task overrides.

    Args:
        max_tokens: generated tokens over the whole task.
        timeout: wall-clock seconds for the whole task.
        schema: a JSON schema the final answer must satisfy (else the agent's `output_schema`).
    """

    agent: str
    task: str
    label: str = ""
    model: str | None = None
    max_turns: int | None = None
    max_tokens: int | None = None
    timeout: float | None = None
    schema: dict[str, Any] | None = None
    step_id: str | None = None


class _TaskFileItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    agent: str = Field(min_length=1)
    task: str = Field(min_length=1)
    label: str = ""
    model: str | None = None
    max_turns: int | None = Field(default=None, gt=0)
    max_tokens: int | None = Field(default=None, gt=0)
    timeout: float | None = Field(default=None, gt=0)


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
            tasks.append(TaskSpec(**_TaskFileItem.model_validate(item).model_dump()))
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
        model: forces one model for every task (`--model`); otherwise a task's own model, the
            agent's `model`, then `$MLX_SUBAGENTS_MODEL`, then `DEFAULT_MODEL`.
        max_turns, max_output_tokens, timeout: defaults for tasks that set none.
        host_options: passed to each host (`context_window`, `processor_factory`, ...).
        save_transcripts: write every task under `$MLX_SUBAGENTS_HOME/runs/` (or `home`/runs).
        max_depth: how many levels of sub-agents the `subagent` tool may start (0: none).
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
    timeout: float | None = None
    compaction: CompactionSettings = field(default_factory=CompactionSettings)
    host_options: dict[str, Any] = field(default_factory=dict)
    on_event: EventSink = ignore_event
    save_transcripts: bool = True
    home: Path | None = None
    max_depth: int = DEFAULT_MAX_DEPTH

    def __post_init__(self) -> None:
        if isinstance(self.max_depth, bool) or not isinstance(self.max_depth, int) or self.max_depth < 0:
            raise RequestError(f"max_depth must be a whole number >= 0, got {self.max_depth!r}")
        self.cwd = Path(self.cwd).resolve()
        self.workspace = Workspace(self.cwd)
        if self.catalog is None:
            self.catalog = discover_agents(self.cwd, scope=self.scope)  # type: ignore[arg-type]
        self._hosts: dict[str, ModelHost] = {}
        self._host_lock = asyncio.Lock()
        self._executions: set[Execution] = set()
        self._trusted: set[str] = set()

    async def __aenter__(self) -> Runner:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        hosts, self._hosts = list(self._hosts.values()), {}
        for host in hosts:
            await host.stop()

    # -- resolution -----------------------------------------------------------------------------------

    def agent(self, name: str) -> AgentSpec:
        """The named agent, after the user's consent if it is a project agent."""
        assert self.catalog is not None
        spec = self.catalog.get(name)
        if spec.name not in self._trusted:  # ask once per agent, not once per task
            require_trust(spec, assume_yes=self.assume_yes, interactive=self.interactive, confirm=self.confirm)
            self._trusted.add(spec.name)
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

    # -- the four modes --------------------------------------------------------------------------------

    async def run(self, task: TaskSpec) -> RunResult:
        """Run one task and return its result; an unexpected error in it is raised, not returned."""
        outcome = await self._execute("single", label_tasks([task]), concurrency=1, raise_errors=True)
        return outcome.results[0]

    async def parallel(self, tasks: Sequence[TaskSpec], *, concurrency: int = DEFAULT_CONCURRENCY) -> MultiRunResult:
        """Run up to 8 independent tasks, `concurrency` (1-4) at a time; results in input order."""
        check_concurrency(concurrency)
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
        check_concurrency(concurrency)
        if not isinstance(workflow, Workflow):
            workflow = load_workflow(find_workflow(str(workflow), self.cwd))
        assert self.catalog is not None
        check_agents(workflow, self.catalog)
        from .schema_output import load_schema

        ids = {step.id: i for i, step in enumerate(workflow.steps)}
        tasks = [
            TaskSpec(
                agent=s.agent,
                task=s.prompt,
                label=s.id,
                model=s.model,
                max_turns=s.max_turns,
                max_tokens=s.max_tokens,
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
        record = load_run(run_id, self.home)
        entry = record.task(task)
        path = record.transcript_path(entry)
        log = read_transcript(path)
        if log.messages is None:
            raise RunNotFoundError(f"task '{entry.label}' of run {record.run_id} has no saved conversation to continue")
        spec = self.agent(log.meta["agent"])
        if schema is not None:
            check_schema(schema, "schema")
        check_request([CapItem(entry.label, message, spec)])
        host = await self.host_for(self.model or log.meta["model"])
        workspace = Workspace(Path(log.meta["cwd"]))
        item = PlannedTask(
            index=0,
            label=entry.label,
            spec=spec,
            host=host,
            workspace=workspace,
            prompt=message,
            limits=self._limits(TaskSpec(spec.name, message), spec),
            step_id=entry.step_id,
            timeout=self.timeout,
            schema=schema,
            history=close_open_tool_calls(log.messages),
            extra_tools=self.delegation_tools(spec, entry.label, depth=0, workspace=workspace, home=record.folder),
        )
        transcript = TaskTranscript(path, generation=log.generations + 1)
        execution = Execution(
            "single",
            [item],
            concurrency=1,
            compaction=self.compaction,
            on_event=self.on_event,
            open_transcript=lambda _i: transcript,
            run_id=record.run_id,
            raise_errors=True,
        )
        results = await self._track(execution)
        return results[0]

    # -- delegation ---------------------------------------------------------------------------------

    async def delegate(self, call: Delegation, *, parent: str, depth: int, home: Path | None = None) -> MultiRunResult:
        """Run a `subagent` tool call's children, labelled `parent > label`, at `depth`.

        Children fail alone (a failed result, never an exception); a request over a cap or with an
        unknown agent raises before anything starts, like any request.

        Args:
            parent: the calling session's label.
            depth: the children's depth (the caller's + 1).
            home: where the children's runs are saved (`home/runs/`): the parent's run folder.
        """
        tasks = label_tasks([TaskSpec(agent=t.agent, task=t.task, label=t.label) for t in call.tasks])
        tasks = [replace(t, label=f"{parent} > {t.label}") for t in tasks]
        options: dict[str, Any] = {"depth": depth, "workspace": call.workspace, "home": home}
        if call.mode == "chain":
            tasks, needs, renders = _plan_chain(tasks)
            return await self._execute("chain", tasks, concurrency=1, needs=needs, renders=renders, **options)
        concurrency = 1 if call.mode == "single" else DEFAULT_CONCURRENCY
        return await self._execute(call.mode, tasks, concurrency=concurrency, **options)

    def delegation_tools(
        self, spec: AgentSpec, label: str, *, depth: int, workspace: Workspace, home: Path | None
    ) -> dict[str, Tool]:
        """`{"subagent": tool}` for an agent whose file grants it, else nothing (the recursion cut)."""
        if "subagent" not in spec.tools:
            return {}
        assert self.catalog is not None

        async def delegate(call: Delegation) -> MultiRunResult:
            return await self.delegate(call, parent=label, depth=depth + 1, home=home)

        agents = {name: a.description for name, a in self.catalog.agents.items()}
        tool = SubagentTool(
            workspace, delegate=delegate, agents=agents, caller=spec.name, depth=depth, max_depth=self.max_depth
        )
        return {"subagent": tool}

    async def open_session(
        self,
        agent: str,
        *,
        label: str | None = None,
        model: str | None = None,
        children_home: Path | None = None,
        on_event: EventSink | None = None,
        on_text: TextCallback | None = None,
    ) -> AgentSession:
        """A top-level session of `agent` to drive turn by turn (`run`, then `follow_up`), e.g. a chat.

        Its host session and KV cache live as long as it does; its sub-agents run through this
        runner and are saved under `children_home`.

        Args:
            model: the model when the runner forces none (a resumed chat's own model).
        """
        spec = self.agent(agent)
        check_request([CapItem(spec.name, "", spec)])
        host = await self.host_for(self.model or model or self.model_for(spec))
        label = label or spec.name
        return AgentSession(
            spec=spec,
            host=host,
            workspace=self.workspace,
            label=label,
            limits=self._limits(TaskSpec(spec.name, ""), spec),
            compaction=self.compaction,
            on_event=on_event or self.on_event,
            on_text=on_text,
            extra_tools=self.delegation_tools(spec, label, depth=0, workspace=self.workspace, home=children_home),
        )

    def cancel(self) -> bool:
        """Abort every run in progress (Ctrl-C); False when nothing was running yet."""
        for execution in list(self._executions):
            execution.cancel()
        return bool(self._executions)

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
        depth: int = 0,
        workspace: Workspace | None = None,
        home: Path | None = None,
    ) -> MultiRunResult:
        """Check the whole request, load its models, then run it; nothing starts if a check fails.

        Args:
            depth, workspace, home: for a delegated request, the children's depth, their workspace,
                and where their run is saved (default: top level, the runner's workspace and home).
        """
        workspace = workspace or self.workspace
        specs = [self.agent(t.agent) for t in tasks]
        check_request([CapItem(t.label, t.task, s) for t, s in zip(tasks, specs)], shared_input)
        schemas = [t.schema if t.schema is not None else s.output_schema for t, s in zip(tasks, specs)]
        for t, schema in zip(tasks, schemas):
            if schema is not None:
                check_schema(schema, f"output schema of task '{t.label}'")
        hosts = [await self.host_for(self.model_for(s, t.model)) for t, s in zip(tasks, specs)]
        recorder = None
        if self.save_transcripts:
            entries = [
                TaskEntry(index=i, label=t.label, agent=s.name, step_id=t.step_id)
                for i, (t, s) in enumerate(zip(tasks, specs))
            ]
            recorder = RunRecorder(mode, workspace.root, entries, home or self.home)
        children_home = recorder.folder if recorder else None
        plan = [
            PlannedTask(
                index=i,
                label=t.label,
                spec=s,
                host=h,
                workspace=workspace,
                prompt=t.task,
                limits=self._limits(t, s),
                step_id=t.step_id,
                timeout=t.timeout or self.timeout,
                schema=schema,
                needs=needs[i] if needs else (),
                render=renders[i] if renders else None,
                extra_tools=self.delegation_tools(s, t.label, depth=depth, workspace=workspace, home=children_home),
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
        )
        results: list[RunResult] = []
        try:
            results = await self._track(execution)
        finally:
            if recorder is not None:
                done = results or [r for r in execution.results if r is not None]
                recorder.finish(
                    done, interrupted=execution.cancelled, error=chain_stop(done) if mode == "chain" else None
                )
        return MultiRunResult(
            mode=mode,
            succeeded=sum(r.ok for r in results),
            total=len(results),
            results=results,
            run_id=recorder.run_id if recorder else None,
            interrupted=execution.cancelled,
            error=chain_stop(results) if mode == "chain" else None,
        )

    async def _track(self, execution: Execution) -> list[RunResult]:
        self._executions.add(execution)
        try:
            return await execution.run()
        finally:
            self._executions.discard(execution)

    def _limits(self, task: TaskSpec, spec: AgentSpec) -> Limits:
        return Limits(
            max_turns=task.max_turns or self.max_turns or spec.max_turns or DEFAULT_MAX_TURNS,
            max_output_tokens=task.max_tokens or self.max_output_tokens,
        )


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


def chain_stop(results: Sequence[RunResult]) -> str | None:
    """`Chain stopped at step N: <reason>` for the first step that did not complete."""
    for i, result in enumerate(results):
        if not result.ok:
            return f"Chain stopped at step {i + 1}: {result.error or result.stop_reason}"
    return None


def close_open_tool_calls(messages: list[Message]) -> list[Message]:
    """Add an error result for each tool call at the end that never got one (an aborted task).

    Chat templates expect every tool call to be answered before the next user message.
    """
    messages = list(messages)
    last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "assistant"), None)
    if last is None or not messages[last].get("tool_calls"):
        return messages
    answered = {m.get("tool_call_id") for m in messages[last + 1 :] if m.get("role") == "tool"}
    for call in messages[last]["tool_calls"]:
        if call.get("id") not in answered:
            name = call.get("function", {}).get("name", "")
            messages.append(
                {"role": "tool", "tool_call_id": call.get("id"), "name": name, "content": INTERRUPTED_TOOL_RESULT}
            )
    return messages
