"""The events' payloads (`mlx_subagents/events.py`): one class per kind, checked as each event is made,
and the JSON of an event unchanged by them (what `--events` prints and transcripts record)."""

from __future__ import annotations

import json
from typing import get_args

import pytest

from mlx_subagents.events import (
    PAYLOADS,
    Event,
    EventKind,
    TaskEndData,
    ToolCallData,
    TurnStartData,
    UsageCounts,
    UsageData,
)
from mlx_subagents.results import RunUsage


def test_every_kind_has_one_payload_class_in_order() -> None:
    assert list(PAYLOADS) == list(get_args(EventKind))
    assert len(set(PAYLOADS.values())) == len(PAYLOADS)
    # Its docstring is the kind's row in docs/runs.md (a class without one would show dict's there).
    assert [kind for kind, shape in PAYLOADS.items() if not shape.__doc__] == []


def test_the_usage_counts_are_the_fields_of_run_usage() -> None:
    # events.py cannot import results.py (the vocabulary's modules import none of each other).
    assert list(UsageCounts.__annotations__) == list(RunUsage.model_fields)
    assert list(UsageData.__annotations__) == [*RunUsage.model_fields, "tps"]
    assert UsageData(**RunUsage(turns=2).model_dump(), tps=3.5) == {**RunUsage(turns=2).model_dump(), "tps": 3.5}


def test_an_event_refuses_keys_its_kind_does_not_have() -> None:
    with pytest.raises(TypeError) as missing:
        Event(kind="task_end", label="scout", agent="scout", data={"status": "completed"})
    assert str(missing.value) == (
        "a task_end event has the keys ['status']; TaskEndData has ['error', 'status', 'stop_reason'] "
        "and may have ['duration_s', 'usage']"
    )
    with pytest.raises(TypeError) as extra:
        Event(kind="waiting", label="w", agent="worker", data={"reason": "r", "why": "w"})
    assert (
        str(extra.value) == "a waiting event has the keys ['reason', 'why']; WaitingData has ['reason', 'waiting_for']"
    )
    with pytest.raises(TypeError) as other_kind:
        Event(kind="turn_start", label="s", agent="scout", data=ToolCallData(name="ls", arguments={}, description="ls"))
    assert str(other_kind.value) == (
        "a turn_start event has the keys ['arguments', 'description', 'name']; TurnStartData has []"
    )


def test_optional_keys_may_be_left_out_or_given() -> None:
    skipped = TaskEndData(status="failed", stop_reason="skipped", error="a step it needs failed")
    assert Event(kind="task_end", label="a", agent="scout", data=skipped).data == skipped
    ran = TaskEndData(status="completed", stop_reason="completed", error=None, duration_s=1.5)
    assert Event(kind="task_end", label="a", agent="scout", data=ran).data == {
        "status": "completed",
        "stop_reason": "completed",
        "error": None,
        "duration_s": 1.5,
    }
    assert Event(kind="turn_start", label="a", agent="scout", turn=3).data == TurnStartData() == {}


def test_an_events_json_keeps_its_shape() -> None:
    call = ToolCallData(name="read", arguments={"path": "a.py"}, description="read a.py")
    call["constrained"] = True
    event = Event(kind="tool_call", label="o > scout", agent="scout", turn=2, data=call)
    assert json.dumps(event.to_json()) == (
        '{"kind": "tool_call", "label": "o > scout", "agent": "scout", "turn": 2, '
        '"data": {"name": "read", "arguments": {"path": "a.py"}, "description": "read a.py", "constrained": true}}'
    )
    usage = UsageData(**RunUsage(input_tokens=10, turns=1).model_dump(), tps=12.5)
    assert json.dumps(Event(kind="usage", label="s", agent="scout", turn=1, data=usage).to_json()["data"]) == (
        '{"input_tokens": 10, "output_tokens": 0, "cached_tokens": 0, "context_tokens": 0, "turns": 1, '
        '"compactions": 0, "kv_bytes": 0, "constrained_calls": 0, "constrained_answers": 0, "prefill_wait_s": 0.0, '
        '"drafted_tokens": 0, "accepted_tokens": 0, "kv_bits": null, '
        '"tps": 12.5}'
    )
