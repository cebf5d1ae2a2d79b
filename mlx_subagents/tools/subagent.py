"""`subagent`: the tool a parent agent delegates with (one task, parallel tasks, a chain, a workflow).

The tool validates the call (`delegation.py`, its forms and parser) and formats the children's
answers; running them is the caller's `delegate` function (the runner's), so this module never
reaches up a layer. Every problem - no mode, two modes, an empty task, an unknown agent, a cap, the
depth limit - comes back to the model as an error result naming the forms and the agents, and the
parent carries on.

The recursion cut lives in two places: a session gets this tool only when its agent file names
`subagent` and it runs above the depth limit, and a session at `max_depth` gets an error result
instead of children.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..caps import MAX_ANSWER_BYTES, MAX_CONCURRENCY, MAX_TASKS, MAX_WARNINGS, cap_answer
from ..errors import SubagentError, ToolError
from ..host.protocol import Message
from ..results import MultiRunResult, RunResult
from ..text import NO_ANSWER, first_line, one_line
from .base import Tool, ToolResult, error_result, tool_failure
from .delegation import (
    READ_MORE,
    Delegation,
    ForkPoint,
    SubagentParams,
    delegation_schema,
    fork_point,
    parse_delegation,
)
from .workspace import Workspace

Delegate = Callable[[Delegation], Awaitable[MultiRunResult]]
# Starts a `"background": true` call's tasks and returns their ids at once.
Start = Callable[[Delegation], Awaitable[list[str]]]


class SubagentTool(Tool):
    """Runs other agents as children of this session.

    Args:
        delegate: runs a `Delegation` (the runner binds the caller's label and depth).
        agents: the agents the caller may start (its `agents:` grant), name -> description: the
            list the model reads, so that a small model never picks one it would be refused.
        caller: the calling agent's name; left out of the list the model sees.
        depth: how many parents the calling session has (0: started by a person).
        max_depth: children may run at depth `max_depth` at most; a call from there is refused.
        start: starts `"background": true` calls on the parent's board; None: refused.
        known: every agent the runner knows at the time of a call (default: `agents`); a name
            outside it is unknown, one inside it but not granted is refused by the runner.
        warnings: the agent-file warnings, the first `MAX_WARNINGS` of them in the description.
        concurrency: how many of a call's tasks run at once (`--concurrency`).
        workflows: the names of the workflows a call may run, for the description.
        isolation: whether `isolation` is offered (the workspace is in a git repository).
        background_agents: agents whose files say `background: true` (see `parse_delegation`).
        forked: the calling session is itself a fork: every call gets an error result, while the
            tool stays listed so that the fork's prompt keeps its parent's prefix.
        models: the models a call may name (its grants), offered by name in the schema; empty: none.
        thinking: whether `thinking` is offered (the caller's model thinks).
        list_models: what the `models` form answers (the granted models and what each agent runs on).
    """

    name = "subagent"
    description = "Delegate a task to a sub-agent."
    Params = SubagentParams
    read_only = False
    writes = False
    # Claude Code grants it as `Task(scout, worker)` (newer: `Agent(...)`), naming the agents it may start.
    claude_names = ("Task", "Agent")
    # Several subagent calls in one reply run at once, like the tasks of one call.
    concurrent = True

    def __init__(
        self,
        workspace: Workspace,
        *,
        delegate: Delegate,
        agents: Mapping[str, str],
        caller: str = "",
        depth: int = 0,
        max_depth: int = 2,
        start: Start | None = None,
        known: Callable[[], Collection[str]] | None = None,
        warnings: Sequence[str] = (),
        concurrency: int = MAX_CONCURRENCY,
        workflows: Sequence[str] = (),
        background_agents: Collection[str] = (),
        isolation: bool = False,
        forked: bool = False,
        models: Sequence[str] = (),
        list_models: Callable[[], str] | None = None,
        thinking: bool = True,
    ) -> None:
        super().__init__(workspace)
        self.forked = forked
        self.thinking = thinking
        self.models = tuple(models)
        self.list_models = list_models
        # The calling session's messages and host session, bound by the session (`AgentSession`):
        # what a fork starts from.
        self.conversation: Callable[[], Sequence[Message]] | None = None
        self.host_session = ""
        # Without `start` nothing runs in the background: such an agent's calls wait instead.
        self.background_agents = frozenset(background_agents) if start is not None else frozenset()
        self.delegate = delegate
        self.agents = dict(sorted(agents.items()))
        self.caller = caller
        self.depth = depth
        self.max_depth = max_depth
        self.start = start
        self.known = known or (lambda: self.agents)
        self.workflows = tuple(workflows)
        self.isolation = isolation
        listed = {n: d for n, d in self.agents.items() if n != caller}
        self.description = describe_delegation(  # type: ignore[misc]
            listed, background=start is not None, warnings=warnings, concurrency=concurrency, workflows=workflows
        )

    def schema(self) -> dict[str, Any]:  # type: ignore[override]
        """Per instance: the description lists this runner's agents; `background` only where it works."""
        parameters = delegation_schema(
            background=self.start is not None,
            workflows=bool(self.workflows),
            isolation=self.isolation,
            models=self.models,
            thinking=self.thinking,
        )
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": parameters},
        }

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        try:
            return await self._call(arguments)
        except Exception as exc:  # the boundary, as in `Tool.call`: never a crash of the parent
            return tool_failure(self.name, exc, self.workspace)

    async def _call(self, arguments: dict[str, Any]) -> ToolResult:
        if self.forked:
            return error_result(f"{self.name}: a fork does its task itself; use your other tools and answer")
        if self.depth >= self.max_depth:
            return error_result(
                f"delegation refused: this agent already runs at depth {self.depth} and the limit is "
                f"{self.max_depth} (max_depth); do the task yourself with your other tools"
            )
        try:
            delegation = parse_delegation(
                arguments,
                self.workspace,
                self.known(),
                tool=self.name,
                listed=self.agents,
                background_agents=self.background_agents,
                workflows=bool(self.workflows),
            )
        except ToolError as exc:
            return error_result(str(exc))
        if delegation.mode == "models":
            if self.list_models is None:
                return error_result(f"{self.name}: no models are granted here; leave model out")
            return ToolResult(self.list_models())
        if delegation.forks:
            if self.conversation is None:
                return error_result(f"{self.name}: forks are not available here; name an agent instead")
            point = ForkPoint(self.host_session, fork_point(self.conversation()))
            delegation = replace(delegation, fork_point=point)
        if delegation.background:
            return await self._start(delegation)
        try:
            outcome = await self.delegate(delegation)
        except SubagentError as exc:  # a cap, a label clash, a project agent not allowed
            return error_result(f"{self.name} call refused: {exc}")
        return format_outcome(delegation, outcome)

    async def _start(self, delegation: Delegation) -> ToolResult:
        """A background call: the new tasks' ids at once, and what the parent can do with them."""
        if self.start is None:
            return error_result(
                f'{self.name}: "background": true is not available here; call it without background and wait'
            )
        try:
            ids = await self.start(delegation)
        except SubagentError as exc:  # a cap, a label clash, an agent not granted
            return error_result(f"{self.name} call refused: {exc}")
        return ToolResult(
            f"Started in the background: {', '.join(ids)}. Carry on with other work; {_when(delegation, ids)}. "
            "task_status shows how they are doing, task_output reads an answer (wait to block until "
            "it ends), task_send steers one, task_cancel stops one."
        )

    def describe(self, arguments: dict[str, Any]) -> str:
        """`subagent scout: <task>`, `subagent parallel: scout, reviewer`, `subagent chain: scout -> planner`."""

        def names(items: Any) -> list[str]:
            named = [str(i.get("agent") or ("fork" if i.get("fork") else "?")) for i in items if isinstance(i, dict)]
            return named if isinstance(items, list) else []

        name = "subagent (background)" if arguments.get("background") is True else "subagent"
        if arguments.get("tasks"):
            return f"{name} parallel: {', '.join(names(arguments['tasks']))}"
        if arguments.get("chain"):
            return f"{name} chain: {' -> '.join(names(arguments['chain']))}"
        if arguments.get("agent") or arguments.get("fork") is True:
            return f"{name} {arguments.get('agent') or 'fork'}: {one_line(str(arguments.get('task', '')), 80)}"
        if arguments.get("workflow"):
            return f"{name} workflow {arguments['workflow']}: {one_line(str(arguments.get('input', '')), 80)}"
        steps = arguments.get("steps")
        if isinstance(steps, list) and steps:
            named = [f"{i.get('name', '?')} ({i.get('agent', '?')})" for i in steps if isinstance(i, dict)]
            return f"{name} steps: {', '.join(named)}"
        if arguments.get("models") is True:
            return f"{name} models"
        return f"{name} (no task)"


def _when(call: Delegation, ids: Sequence[str]) -> str:
    """When a background call's notice comes, in the words its start answers with."""
    if len(ids) == 1:
        return "a notice with its answer comes when it ends"
    if call.notify == "each":
        return "a notice with its answer comes as each ends"
    return "one notice with all their answers comes when the last ends"


def describe_delegation(
    agents: Mapping[str, str],
    *,
    background: bool = False,
    warnings: Sequence[str] = (),
    concurrency: int = MAX_CONCURRENCY,
    workflows: Sequence[str] = (),
) -> str:
    """What the model reads about the tool: when to use it, its forms (the workflow form only where
    named workflows exist), the agents it may start, and the first agent-file warnings (a file the
    model expected and that did not load says why)."""
    listing = "\n".join(f"- {name}: {description}" for name, description in agents.items()) or "- (none)"
    notes = [f"- {w}" for w in warnings[:MAX_WARNINGS]]
    if len(warnings) > MAX_WARNINGS:
        notes.append(f"- ({len(warnings) - MAX_WARNINGS} more)")
    return (
        "Delegate work to a sub-agent. It starts with a fresh, empty context, works with its own tools, "
        "and returns only its final answer to you.\n"
        "Delegate when a job is bounded and self-contained (find where something is, review a file, plan a "
        "change, make one change), when doing it yourself would fill your context with file contents, or to "
        "run independent jobs in parallel. Do not delegate a step one tool call can do, and do not delegate "
        "what needs the conversation: the sub-agent sees only its task text, so put every path, name and goal "
        "in it.\n"
        "Use exactly one form:\n"
        '- {"agent": NAME, "task": TEXT}: one task.\n'
        f'- {{"tasks": [{{"agent": NAME, "task": TEXT}}, ...]}}: up to {MAX_TASKS} independent tasks, '
        f"{concurrency} at a time.\n"
        '- {"chain": [{"agent": NAME, "task": TEXT}, ...]}: steps in order; {previous} in a task is the '
        "previous step's answer.\n"
        '- {"steps": [{"name": N, "agent": NAME, "task": TEXT, "needs": [M, ...]}, ...]}: a workflow; a step '
        "starts once the steps it needs are done, and {M} in its task is step M's answer.\n"
        + (
            f'- {{"workflow": NAME, "input": TEXT}}: a named workflow of steps on an input ({", ".join(workflows)}).\n'
            if workflows
            else ""
        )
        + ('"background": true (any form): carry on at once; their answers come in one notice.\n' if background else "")
        + f"Agents:\n{listing}"
        + ("\nAgent-file warnings:\n" + "\n".join(notes) if notes else "")
    )


# -- the result the parent reads ---------------------------------------------------------------------


SPENT = ("skipped", "max_turns", "timeout")


def format_outcome(delegation: Delegation, outcome: MultiRunResult) -> ToolResult:
    """The children's answers (`_answers`), then the run they are saved as, to name to the user, and the
    ids that `task_send` continues them by (a background call's children are each a run of their own:
    only the ids)."""
    # The ids of the children the parent may continue (on its board): not an aborted one, nor one that
    # never ran or spent the turns or time its limits give it across generations (task_send refuses them).
    ids = [
        i
        for i, r in zip(outcome.task_ids, outcome.results)
        if i and r.status != "aborted" and r.stop_reason not in SPENT
    ]
    more = f"task_send continues {', '.join(ids)}" if ids else ""
    footer = f"\n\n[sub-agent run {outcome.run_id}{'; ' + more if more else ''}]" if outcome.run_id else ""
    footer = footer or (f"\n\n[{more}]" if more else "")
    kept = [r.worktree.describe(r.label.rsplit(" > ", 1)[-1]) for r in outcome.results if r.worktree is not None]
    footer += "".join(f"\n{line}" for line in kept)
    result = _answers(delegation, outcome, len(footer))
    return ToolResult(result.output + footer, is_error=result.is_error)


def format_notice(call: Delegation, ids: Sequence[str], results: Sequence[RunResult]) -> tuple[str, str]:
    """A background call's notice once all its tasks have ended, and its first line for a view: which
    tasks ended, then what the call would have returned had it waited (the answers, capped alike, and the
    ids `task_send` continues). `call`'s mode says how (a single task's, a parallel call's, ...)."""
    outcome = MultiRunResult.of(call.mode, list(results), None, False, list(ids))  # type: ignore[arg-type]
    body = format_outcome(call, outcome).output
    if len(ids) == 1:  # for a view: its answer's first line, or why it did not complete
        result = results[0]
        head, line = f"{ids[0]} {result.status}", first_line(result.output) if result.ok else result.error
    else:
        head = f"{', '.join(ids)} ended ({sum(r.ok for r in results)}/{len(ids)} completed)"
        line = first_line(body)
    return f"{head}:\n{body}", line or first_line(body) or NO_ANSWER


def _answers(delegation: Delegation, outcome: MultiRunResult, reserve: int) -> ToolResult:
    """The child's answer; or one section per task; failed children marked, never hidden."""
    results = outcome.results
    if delegation.mode == "single":
        result = results[0]
        # A labelled child's id (its label) starts the result, so the model sees the name it gave work.
        given = delegation.tasks[0].label.strip() if delegation.tasks else ""
        name = f"[{(outcome.task_ids or [None])[0] or given}] " if given else ""
        if result.ok:
            return ToolResult(f"{name}{result.output or NO_ANSWER}")
        head = f"Error: {name}agent '{result.agent}' {_status(result)}"
        return ToolResult(f"{head}\n\n{result.output}" if result.output else head, is_error=True)
    if delegation.mode == "parallel":
        labels = [r.label.rsplit(" > ", 1)[-1] for r in results]
        title = f"Parallel: {outcome.succeeded}/{outcome.total} tasks completed"
    elif delegation.mode == "workflow":
        labels = [f"{r.step_id}: {r.agent}" for r in results]
        named = f" {delegation.workflow}" if delegation.workflow else ""
        title = f"Workflow{named}: {outcome.succeeded}/{outcome.total} steps completed"
    elif outcome.ok:
        return ToolResult(results[-1].output or NO_ANSWER)
    else:
        labels = [f"{i + 1}: {r.agent}" for i, r in enumerate(results)]
        title = f"Error: {outcome.error or 'the chain did not complete'}"
    heads = [f"### [{label}] {_status(r)}" for label, r in zip(labels, results)]
    bodies = [r.output or NO_ANSWER for r in results]
    ids = outcome.task_ids or [None] * len(results)
    notes = [READ_MORE.format(id=i) if i else None for i in ids]
    bodies = fit_answers(bodies, [r.transcript for r in results], title, heads, reserve, notes)
    sections = [f"{head}\n{body}" for head, body in zip(heads, bodies)]
    return ToolResult("\n\n".join([title, *sections]), is_error=not outcome.ok)


def _status(result: RunResult) -> str:
    if result.ok:
        return "completed"
    return f"{result.status} ({result.stop_reason}): {result.error or 'no reason given'}"


def fit_answers(
    bodies: list[str],
    transcripts: list[str | None],
    title: str,
    heads: list[str],
    reserve: int,
    read_more: list[str | None] | None = None,
) -> list[str]:
    """Cut the longest bodies so the whole result (and `reserve` bytes more) stays under `MAX_ANSWER_BYTES`.

    Short bodies are kept whole; the room left is shared equally by the long ones (water-filling).

    Args:
        read_more: per body, how the parent reads the rest of a cut one (see `caps.cap_answer`).
    """
    sizes = [len(b.encode("utf-8", "surrogatepass")) for b in bodies]
    fixed = (
        reserve
        + len(title.encode("utf-8", "surrogatepass"))
        + sum(len(h.encode("utf-8", "surrogatepass")) + 3 for h in heads)
    )
    if fixed + sum(sizes) <= MAX_ANSWER_BYTES:
        return bodies
    room = MAX_ANSWER_BYTES - fixed
    order = sorted(range(len(bodies)), key=sizes.__getitem__)
    limits: dict[int, int] = {}
    for k, i in enumerate(order):
        share = room // (len(order) - k)
        if sizes[i] <= share:
            room -= sizes[i]
            continue
        for j in order[k:]:
            limits[j] = share
        break
    notes = read_more or [None] * len(bodies)
    return [
        cap_answer(b, transcripts[i], limits[i], read_more=notes[i]) if i in limits else b for i, b in enumerate(bodies)
    ]
