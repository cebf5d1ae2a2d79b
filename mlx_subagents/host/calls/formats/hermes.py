"""Hermes calls: `<tool_call>`, a JSON object `{"name": ..., "arguments": {...}}`, `</tool_call>`.

Qwen's templates write them, and a prompted model is taught them (`hermes()`, the one format the host
teaches); mlx-lm reads them with `json_tools`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from ...protocol import ToolSchema
from ..call_schema import call_schema
from ..toolcalls import CallFormat
from . import CallSyntax, Markers

START, END = "<tool_call>", "</tool_call>"


def hermes_call(name: str, arguments: Mapping[str, Any]) -> str:
    """One call in the Hermes format (what Qwen's template writes, and prompted models are taught)."""
    body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    return f"{START}\n{body}\n{END}"


def body_rules(markers: Markers, tools: list[ToolSchema], loose: frozenset[str]) -> str:
    """The call's JSON object, on a line of its own, then the end marker."""
    end = f" {markers.end}" if markers.end else ""
    return f'body: "\\n"? %json {json.dumps(call_schema(tools, loose))} "\\n"?{end}\n'


FORMAT = CallSyntax("json", "json_tools", START, END, hermes_call, body_rules)


@lru_cache(maxsize=1)
def hermes() -> CallFormat:
    """The one format a prompted model is taught: `<tool_call>{"name": ..., "arguments": ...}</tool_call>`."""
    return FORMAT.call_format()
