"""JSON schemas for the grammars: one call's body, an answer's schema, tool parameters inlined.

What every call format's grammar rules (`formats/`) and the answer's grammar (`grammar.py`) build on:
the schemas llguidance's `%json` terms compile, closed to keys they do not list, their `$ref`s moved
or inlined where a format writes a value on its own.
"""

from __future__ import annotations

from typing import Any

from ..protocol import ToolSchema

# Separators as `json.dumps` writes them (and so the templates): flexible whitespace would let a
# small model pad a call with blanks until its token limit.
GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def function_of(tool: ToolSchema) -> dict[str, Any]:
    """A tool's function (`name`, `parameters`), from the OpenAI shape or a bare function."""
    return tool.get("function", tool)


def _parameters(tool: ToolSchema, i: int, loose: frozenset[str], defs: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameter schema, its `$defs` moved to `defs` renamed per tool (`$ref`s resolve from the root)."""
    function = function_of(tool)
    if function["name"] in loose:
        return {"type": "object"}
    parameters = dict(function.get("parameters") or {"type": "object"})
    for key in ("$defs", "definitions"):
        for name, schema in (parameters.pop(key, None) or {}).items():
            defs[f"t{i}_{name}"] = _renamed(schema, i)
    return closed(_renamed(parameters, i))


def closed(schema: Any) -> Any:
    """`schema` with every object that lists its properties closed to others, as OpenAI's strict mode
    has it: a small model would otherwise invent keys until its token limit (an open object,
    `additionalProperties` given, stays as it is)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("enum", "const", "default", "examples") else closed(v)) for k, v in schema.items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def call_schema(tools: list[ToolSchema], loose: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The JSON schema of one call body: any of the tools, each by its name and with its parameters
    (any object for the tools named in `loose`)."""
    defs: dict[str, Any] = {}
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": function_of(t)["name"]}, "arguments": _parameters(t, i, loose, defs)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for i, t in enumerate(tools)
    ]
    return {"anyOf": variants, **({"$defs": defs} if defs else {}), "x-guidance": GUIDANCE}


def _renamed(schema: Any, i: int) -> Any:
    """`schema` with its local `$ref`s pointing at tool `i`'s definitions at the root."""
    if isinstance(schema, list):
        return [_renamed(s, i) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _renamed(v, i) for k, v in schema.items()}
    ref = out.get("$ref")
    for prefix in ("#/$defs/", "#/definitions/"):
        if isinstance(ref, str) and ref.startswith(prefix):
            out["$ref"] = f"#/$defs/t{i}_{ref[len(prefix) :]}"
    return out


def inlined(schema: Any, root: Any = None, depth: int = 0) -> Any:
    """`schema` with its local `$ref`s replaced by what they point at (a parameter's value is written
    on its own, where the root's `$defs` are out of reach); None where a `$ref` does not resolve or
    nests too deep (a recursive schema), and the tool's parameters are then free."""
    root = schema if root is None else root
    if depth > 16:
        return None
    if isinstance(schema, list):
        items = [inlined(s, root, depth + 1) for s in schema]
        return None if any(i is None for i in items) else items
    if not isinstance(schema, dict):
        return schema
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target: Any = root
        for part in ref.removeprefix("#/").split("/") if ref.startswith("#/") else [None]:
            target = target.get(part) if isinstance(target, dict) and part is not None else None
        return None if target is None else inlined(target, root, depth + 1)
    out = {k: inlined(v, root, depth + 1) for k, v in schema.items() if k not in ("$defs", "definitions")}
    return None if any(v is None for v in out.values()) else out
