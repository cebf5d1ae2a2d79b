"""Qwen3-Coder's XML calls: `<tool_call>`, `<function=NAME>`, a `<parameter=NAME>` block per argument,
`</function>`, `</tool_call>`; mlx-lm reads them with `qwen3_coder`.

A string's value is written as text, any other value as JSON (as the Qwen3-Coder template writes it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ...protocol import ToolSchema
from ..call_schema import GUIDANCE, function_of, inlined
from . import CallSyntax, Markers


def write_call(name: str, arguments: Mapping[str, Any]) -> str:
    """One call in Qwen3-Coder's XML."""
    parameters = "".join(
        f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}\n</parameter>\n"
        for key, value in arguments.items()
    )
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


def body_rules(markers: Markers, tools: list[ToolSchema], loose: frozenset[str]) -> str:
    """`<function=NAME>` then `<parameter=NAME>` blocks: each tool's parameters in its schema's order,
    the required ones always; a string's value is text, another's JSON."""
    end = f" {markers.end}" if markers.end else ""
    rules, functions = [], []
    for i, tool in enumerate(tools):
        function = function_of(tool)
        name, parameters = function["name"], inlined(function.get("parameters") or {})
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        if name in loose or not isinstance(properties, dict):
            params = "any_param*"
        else:
            required, parts = set(parameters.get("required") or ()), []
            for j, (pname, pschema) in enumerate(properties.items()):
                value = f"v{i}_{j}"
                opening = json.dumps(f"<parameter={pname}>\n")
                rules.append(f'p{i}_{j}: {opening} {value} "\\n</parameter>\\n"')
                rules.append(_value_rule(value, pschema if isinstance(pschema, dict) else {}))
                parts.append(f"p{i}_{j}" if pname in required else f"p{i}_{j}?")
            params = " ".join(parts)
        functions.append(f"f{i}")
        opening = json.dumps(f"<function={name}>\n")  # quoted as JSON: a name cannot break the grammar
        rules.append(f'f{i}: {opening} {params} "</function>"')
    rules.append('any_param: "<parameter=" /[A-Za-z0-9_.-]{1,64}/ ">\\n" TEXT "\\n</parameter>\\n"')
    rules.append("TEXT: /[^<]*(<[^\\/][^<]*)*/")
    return f'body: "\\n"? ({" | ".join(functions)}) "\\n"?{end}\n' + "\n".join(rules) + "\n"


def _value_rule(rule: str, schema: dict[str, Any]) -> str:
    """A parameter's value: a string's as text (or one of its enum's), anything else as JSON."""
    if schema.get("type") == "string" or (
        not schema.get("type") and all(isinstance(v, str) for v in schema.get("enum") or [0])
    ):
        if schema.get("enum"):
            return f"{rule}: " + " | ".join(json.dumps(v) for v in schema["enum"])
        return f"{rule}: TEXT"
    return f"{rule}: %json {json.dumps({**schema, 'x-guidance': GUIDANCE})}"


FORMAT = CallSyntax("xml", "qwen3_coder", "<tool_call>", "</tool_call>", write_call, body_rules)
