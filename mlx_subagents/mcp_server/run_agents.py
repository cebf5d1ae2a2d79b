"""`run_agents`: the `subagent` tool's forms as an MCP tool, its calls started at the top level and
answered one of three ways.

- Within the call budget (`budget.py`): the call's result, every task in input order.
- Once the budget ends and the tasks have started: what finished, and the ids of the others, which go
  on on the server's board (`agent_output` reads them there).
- To a 2026-07-28 client that declares the Tasks extension: an MCP task at once (`call_tasks.py`),
  polled to the call's result without any budget.

Work answered before its tasks ended is held here until they end, or the server stops. The call's
arguments are read by the delegation parser (`tools/delegation.py`), as `start_agents`' are.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import mcp_types as types
from mcp.server import ServerRequestContext

from ..agents.context import repository_root
from ..caps import MAX_TASKS
from ..errors import SubagentError, ToolError
from ..results import MultiRunResult
from ..runs.board import TaskBoard
from ..runs.runner import Runner
from ..runs.task import TaskHandle
from ..tools.background import status_line
from ..tools.delegation import FORMS, Delegation, delegation_schema, parse_delegation
from ..tools.subagent import format_outcome
from .agent_list import agent_lines, check_confirmed
from .call_tasks import CallTasks, declares
from .notices import Progress, call_client, call_progress
from .run_outcome import budget_result, run_result
from .tasks import CANCELLED_BY_CLIENT, error

T = TypeVar("T")

log = logging.getLogger("mlx_subagents.mcp")


def run_schema(runner: Runner) -> dict[str, Any]:
    """`run_agents`'s and `start_agents`'s forms: the `subagent` tool's, without `background` (the tool's
    name says whether a call waits) and `fork` (a client has no agent conversation to continue), with the
    workflow form where the workspace has named workflows."""
    in_repository = repository_root(runner.workspace.root) is not None
    return delegation_schema(
        background=False,
        workflows=bool(runner.workflow_names()),
        isolation=in_repository,
        forks=False,
        models=runner.preparer.offered_models(None),  # the operator's grants (`--allow-model`), imported models
    )


def describe_run_agents(runner: Runner, budget: float | None = None) -> str:
    """When to delegate, how to write a task, the three forms, and the agents of this workspace."""
    listing = agent_lines(runner)
    return (
        f"Run local sub-agents on coding jobs in the workspace {runner.cwd}. Each runs on a small local model "
        "(free, private, slower and weaker than you), starts with an empty context, works with its own tools "
        "(read, grep, find, ls, bash, edit, write as its agent allows) and returns only its final answer.\n"
        "Good jobs are bounded and checkable: find where something is, list every caller of a function, summarise "
        "a module, review one file, run the tests and report failures, make one precisely described change. "
        "Write each task as if to a new colleague who cannot ask questions: the goal, the exact files, symbols "
        "and commands, and what the answer must contain. Verify claims that matter before you act on them.\n"
        f"{FORMS[0].upper()}{FORMS[1:]}.\nIndependent tasks in one call run at the same time and share the loaded model; "
        f"at most {MAX_TASKS} per call. cwd (optional) is a folder inside the workspace.\n"
        "The result gives each answer and, per task, its status, token usage and transcript path; a task that "
        f"failed makes the call an error. To carry on while they work, start_agents takes the same forms.\n"
        + (
            f"A call answers within {budget:g} s: tasks still running then go on in the background, and the answer "
            "gives their ids to read with agent_output.\n"
            if budget is not None
            else ""
        )
        + f"Agents:\n{listing}"
    )


def parsed(runner: Runner, arguments: dict[str, Any], tool: str) -> Delegation | types.CallToolResult:
    """Reads a call's arguments with the delegation parser (as the `subagent` tool does), or says in
    the error result what was wrong with them."""
    try:
        return parse_delegation(
            arguments, runner.workspace, runner.catalog.agents, tool=tool, workflows=bool(runner.workflow_names())
        )
    except ToolError as exc:
        return error(f"Error: {exc}")


async def refused_or(
    runner: Runner, call: Delegation, tool: str, work: Callable[[], Awaitable[T]]
) -> T | types.CallToolResult:
    """What `work` gives, or the error result a client reads: a project agent the server withholds,
    a cap, a label clash, an agent or model that cannot start (refused before anything ran)."""
    try:
        check_confirmed(runner, call)
        return await work()
    except SubagentError as exc:
        return error(f"Error: {tool} call refused: {exc}")


@dataclass
class Delegated:
    """A `run_agents` call's work, started: its result (or the refusal a client reads), and its tasks'
    handles as they start (`begun` once they have)."""

    work: asyncio.Future[MultiRunResult | types.CallToolResult]
    handles: list[TaskHandle]
    begun: asyncio.Event

    @classmethod
    def start(cls, runner: Runner, call: Delegation, var: contextvars.ContextVar[Any], value: Any) -> Delegated:
        """Start the call's tasks at the top level, with `var` set to `value` in their context."""
        handles: list[TaskHandle] = []
        begun = asyncio.Event()

        def on_handles(made: list[TaskHandle]) -> None:
            handles.extend(made)
            begun.set()

        reset = var.set(value)
        try:
            delegate = lambda: runner.delegate(call, None, on_handles=on_handles)  # noqa: E731
            work = asyncio.ensure_future(refused_or(runner, call, "run_agents", delegate))
        finally:
            var.reset(reset)
        return cls(work, handles, begun)


