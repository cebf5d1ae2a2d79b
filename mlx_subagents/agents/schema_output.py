"""Structured output: the final answer must be JSON valid against a JSON schema.

The schema comes from `--schema FILE.json` or an agent's `output_schema`. The task tells the model
the schema; an answer that is not JSON, or not valid against it, goes back to the model once with
the validation error; a second bad answer fails the task with that error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import SchemaFileError
from ..userfiles import TOO_DEEP, data_problem, load_file

# A model often wraps JSON in a fenced block; that is accepted, prose around it is not.
FENCE = "```"


class AnswerMismatch(ValueError):
    """The answer is not JSON, or not valid against the schema; the message says where and why."""


def load_schema(path: Path) -> dict[str, Any]:
    """Read and check a schema file; every problem is one `SchemaFileError` line naming the file."""
    schema = load_file(path, "json", "schema file", SchemaFileError)
    check_schema(schema, str(path))
    return schema


def check_schema(schema: Any, where: str) -> None:
    """Raise `SchemaFileError` unless `schema` is a valid JSON schema (a mapping) whose `$ref`s all resolve."""
    import jsonschema

    if not isinstance(schema, dict):
        raise SchemaFileError(f"{where}: a JSON schema must be an object, not a {type(schema).__name__}")
    if problem := data_problem(schema):  # jsonschema walks it recursively
        raise SchemaFileError(f"{where}: {problem}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
        _check_refs(schema, where)
    except jsonschema.SchemaError as exc:
        raise SchemaFileError(f"{where}: not a valid JSON schema: {_describe(exc)}") from None


def _check_refs(schema: dict[str, Any], where: str) -> None:
    """Resolve every `$ref` now: jsonschema would only fail on it when it checks an answer."""
    from jsonschema_specifications import REGISTRY  # the drafts' meta-schemas, as jsonschema resolves them
    from referencing.exceptions import Unresolvable
    from referencing.jsonschema import DRAFT202012, specification_with

    # jsonschema's own default dialect, for a schema without `$schema`.
    specification = specification_with(str(schema.get("$schema", "")), default=DRAFT202012)
    root = specification.create_resource(schema)
    pending = [(REGISTRY.resolver_with_root(root), root)]
    while pending:
        resolver, resource = pending.pop()
        ref = resource.contents.get("$ref") if isinstance(resource.contents, dict) else None
        if isinstance(ref, str):
            try:
                resolver.lookup(ref)
            except Unresolvable:
                raise SchemaFileError(
                    f"{where}: $ref {ref!r} cannot be resolved; point it at a part of this schema, "
                    "e.g. '#/$defs/NAME' (other files and URLs are not fetched)"
                ) from None
        pending.extend((resolver.in_subresource(sub), sub) for sub in resource.subresources())


def schema_instruction(schema: dict[str, Any]) -> str:
    """What the task says about the answer's format."""
    return (
        "\n\nYour final answer (the reply without a tool call) must be only a JSON value, with no other text, "
        f"valid against this JSON schema:\n{json.dumps(schema, ensure_ascii=False)}"
    )


def retry_message(error: str) -> str:
    """The follow-up the model gets after a bad answer."""
    return (
        f"Your final answer does not match the required JSON schema: {error}\n"
        "Reply again with only the corrected JSON value, no other text."
    )


def parse_answer(text: str, schema: dict[str, Any]) -> Any:
    """The answer as a JSON value valid against `schema`; `AnswerMismatch` otherwise."""
    import jsonschema

    value = _load_json(text)
    if problem := data_problem(value):  # jsonschema walks it recursively
        raise AnswerMismatch(f"the answer is too large to check: {problem}")
    validator = jsonschema.validators.validator_for(schema)(schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is not None:
        raise AnswerMismatch(_describe(error))
    return value


def _load_json(text: str) -> Any:
    body = text.strip()
    if body.startswith(FENCE):
        body = body[len(FENCE) :]
        body = body.split("\n", 1)[1] if "\n" in body else ""  # drop the language tag line
        body = body.rsplit(FENCE, 1)[0].strip()
    if not body:
        raise AnswerMismatch("the answer is empty, not JSON")
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise AnswerMismatch(
            f"the answer is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise AnswerMismatch(f"the answer is too large to check: {TOO_DEEP}") from None


def _describe(error: Any) -> str:
    """`at $.items[0].name: 'x' is not of type 'integer'`; `at $` for the top level."""
    path = "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    return f"at {path}: {error.message}"
