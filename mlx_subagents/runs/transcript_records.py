"""A transcript's records as they are read back (`read_transcript`): the shape `show` and `resume` rely
on in a `task`, a `messages` and a `result` record, and the one-line reason a line that is not a
well-formed record is skipped. Other record types need only a `type` and a positive `generation`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from ..results import RunResult


class _ToolCallRecord(BaseModel):
    model_config = ConfigDict(extra="allow")

    function: dict[str, Any]


class _MessageRecord(BaseModel):
    """The shape `resume` and `show` rely on; other keys are kept as they are."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[_ToolCallRecord] | None = None


class _TaskRecord(BaseModel):
    model_config = ConfigDict(extra="allow")

    agent: str
    model: str
    cwd: str


# What `show` and `resume` read from a record: (the field, or None for the whole record; its shape).
_RECORD_SHAPES: dict[str, tuple[str | None, TypeAdapter[Any]]] = {
    "task": (None, TypeAdapter(_TaskRecord)),
    "messages": ("messages", TypeAdapter(list[_MessageRecord])),
    "result": ("result", TypeAdapter(RunResult)),
}


def record_problem(line: bytes) -> dict[str, Any] | str:
    """The record on this line, or what is wrong with it."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "not valid JSON (cut short?)"
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not a record object"
    kind, generation = record.get("type"), record.get("generation", 1)
    if not isinstance(kind, str):
        return "no 'type' field"
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 1:
        return f"{kind} record: 'generation' is not a positive whole number"
    if kind not in _RECORD_SHAPES:
        return record
    key, shape = _RECORD_SHAPES[kind]
    try:
        shape.validate_python(record if key is None else record.get(key))
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in (key, *err["loc"]) if p is not None) or "record"
        # pydantic names the class it wanted; a user knows the record's fields, not our classes.
        msg = "Input should be a JSON object" if err["type"] == "model_type" else err["msg"]
        return f"{kind} record: '{where}': {msg}"
    n = record.get("from_parent", 1)
    if kind == "messages" and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        return "messages record: 'from_parent' is not a positive whole number"
    return record