class RunAgents:
    """`run_agents`'s calls, answered within the call budget, with the ids of what still runs, or as an
    MCP task; and their work held until it ends.

    Args:
        call_budget: the seconds a call may take before it answers with what finished; None: no budget.
        calls: the calls answered with an MCP task.
        runner: the server's resident runner, for a request.
        board: the server's board of started tasks, made with the runner.
    """

    def __init__(
        self,
        call_budget: float | None,
        calls: CallTasks,
        runner: Callable[[ServerRequestContext[Any]], Awaitable[Runner]],
        board: Callable[[Runner], TaskBoard],
    ) -> None:
        self.call_budget = call_budget
        self.calls = calls
        self.runner = runner
        self.board = board
        self.detached: set[asyncio.Future[Any]] = set()  # calls answered before their tasks ended

    async def close(self) -> None:
        """Wait for the work of the calls answered before their tasks ended."""
        await asyncio.gather(*self.detached, return_exceptions=True)

    async def answer(
        self, ctx: ServerRequestContext[Any], arguments: dict[str, Any], started: float
    ) -> types.CallToolResult | dict[str, Any]:
        """One call's answer (`started`: when the call came, what its budget counts from)."""
        if "background" in arguments:
            return error(
                "run_agents waits for its tasks and takes no 'background'; to start them and carry on, call "
                "start_agents with the same arguments"
            )
        runner = await self.runner(ctx)
        call = parsed(runner, arguments, "run_agents")
        if isinstance(call, types.CallToolResult):
            return call
        if declares(ctx):  # a 2026-07-28 client with Tasks: a handle at once, no call budget in the way
            return await self._as_task(runner, call)
        token = (ctx.meta or {}).get("progress_token")
        progress = Progress(ctx.session) if token is not None else None
        # The work copies the context: every child's events find this request's `progress`.
        delegated = Delegated.start(runner, call, call_progress, progress)
        work, handles = delegated.work, delegated.handles
        pump = asyncio.ensure_future(progress.pump()) if progress else None
        try:
            outcome = await self._within_budget(work, delegated.begun, started)
        except asyncio.CancelledError:
            # Cancel the children once and wait, shielded, while they kill their processes and save.
            work.cancel()
            if pump is not None:
                pump.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({work, *([pump] if pump else [])})
            raise
        if progress is not None and pump is not None:
            progress.close()
            await pump
        if outcome is None:  # the budget ended first: the tasks go on, on the board, and the answer names them
            self._detach(work)
            assert self.call_budget is not None
            return budget_result(call, handles, self.board(runner), self.call_budget)
        if isinstance(outcome, types.CallToolResult):  # refused before anything ran
            return outcome
        return run_result(call, outcome, format_outcome(call, outcome))

    async def _as_task(self, runner: Runner, call: Delegation) -> types.CallToolResult | dict[str, Any]:
        """`run_agents` answered with an MCP task once its tasks have started: they run on the board (a
        disconnect leaves them running, `agent_status` and `agent_output` see them), the task's status
        is theirs and its result the call's. A call refused before anything ran answers as always."""
        delegated = Delegated.start(
            runner, call, call_client, None
        )  # the call answers now: its tasks log to no request
        work, handles = delegated.work, delegated.handles
        waiter = asyncio.ensure_future(delegated.begun.wait())
        try:
            await asyncio.wait({work, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if work.done() and isinstance(outcome := work.result(), types.CallToolResult):
            return outcome
        board = self.board(runner)
        for handle in handles:
            if handle.alive:
                handle.hand_over(board)
        self._detach(work)

        async def result() -> types.CallToolResult:
            outcome = await asyncio.shield(work)
            assert isinstance(outcome, MultiRunResult)
            return run_result(call, outcome, format_outcome(call, outcome))

        def describe() -> str:
            return "\n".join(status_line(h.snapshot()) for h in handles) or "starting"

        def cancel() -> None:
            for handle in handles:
                if handle.alive:
                    handle.cancel(CANCELLED_BY_CLIENT)

        return self.calls.start(result(), describe, cancel)

    async def _within_budget(self, work: asyncio.Future[T], begun: asyncio.Event, started: float) -> T | None:
        """What `work` gives, or None when the call budget ends first and its tasks have started (a call
        answers with ids only once there are ids: loading the model the first time counts)."""
        if self.call_budget is None:
            return await asyncio.shield(work)
        left = self.call_budget - (time.perf_counter() - started)
        await asyncio.wait({work}, timeout=max(left, 0.0))  # never cancels `work`, even when cancelled itself
        if not work.done():
            waiter = asyncio.ensure_future(begun.wait())
            try:
                await asyncio.wait({work, waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
        return work.result() if work.done() else None

    def _detach(self, work: asyncio.Future[Any]) -> None:
        """Keep a call's work running after its answer, until its tasks end (or the server stops)."""
        self.detached.add(work)

        def ended(done: asyncio.Future[Any]) -> None:
            self.detached.discard(done)
            if not done.cancelled() and done.exception() is not None:
                log.error("run_agents tasks answered in the background failed: %r", done.exception())

        work.add_done_callback(ended)
