"""`Runner`: the Python API. Runs tasks in every mode, starts and continues them, delegates.

One resident host per model, started on first use and shared by every task that names that
model. The CLI, the MCP server and Python callers all come through here:

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

Every request is prepared whole (`prepare.py`: agents, trust, grants, size caps, schemas, models
loaded, prompts that fit) before any task starts. Every task is saved as a transcript unless
`save_transcripts` is off.

Delegation: an agent whose file grants `subagent` gets the `subagent` tool, whose children run
through this same runner (same hosts, caps and concurrency limit) as `parent > child` labels, one
level deeper; a session at `max_depth` is refused. A child's run is saved inside its parent's run
folder (`runs/<parent-id>/runs/<child-id>/`), so `last` stays the run a person started.

Background tasks (`start`, and `subagent` with `background: true`) run as asyncio tasks on the
runner's loop, on a `TaskBoard` per parent (`runner.board` for top-level ones), sharing the hosts,
batching, KV pool and the process-wide slots with everything else. `close()` cancels what still runs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..agents.compaction import CompactionSettings
from ..agents.discovery import AgentCatalog, discover_agents
from ..agents.schema_output import check_schema
from ..caps import DEFAULT_CONCURRENCY, check_concurrency
from ..events import Event, EventSink, HookWarningData, ignore_event
from ..host.protocol import ModelHost, ProcessorFactory, TextCallback
from ..results import MultiRunResult, RunResult
from ..tools import Tool, Workspace
from ..tools.delegation import Delegation, ForkPoint
from ..tools.editor import Editor
from ..tools.mcp_requests import Person
from .board import TaskBoard
from .call_plan import CallPlan, plan_call, plan_tasks
from .delegated import Delegating, read_more_note, set_up_failed, with_failures
from .foreground import new_record, run_foreground
from .generation import Generation
from .hosts import HostPool
from .isolation import isolate, refuse_isolated
from .options import RunOptions
from .prepare import Preparer
from .prepared import Parent, PreparedTask, SetUpFailure, keep_sandbox, withhold
from .reopen import open_saved
from .running import Running
from .slots import Slots
from .task import TaskHandle
from .task_session import close_open_tool_calls
from .task_tools import board_tools
from .tasks import ModelRef, TaskSpec, label_tasks, plan_chain
from .transcripts import RunRecord, TaskEntry, new_run_id
from .workflow import (
    Workflow,
    check_agents,
    discover_workflows,
    find_workflow,
    load_workflow,
    plan_workflow,
)

NO_PERSON = "nobody can answer here: this run asks no questions (subagent chat does, at its terminal)"


class Runner:
    """Prepares tasks, starts hosts once per model, runs tasks.

    Args:
        cwd: the workspace.
        options: the run's shared options (model, limits, scope, depth, host settings).
        catalog: the agents (default: those visible from `cwd` in `options.scope`).
        interactive, confirm: whether a person can be asked before a project agent runs, and how.
        ask: asks that person without blocking the event loop (a client of `subagent serve`), instead
            of `confirm`.
        on_event: receives every event of every task.
        save_transcripts: write every task under `$MLX_SUBAGENTS_HOME/runs/` (or `home`/runs).
        processor_factory: logits processors for every real host (the test kit's forced scripts).
        hosts: hosts made by the caller, by the model name tasks give (an in-memory `ScriptedHost`,
            another runner's hosts); started at their first use, stopped by their owner, not here.
        host_pool: the resident hosts shared with other runners (`subagent serve` gives every client's
            runner its one pool); their settings are the pool's, and they outlive this runner.
    """

    def __init__(
        self,
        cwd: Path | str,
        options: RunOptions | None = None,
        *,
        catalog: AgentCatalog | None = None,
        interactive: bool = False,
        confirm: Callable[[str], bool] | None = None,
        ask: Callable[[str], Awaitable[bool]] | None = None,
        compaction: CompactionSettings | None = None,
        on_event: EventSink = ignore_event,
        save_transcripts: bool = True,
        home: Path | None = None,
        processor_factory: ProcessorFactory | None = None,
        hosts: Mapping[str | ModelRef, ModelHost] | None = None,
        host_pool: HostPool | None = None,
    ) -> None:
        self.cwd = Path(cwd).resolve()
        self.options = options or RunOptions()
        self.catalog: AgentCatalog = catalog or discover_agents(self.cwd, scope=self.options.scope)
        self._discovered = catalog is None  # a catalog the caller gave is never read again
        self.compaction = compaction or CompactionSettings()
        self.on_event = on_event
        self.save_transcripts = save_transcripts
        self.home = home
        self.workspace = Workspace(self.cwd)
        self.preparer = Preparer(
            self.options,
            self.catalog,
            interactive=interactive,
            confirm=confirm,
            ask=ask,
            processor_factory=processor_factory,
            hosts={ModelRef(m) if isinstance(m, str) else m: host for m, host in (hosts or {}).items()},
            cwd=self.cwd,
            pool=host_pool,
        )
        self.preparer.on_warning = lambda line: self.on_event(
            Event("hook_warning", "", "", data=HookWarningData(message=line))
        )
        self.preparer.board_tools = lambda task: self.board_tools(task.as_parent(None), task.workspace)
        self.running = Running(self.options, self.cwd)
        self._board: TaskBoard | None = None
        self._started: list[TaskHandle] = []  # every background task, for `close`
        # Reopened tasks' holds (`hold_task`, and the worktree they work in), let go at `close`.
        self._holds: dict[TaskHandle, ExitStack] = {}
        self.session_names = self.preparer.pool.session_names  # the host sessions agent sessions run on now
        # Who answers the questions of the MCP servers the agents call (a chat sets its terminal's person);
        # with nobody, why: what a server's declined elicitation says.
        self.person: Person | None = None
        self.no_person = NO_PERSON
        # The person's editor (`subagent acp`): its files, its terminal, its approval of every change of
        # every task of this runner, sub-agents included (`tools/editor.py`); None: the tools work unasked.
        self.editor: Editor | None = None

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
        for hold in self._holds.values():
            hold.close()
        self._holds.clear()
        await self.preparer.close()

    def refresh_agents(self) -> AgentCatalog:
        """Read the agent folders again, so that an agent file added or changed while a chat or the
        MCP server runs is seen at the next call; a catalog the caller gave stays as it is."""
        if self._discovered:
            self.catalog = self.preparer.catalog = discover_agents(self.cwd, scope=self.options.scope)
        return self.catalog

    def resident_hosts(self) -> list[ModelHost]:
        """The hosts loaded so far: a server's sampling request may name one of their models."""
        return list(self.preparer.hosts.values())

    @property
    def current_slots(self) -> Slots | None:
        """The slots and writer leases as they are now (None before the first task), for a view."""
        return self.running.current_slots

    async def execute(self, plan: list[Generation]) -> list[RunResult]:
        """Run generations in the foreground, as one of the runner's runs; their results."""
        return await self.running.execute(plan)

    def launch(self, plan: list[Generation]) -> None:
        """Run generations in the background, each as soon as its needs and a slot let it (`Running.launch`)."""
        self.running.launch(plan)

    def cancel(self, *, background: bool = True, reason: str | None = None) -> bool:
        """Abort every run in progress (Ctrl-C); False when nothing was running yet (`Running.cancel`)."""
        return self.running.cancel(background=background, reason=reason)

    # -- the four modes --------------------------------------------------------------------------------

    async def run(self, task: TaskSpec) -> RunResult:
        """Run one task and return its result; an unexpected error in it is raised, not returned."""
        prepared = await self._prepare(label_tasks([task]))
        outcome = await run_foreground(self, "single", prepared, concurrency=1, raise_errors=True)
        return outcome.results[0]

    async def parallel(self, tasks: Sequence[TaskSpec], *, concurrency: int = DEFAULT_CONCURRENCY) -> MultiRunResult:
        """Run up to 8 independent tasks, `concurrency` (1-4) at a time; results in input order."""
        check_concurrency(concurrency, engine=bool(self.options.engine))
        return await run_foreground(self, "parallel", await self._prepare(label_tasks(tasks)), concurrency=concurrency)

    async def chain(self, steps: Sequence[TaskSpec]) -> MultiRunResult:
        """Run steps in order, `{previous}` in a step's task being the previous step's answer.

        The chain stops at the first step that does not complete; `error` says where and why.
        """
        tasks, order = plan_chain(label_tasks(steps))
        return await run_foreground(self, "chain", await self._prepare(tasks), concurrency=1, steps=order)

    async def workflow(
        self, workflow: Workflow | str | Path, input: str = "", *, concurrency: int = DEFAULT_CONCURRENCY
    ) -> MultiRunResult:
        """Run a workflow (a `Workflow`, a TOML file or a named workflow) on an input.

        A step starts as soon as its needs are done; results come back in step order.
        """
        check_concurrency(concurrency, engine=bool(self.options.engine))
        if not isinstance(workflow, Workflow):
            workflow = load_workflow(find_workflow(str(workflow), self.cwd))
        check_agents(workflow, self.catalog)
        tasks, order = plan_workflow(workflow, input)
        prepared = await self._prepare(tasks, shared_input=input)
        return await run_foreground(self, "workflow", prepared, concurrency=concurrency, steps=order)

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
        try:
            return await handle.ask(message, schema=schema, timeout=self.options.timeout, raise_errors=True)
        finally:
            self.release(handle)

    # -- background tasks -------------------------------------------------------------------------------

    @property
    def board(self) -> TaskBoard:
        """The board of top-level background tasks (`start` without a board)."""
        if self._board is None:
            self._board = TaskBoard(self.workspace, on_event=self.on_event)
        return self._board

    async def start(self, task: TaskSpec, *, board: TaskBoard | None = None) -> TaskHandle:
        """Start a task in the background and return its handle at once; everything is checked first
        (agent, grants, caps, schema, model loaded, the board's cap), as for `run`.

        Args:
            board: the parent's board (default: `runner.board`, top-level tasks).
        """
        board = board or self.board
        return (await self._start_all(plan_tasks([task], board), board))[0]

    async def start_background(self, call: Delegation, board: TaskBoard) -> list[TaskHandle]:
        """A `subagent` call with `background: true`: its tasks (or chain or workflow steps, each waiting
        for the ones it needs) started on the parent's board; nothing starts if any of them cannot."""
        plan = plan_call(call, self.catalog, self.cwd, parent=board.parent, board=board, background=True)
        return await self._start_all(plan, board, call=call)

    async def _start_all(self, plan: CallPlan, board: TaskBoard, *, call: Delegation | None = None) -> list[TaskHandle]:
        """Prepare a plan's tasks as a whole, then start them in the background on `board`, each a run of
        its own, a chain's or a workflow's steps in their order; a fork starts at the plan's fork point.
        A delegated `call`'s notice waits for its last task (`TaskBoard.watch`)."""
        delegated = call is not None
        ids = plan.ids or []
        try:
            where = {"workspace": plan.workspaces, "shared_input": plan.shared_input, "delegated": delegated}
            prepared = await self._prepare(plan.tasks, parent=board.parent, **where)  # type: ignore[arg-type]
            prepared, trees = isolate(prepared, new_run_id())  # made before it starts; finished as it ends
        except BaseException:
            board.release(ids)
            raise
        handles = [
            self.handle(p, board=board, task_id=i, worktree=tree, fork_point=plan.fork_point, background=True)
            for p, i, tree in zip(prepared, ids, trees)
        ]
        self._started += handles
        if call is not None:
            board.watch(call, ids)
        self.launch([h.generation(t.task, *plan.steps.of(i)) for i, (h, t) in enumerate(zip(handles, plan.tasks))])
        return handles

    # -- multi-turn tasks -------------------------------------------------------------------------------

    async def open_task(self, agent: str, *, on_text: TextCallback | None = None) -> TaskHandle:
        """A new top-level task to drive message by message (`subagent chat`); its model is loaded now,
        its run is created at its first message.

        Args:
            on_text: receives the agent's reply text as it is generated.
        """
        spec = self.catalog.get(agent)
        prepared = await self._prepare([TaskSpec(agent=spec.name, task="", label=spec.name)])
        refuse_isolated(prepared, "a multi-turn task (a chat)")
        return self.handle(prepared[0], interactive=True, on_text=on_text)

    async def reopen(self, run_id: str, *, task: str | None = None, on_text: TextCallback | None = None) -> TaskHandle:
        """A saved task, ready to take more messages (`resume`, `chat --resume`); its model is loaded now.

        Args:
            run_id: a run id, a unique prefix of one, or `last`.
            task: the task's label, step id or 1-based position, when the run has several.
        """
        saved = open_saved(run_id, task, catalog=self.catalog, model=self.options.model, home=self.home)
        try:
            prepared = await self._prepare([saved.task], workspace=saved.workspace)
        except BaseException:
            saved.holds.close()
            raise
        meta = saved.log.meta
        handle = self.handle(
            keep_sandbox(withhold(prepared[0], meta.get("denied") or {}), meta.get("sandbox")),
            interactive=True,
            record=saved.record,
            entry=saved.entry,
            messages=close_open_tool_calls(saved.messages),
            generations=saved.log.generations,
            on_text=on_text,
        )
        self._holds[handle] = saved.holds  # let go when the handle is done (`release`, `close`)
        return handle

    def release(self, handle: TaskHandle) -> None:
        """Let go of what the runner holds for `handle`: a reopened task's hold on its saved run and on
        the worktree it works in (`reopen`); else they are let go when the runner closes."""
        if (holds := self._holds.pop(handle, None)) is not None:
            holds.close()

    # -- handles and how their generations run ---------------------------------------------------------

    def handle(
        self,
        prepared: PreparedTask,
        *,
        board: TaskBoard | None = None,
        task_id: str | None = None,
        fork_point: ForkPoint | None = None,
        **how: Any,
    ) -> TaskHandle:
        """The one way a prepared task becomes a `TaskHandle`, on `board` (its parent's) under `task_id`.

        A child's host session goes by its board id (`orchestrator > scout#2`), its own even when
        siblings share its label, and a cut answer says to read the rest with the parent's tool.

        Args:
            fork_point: where its parent's forks start (a fork continues it from there).
            how: the rest of `TaskHandle`'s arguments (background, interactive, record, entry, ...).
        """
        child = prepared.parent is not None and task_id is not None
        parent = board.parent if board is not None else None
        handle = TaskHandle(
            self,
            prepared,
            id=task_id,
            owner=board,
            run_folder=parent.run_folder if parent else None,
            read_more=read_more_note(task_id) if child and task_id else None,
            fork_from=fork_point if prepared.task.fork else None,
            session_name=f"{prepared.parent} > {task_id}" if child else None,
            **how,
        )
        if board is not None:
            board.add(handle)
        return handle

    def new_run(self, handle: TaskHandle) -> tuple[RunRecord, TaskEntry] | None:
        """A run of its own for a task started alone (in the background, a chat), made at its first
        generation; None when nothing is saved."""
        if not self.save_transcripts:
            return None
        record = new_record("single", handle.workspace.root, [handle.prepared], handle.run_folder or self.home)
        return record, record.tasks[0]

    # -- delegation ---------------------------------------------------------------------------------

    async def delegate(
        self,
        call: Delegation,
        parent: Parent | None,
        board: TaskBoard | None = None,
        *,
        on_handles: Callable[[list[TaskHandle]], None] | None = None,
    ) -> MultiRunResult:
        """Run a `subagent` tool call's children, labelled `parent > id`, one level below `parent`.

        Children fail alone (a failed result, never an exception); a request over a cap or with an
        agent the parent may not start raises before anything starts, like any request. `parent`
        None: a call from outside the runner (`subagent mcp`), whose tasks run at the top level.

        Args:
            board: the parent's task board: the children that ran are kept there under ids (their label,
                else `scout#1`), so that the parent continues one with `task_send` and reads a cut answer
                with `task_output` (the cut note says how).
            on_handles: called with the children's handles as they start, before any has ended (the
                MCP server answers within its call budget with the ids of those still running).
        """
        plan = plan_call(call, self.catalog, self.cwd, parent=parent, board=board)
        under = Delegating(parent, board, plan.fork_point, ids=plan.ids, on_handles=on_handles)
        try:
            return await self._delegate(plan, under)
        finally:
            if board is not None and plan.ids:
                board.release(plan.ids)  # those that never started (a failed check, a child that could not be set up)

    async def _delegate(self, plan: CallPlan, under: Delegating) -> MultiRunResult:
        where: dict[str, Any] = {"parent": under.parent, "workspace": plan.workspaces, "delegated": True}
        if plan.mode != "parallel":  # a workflow is checked as `subagent workflow` checks it, then as any request
            prepared = await self._prepare(plan.tasks, shared_input=plan.shared_input, **where)
            concurrency = self.options.concurrency if plan.mode == "workflow" else 1
            return await run_foreground(
                self, plan.mode, prepared, concurrency=concurrency, steps=plan.steps, under=under
            )
        each = await self.preparer.prepare_each(plan.tasks, **where)
        failed = {i: set_up_failed(p, self.on_event) for i, p in enumerate(each) if isinstance(p, SetUpFailure)}
        ready = [p for p in each if isinstance(p, PreparedTask)]
        outcome = MultiRunResult(mode="parallel", succeeded=0, total=0, results=[])
        if ready:
            ids = [i for n, i in enumerate(under.ids) if n not in failed] if under.ids is not None else None
            under = replace(under, ids=ids)
            outcome = await run_foreground(self, "parallel", ready, concurrency=self.options.concurrency, under=under)
        return with_failures(outcome, failed, len(plan.tasks))

    def workflow_names(self) -> list[str]:
        """The named workflows visible from the workspace, for the `subagent` tool's description."""
        return sorted(discover_workflows(self.cwd))

    def board_tools(
        self, parent: Parent, workspace: Workspace, board: TaskBoard | None = None, **how: Any
    ) -> dict[str, Tool]:
        """The tools on an agent's `board`, its children run through this runner (`task_tools.board_tools`;
        `how`: `forked`, `speak_up`)."""
        return board_tools(self, parent, workspace, board, **how)

    # -- internals --------------------------------------------------------------------------------------

    async def _prepare(
        self,
        tasks: Sequence[TaskSpec],
        *,
        parent: Parent | None = None,
        workspace: Workspace | Sequence[Workspace] | None = None,
        shared_input: str = "",
        delegated: bool = False,
    ) -> list[PreparedTask]:
        return await self.preparer.prepare(
            tasks, parent=parent, workspace=workspace or self.workspace, shared_input=shared_input, delegated=delegated
        )
