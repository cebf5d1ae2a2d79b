"""Run results: the pydantic objects `subagent run --json` prints and the Python API returns."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import Any, Literal, Optional

from pydantic import BaseModel, Field

# native: the chat template presents the tools and the model's own call format is parsed;
# prompted: the host puts the tool list and one call format in the system prompt and parses that.
ToolMode = Literal["native", "prompted"]
Status = Literal["completed", "failed", "aborted"]
StopReason = Literal[
    "completed",
    "max_turns",
    "max_tokens",
    "context_window",
    "timeout",
    "cancelled",
    "error",
    "format_errors",
    "schema",
    "skipped",
    "repetition",
    "empty_answer",
]
Mode = Literal["single", "parallel", "chain", "workflow"]
# A task's status as its snapshot reports it: `queued` until it holds a slot, `running`, then its result's.
LiveStatus = Literal["queued", "running", "completed", "failed", "aborted"]
# The error of a task a person stopped (Ctrl-C).
INTERRUPTED = "aborted by the user (Ctrl-C)"


class RunUsage(BaseModel):
    """Token accounting summed over a task's turns."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    context_tokens: int = 0
    turns: int = 0
    compactions: int = 0
    kv_bytes: int = 0
    constrained_calls: int = 0  # tool calls a grammar held to a known tool and valid arguments
    constrained_answers: int = 0  # final answers a grammar held to the output schema
    prefill_wait_s: float = 0.0  # seconds its replies waited while other sessions' prompts were prefilled
    # Tokens drafted to be checked in one forward (`--draft`), and of those the ones the model kept.
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # Bits per KV value the model's cache held (`--kv-bits`: 16 is not quantized); None: no local cache
    # (an engine, a scripted model).
    kv_bits: Optional[int] = None

    def add(self, other: RunUsage) -> RunUsage:
        fields = (
            "input_tokens",
            "output_tokens",
            "cached_tokens",
            "turns",
            "compactions",
            "constrained_calls",
            "constrained_answers",
            "drafted_tokens",
            "accepted_tokens",
        )
        data: dict[str, Any] = {f: getattr(self, f) + getattr(other, f) for f in fields}
        data["prefill_wait_s"] = round(self.prefill_wait_s + other.prefill_wait_s, 3)
        data["context_tokens"] = max(self.context_tokens, other.context_tokens)
        data["kv_bytes"] = self.kv_bytes + other.kv_bytes
        # One setting per host; tasks on different models may differ: the widest counts.
        data["kv_bits"] = max((b for b in (self.kv_bits, other.kv_bits) if b is not None), default=None)
        return RunUsage(**data)


class ChildUsage(BaseModel):
    """One sub-agent's share of its parent's work (an entry of `RunResult.children`)."""

    label: str
    agent: str
    status: Status
    usage: RunUsage


class ChildrenUsage(BaseModel):
    """What a task's sub-agents used, so that a caller sees the whole cost of a delegating task: the
    total, and one entry per sub-agent (their own sub-agents after them, labelled `a > b > c`)."""

    usage: RunUsage
    tasks: list[ChildUsage]


class WorktreeResult(BaseModel):
    """What an isolated task (`isolation: worktree`) left: its branch and a diffstat, or no changes
    (its worktree and branch then removed)."""

    branch: Optional[str] = None  # None: it changed nothing
    name: str = ""  # what `subagent apply` takes
    path: str = ""
    diffstat: str = ""
    files: list[str] = Field(default_factory=list)

    def describe(self, label: str) -> str:
        """One line for the person and the parent: where the changes are and how to bring them in."""
        if self.branch is None:
            return f"[{label}: no changes in its worktree; removed]"
        return f"[{label}: changes on branch {self.branch} ({self.diffstat}); apply with: subagent apply {self.name}]"


class RunResult(BaseModel):
    """One task's outcome."""

    agent: str
    task: str
    status: Status
    output: str = ""
    # A thinking model's reasoning before its final reply: apart from `output`, which it never enters.
    reasoning: str = ""
    error: str | None = None
    usage: RunUsage = Field(default_factory=RunUsage)
    model: str = ""
    tool_mode: ToolMode | None = None  # how the model was given its tools (see ModelHost.tool_mode)
    stop_reason: StopReason = "completed"
    duration_s: float = 0.0
    label: str = ""
    step_id: str | None = None
    run_id: str | None = None
    transcript: str | None = None
    parsed: Any = None
    children: ChildrenUsage | None = None  # None: it started no sub-agent
    worktree: WorktreeResult | None = None  # None: it ran in the shared tree

    @property
    def ok(self) -> bool:
        return self.status == "completed"


class MultiRunResult(BaseModel):
    """A parallel, chain or workflow run: every task's result in input (or step) order.

    `error` says why a chain stopped ("Chain stopped at step N: ..."); `interrupted` is True when
    the run was cancelled (Ctrl-C) and some tasks were aborted.
    """

    mode: Mode
    succeeded: int
    total: int
    results: list[RunResult]
    run_id: str | None = None
    interrupted: bool = False
    error: str | None = None
    # A delegated request's children: their ids on the parent's task board, in result order (None:
    # not kept). Not part of the printed result.
    task_ids: list[Optional[str]] = Field(default_factory=list, exclude=True)

    @classmethod
    def of(
        cls,
        mode: Mode,
        results: list[RunResult],
        run_id: str | None,
        interrupted: bool,
        task_ids: list[str | None] | None = None,
    ) -> MultiRunResult:
        """A run's outcome from its results (in order); a chain's `error` is where it stopped."""
        return cls(
            mode=mode,
            succeeded=sum(r.ok for r in results),
            total=len(results),
            results=results,
            run_id=run_id,
            interrupted=interrupted,
            error=chain_stop(results) if mode == "chain" else None,
            task_ids=list(task_ids) if task_ids and any(task_ids) else [],
        )

    @property
    def ok(self) -> bool:
        return self.succeeded == self.total

    @property
    def aborted(self) -> list[RunResult]:
        return [r for r in self.results if r.status == "aborted"]


class TaskStatus(BaseModel):
    """A task's state at one moment, for the tools, the chat and the MCP server alike.

    `output` is the final answer when it ended, else the last reply text so far (the partial output).
    """

    id: str
    agent: str
    status: LiveStatus
    # `command`: a background `bash` command (`bash#1`): `last_tool` is the command, `output` its last line.
    kind: Literal["agent", "command"] = "agent"
    turn: int = 0
    tokens: int = 0
    last_tool: str | None = None
    elapsed_s: float = 0.0
    output: str = ""
    error: str | None = None
    run_id: str | None = None
    worktree: WorktreeResult | None = None  # an isolated task's, once it ended
    exit_code: int | None = None  # a command's, once it exited


def stop_reason(signum: int) -> str:
    """The error of a task stopped by a signal: Ctrl-C's, or "stopped by SIGTERM" (SIGHUP, ...)."""
    return INTERRUPTED if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"


def chain_stop(results: Sequence[RunResult]) -> str | None:
    """`Chain stopped at step N: <reason>` for the first step that did not complete."""
    for i, result in enumerate(results):
        if not result.ok:
            return f"Chain stopped at step {i + 1}: {result.error or result.stop_reason}"
    return None
