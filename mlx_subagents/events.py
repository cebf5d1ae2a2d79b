"""Typed events a running session reports, for live progress and `--events`.

An `Event` says which task (`label`, `agent`) at which turn, what happened (`kind`, the discriminator)
and the payload of that kind (`data`). Each kind's payload is one `TypedDict` below, whose docstring is
the one description of its keys: the table of events in docs/runs.md is generated from them
(`python tests/test_docs.py`; tests/test_docs.py checks it). An emitter builds its payload with the
class (`ToolCallData(name=..., ...)`) so that the keys are named where they are set; a reader that knows
the kind reads the payload as that class (`cast(ToolCallData, event.data)`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypedDict

EventKind = Literal[
    "waiting",
    "task_start",
    "turn_start",
    "prefill",
    "decode",
    "reasoning",
    "text",
    "tool_call",
    "tool_result",
    "message",
    "usage",
    "compaction",
    "task_end",
    "task_send",
    "task_notice",
    "child_message",
    "task_cancel",
    "hook_warning",
    "sampling",
    "elicitation",
]


# What a task waits for before it starts: a `waiting` event's `waiting_for`, `task_start`'s `waited_for`.
SLOT = "a slot"
WRITER_LEASE = "the writer lease"


class WaitingData(TypedDict):
    """The task waits before it starts: `waiting_for` `a slot` (every slot of `--concurrency` is taken) or
    `the writer lease` (one agent that can change files works in a workspace at a time); `reason` says so,
    for its progress line (a slot's wait is shown by the live views and `subagent watch`, not as a line)."""

    waiting_for: str
    reason: str


class _TaskStartKeys(TypedDict):
    """Every `task_start` event has these keys."""

    task: str
    model: str
    tool_mode: str


class TaskStartData(_TaskStartKeys, total=False):
    """The task starts: its `task` (the prompt it was given), the `model` it runs on, its `tool_mode`
    (how the model is given its tools) and the `step_id` of the chain or workflow step it is (null for
    other tasks; an `AgentSession` run outside a runner knows no steps and leaves it out); a task that
    waited to start also says how long, `waited_s`, and for what, `waited_for` (`a slot` or `the writer
    lease`), for the timeline of its run."""

    step_id: str | None
    waited_s: float
    waited_for: str


class TurnStartData(TypedDict):
    """A turn (one model call) starts; the event's own `turn` counts it, so the payload is empty."""


class PrefillData(TypedDict):
    """The host starts prefilling the turn's prompt: the `tokens` it computes now (the session's KV cache
    does not hold them) and the `cached` ones it reuses, so that a view can say "prefilling N tokens"
    until the first token comes (an engine does not say, and has no such event)."""

    tokens: int
    cached: int


class DecodeData(TypedDict):
    """The reply decodes: the `tokens` it has generated so far (call markup and reasoning included) and
    `tps`, their rate since its first token (0 at first); reported at the first token, then at most once a
    second, so that a view shows it alive and how fast."""

    tokens: int
    tps: float


class ReasoningData(TypedDict):
    """A thinking model's reasoning streams: `text` is the next piece of it, so that a view can count or
    fold it as it grows."""

    text: str


class TextData(TypedDict):
    """The reply's visible text streams: `text` is the next piece of it, for a live view (the `message`
    event has all of it, so transcripts do not record these)."""

    text: str


class _ToolCallKeys(TypedDict):
    """Every `tool_call` event has these keys."""

    name: str
    arguments: dict[str, Any]
    description: str


class ToolCallData(_ToolCallKeys, total=False):
    """The model calls a tool: its `name`, its `arguments` and a short `description` for the progress
    line (`read src/app.py`); `constrained` is there, and true, when the grammar held the call to a
    known tool and valid arguments; `id` is the call's id in its reply (`call_0`), which its
    `tool_result` repeats, so that a view can pair them when calls run at once."""

    constrained: bool
    id: str


class _ToolResultKeys(TypedDict):
    """Every `tool_result` event has these keys."""

    name: str
    is_error: bool
    output: str


class ToolResultData(_ToolResultKeys, total=False):
    """A tool call returns: the tool's `name` (`?` for a call that could not be parsed), whether it
    `is_error`, and its `output` cut to 2,000 characters, so that a view can show why a call failed;
    `id` is its call's (absent for a call that could not be parsed)."""

    id: str


class _MessageKeys(TypedDict):
    """Every `message` event has these keys."""

    text: str


class MessageData(_MessageKeys, total=False):
    """The model's reply holds text: `text` is all of it; `constrained` is there, and true, when the
    grammar held the answer to the task's output schema."""

    constrained: bool


class UsageCounts(TypedDict):
    """`RunUsage` dumps a task's token accounting so far as these keys; the vocabulary's modules import
    none of each other, so the keys are repeated here (tests/test_events.py checks that they match)."""

    input_tokens: int
    output_tokens: int
    cached_tokens: int
    context_tokens: int
    turns: int
    compactions: int
    kv_bytes: int
    constrained_calls: int
    constrained_answers: int
    prefill_wait_s: float
    drafted_tokens: int
    accepted_tokens: int
    kv_bits: int | None


class UsageData(UsageCounts):
    """A reply has been counted: the task's usage so far (the fields of `RunUsage`) and `tps`, the
    tokens per second the reply was decoded at, for the live table."""

    tps: float


class CompactionData(TypedDict):
    """The older turns were summarised to fit the context window: the conversation's tokens before and
    after (`tokens_before`, `tokens_after`) and how many messages the summary replaced
    (`n_summarized`)."""

    tokens_before: int
    tokens_after: int
    n_summarized: int


class _TaskEndKeys(TypedDict):
    """Every `task_end` event has these keys."""

    status: str
    stop_reason: str
    error: str | None


class TaskEndData(_TaskEndKeys, total=False):
    """The task ends: its result's `status`, `stop_reason` and `error` (null unless it failed or was
    stopped); a task that ran also has its `usage` (the counts of a `usage` event, without `tps`) and
    `duration_s`, while one that never started (skipped, cancelled first, not set up) has no more."""

    usage: UsageCounts
    duration_s: float


class TaskSendData(TypedDict):
    """A message sent to the task reaches it: `message` is the text, which the task reads as a user
    message at its next turn."""

    message: str


class TaskNoticeData(TypedDict):
    """A background call of the task ended (its last child did): the children's `id`s (`scout#1,
    scout#2`), `completed` when each did (else `failed`), the `first_line` of the answers as the call
    returns them (one child's answer, or `Parallel: 2/2 tasks completed`), the notice's `text` as its
    parent reads it (every answer), and a lone child's `run_id` (null for several, or when its run is
    not saved), so that a view can say so and link to it. A background command's end is one too."""

    id: str
    status: str
    first_line: str
    text: str
    run_id: str | None


class ChildMessageData(TypedDict):
    """A child of the task sent it a message while it works (`parent_send`): the child's `id` and its
    `message`, which the task reads at its next turn and may answer with `task_send`."""

    id: str
    message: str


class TaskCancelData(TypedDict):
    """The task was cancelled; `reason` says why (the error its result carries)."""

    reason: str


class HookWarningData(TypedDict):
    """A hook failed without blocking, or the project's hooks were not allowed; `message` says which and
    why, in every view, since the user relies on the hook."""

    message: str


class SamplingData(TypedDict):
    """An MCP server the task was calling asked for a completion (`sampling/createMessage`): the
    `server`, the `model` that answered ("" when refused), the tokens it read (`input_tokens`, of them
    `cached_tokens`) and generated (`output_tokens`, counted in the task's usage), its `stop_reason`,
    and `error`: null, or why it was refused (`sampling: off`, a project server without consent)."""

    server: str
    model: str
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    stop_reason: str
    error: str | None


class ElicitationData(TypedDict):
    """An MCP server the task was calling asked the person for input (`elicitation/create`): the
    `server`, its `message`, the `mode` (`form` or `url`), the `action` sent back (`accept`,
    `decline`, `cancel`) and `reason`: null, or why it was declined without asking (nobody can answer
    there: a run without a terminal, `subagent mcp`, a background task)."""

    server: str
    message: str
    mode: str
    action: str
    reason: str | None


EventData = (
    WaitingData
    | TaskStartData
    | TurnStartData
    | PrefillData
    | DecodeData
    | ReasoningData
    | TextData
    | ToolCallData
    | ToolResultData
    | MessageData
    | UsageData
    | CompactionData
    | TaskEndData
    | TaskSendData
    | TaskNoticeData
    | ChildMessageData
    | TaskCancelData
    | HookWarningData
    | SamplingData
    | ElicitationData
)

# Each kind's payload class, in the order of `EventKind`.
PAYLOADS: dict[EventKind, type[Any]] = {
    "waiting": WaitingData,
    "task_start": TaskStartData,
    "turn_start": TurnStartData,
    "prefill": PrefillData,
    "decode": DecodeData,
    "reasoning": ReasoningData,
    "text": TextData,
    "tool_call": ToolCallData,
    "tool_result": ToolResultData,
    "message": MessageData,
    "usage": UsageData,
    "compaction": CompactionData,
    "task_end": TaskEndData,
    "task_send": TaskSendData,
    "task_notice": TaskNoticeData,
    "child_message": ChildMessageData,
    "task_cancel": TaskCancelData,
    "hook_warning": HookWarningData,
    "sampling": SamplingData,
    "elicitation": ElicitationData,
}


@dataclass(frozen=True)
class Event:
    """One thing that happened in one task; `data` is the payload of its `kind` (`PAYLOADS`)."""

    kind: EventKind
    label: str
    agent: str
    turn: int = 0
    data: EventData = field(default_factory=TurnStartData)

    def __post_init__(self) -> None:
        """Refuse a payload whose keys are not its kind's: no type checker runs on the project, so the
        keys are checked here, where every test that runs a task passes."""
        shape = PAYLOADS[self.kind]
        required, optional = shape.__required_keys__, shape.__optional_keys__
        keys = set(self.data)
        if not required <= keys <= required | optional:
            raise TypeError(
                f"a {self.kind} event has the keys {sorted(keys)}; {shape.__name__} has {sorted(required)}"
                + (f" and may have {sorted(optional)}" if optional else "")
            )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


EventSink = Callable[[Event], None]


@dataclass
class Fanout:
    """One sink that passes each event to several; a front end adds its views as it builds them."""

    targets: list[EventSink] = field(default_factory=list)

    def __call__(self, event: Event) -> None:
        for target in self.targets:
            target(event)


def ignore_event(_event: Event) -> None:
    """The default sink."""
