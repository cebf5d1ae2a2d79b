"""Reading what a user hands over (tasks, workflow, schema, script and agent files) with one-line errors.

Every way such input can be bad ends as one `SubagentError` line naming the file and the fix: a file
that cannot be read (`OSError`, not UTF-8), a syntax error, data nested deeper than Python's parsers
recurse (`RecursionError`), or data pydantic rejects (`ValidationError`). Callers pick the error
class, so the CLI's error boundary prints them all the same way.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from .errors import SubagentError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

Format = Literal["json", "yaml", "toml"]
# Deeper data is refused when it is read, so that no later step that walks it (validation, events,
# transcripts) can hit Python's recursion limit; serde_json stops at the same depth.
MAX_NESTING = 128
TOO_DEEP = f"the data is nested more than {MAX_NESTING} levels deep; flatten it"


def os_reason(exc: OSError) -> str:
    """Why a file operation failed, as the OS says it (`No such file or directory`)."""
    return exc.strerror or str(exc)


def read_text(path: Path, what: str, error: type[SubagentError]) -> str:
    """The file's UTF-8 text; otherwise `error("{path}: cannot read the {what}: {reason}")`.

    Args:
        what: the kind of file, as the user knows it ("tasks file", "workflow file").
    """
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise error(f"{path}: cannot read the {what}: it is not UTF-8 text; save it as UTF-8") from None
    except OSError as exc:
        raise error(f"{path}: cannot read the {what}: {os_reason(exc)}") from None


def parse_text(text: str, fmt: Format, where: str, error: type[SubagentError]) -> Any:
    """JSON, YAML or TOML text as data; a syntax error or too deep nesting is one `error` line.

    Args:
        where: what the error line starts with, usually the file's path.
    """
    try:
        if fmt == "json":
            data = json.loads(text)
        elif fmt == "yaml":
            data = yaml.safe_load(text)
        else:
            data = tomllib.loads(text)
    except RecursionError:
        raise error(f"{where}: {TOO_DEEP}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{where}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except yaml.YAMLError as exc:
        raise error(f"{where}: invalid YAML{yaml_problem(exc)}") from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{where}: invalid TOML: {exc}") from None
    if nesting(data) > MAX_NESTING:
        raise error(f"{where}: {TOO_DEEP}")
    return data


def nesting(data: Any) -> int:
    """How many lists and mappings deep `data` goes (0 for a scalar); a loop, so any depth is safe."""
    deepest = 0
    pending = [(data, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, list):
            deepest = max(deepest, depth)
            pending.extend((item, depth + 1) for item in value)
    return deepest


def load_file(path: Path, fmt: Format, what: str, error: type[SubagentError]) -> Any:
    """`read_text` then `parse_text`: a user's data file, every problem one `error` line naming it."""
    return parse_text(read_text(path, what, error), fmt, str(path), error)


def yaml_problem(exc: yaml.YAMLError, first_line: int = 1) -> str:
    """` at line L column C: problem` for a YAML error (`first_line`: the file line the YAML starts on)."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + first_line} column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc)
    return f"{where}: {one_line(problem)}"


# --- pydantic errors --------------------------------------------------------------------------------


def error_path(loc: Sequence[int | str]) -> str:
    """`steps[0].id` for pydantic's location `('steps', 0, 'id')`; empty for the whole value."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def error_message(err: ErrorDetails) -> str:
    """pydantic's message for one error on one line, without its `Value error, ` prefix."""
    return one_line(err["msg"].removeprefix("Value error, "))


def first_error(exc: ValidationError, prefix: Sequence[int | str] = ()) -> str:
    """`path: message` for the first error, `(and N more problems)` when there are more.

    Args:
        prefix: location parts to put before pydantic's own (`("tasks", 2)` for the third item).
    """
    errors = exc.errors()
    path = error_path([*prefix, *errors[0]["loc"]])
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    message = error_message(errors[0])
    return f"{path}: {message}{more}" if path else f"{message}{more}"


def one_line(text: str) -> str:
    """`text` with every run of whitespace, newlines included, made one space."""
    return " ".join(text.split())
