"""Mistral's calls: `[TOOL_CALLS]`, then a JSON list of `{"name": ..., "arguments": ...}` objects or one
`NAME[ARGS]{...}` header per call; no end marker, a call runs to the end of the reply. mlx-lm reads
them with `mistral`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ...protocol import ToolSchema
from ..call_schema import GUIDANCE, call_schema, closed, function_of, inlined
from . import CallSyntax, Markers

ARGS = "[ARGS]"  # the separator between a tool's name and its arguments in a header


def write_call(name: str, arguments: Mapping[str, Any]) -> str:
    """One call as a Mistral header: `[TOOL_CALLS]NAME[ARGS]{...}`."""
    return f"[TOOL_CALLS]{name}{ARGS}{json.dumps(dict(arguments), ensure_ascii=False)}"


def body_rules(markers: Markers, tools: list[ToolSchema], loose: frozenset[str]) -> str:
    """The JSON list of calls, or one header per call; the header form only where every tool's
    arguments can be written without the root's `$defs`."""
    items = call_schema(tools, loose)
    defs = items.pop("$defs", None)
    listed = {
        "type": "array",
        "items": items,
        "minItems": 1,
        **({"$defs": defs} if defs else {}),
        "x-guidance": GUIDANCE,
    }
    headers = []
    for tool in tools:
        function = function_of(tool)
        arguments = (
            {"type": "object"} if function["name"] in loose else closed(inlined(function.get("parameters") or {}))
        )
        if arguments is None:  # a header's arguments cannot see the root's `$defs`: the list form only
            headers = []
            break
        headers.append(
            f"{json.dumps(function['name'])} {markers.term(ARGS)} %json {json.dumps({**arguments, 'x-guidance': GUIDANCE})}"
        )
    header = f"\nheader: {' | '.join(headers)}" if headers else ""
    return f"body: %json {json.dumps(listed)}{' | header+' if headers else ''}{header}\n"


FORMAT = CallSyntax("mistral", "mistral", "[TOOL_CALLS]", "", write_call, body_rules)
