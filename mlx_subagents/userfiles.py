"""Reading what a user hands over (tasks, workflow, schema, script and agent files, project instructions,
models to import) through one guard, with one-line errors.

Every file goes through `open_regular`: it is opened without waiting (a FIFO never blocks), the opened
file must be a regular file (never a FIFO, device or socket: `/dev/zero` is never read) of at most its
kind's size (checked on the open file before anything is read or allocated, and no more than that is
ever read, even from a file that grows meanwhile).

Every way such input can be bad ends as one `SubagentError` line naming the file and the fix: a file
that cannot be read (`OSError`, not UTF-8, not a regular file, too large), a syntax error, data nested
deeper than 128 levels (past
it, Python's parsers and every later walk raise `RecursionError`) or expanding through YAML aliases to
more than a million values, or data pydantic rejects (`ValidationError`). Callers pick the error
class, so the CLI's error boundary prints them all the same way.
"""

from __future__ import annotations

import codecs
import errno
import json
import math
import os
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from .errors import SubagentError
from .text import squash

if TYPE_CHECKING:
    import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

Format = Literal["json", "yaml", "toml"]
# Deeper data is refused when it is read, so that no later step that walks it (validation, events,
# transcripts) can hit Python's recursion limit; serde_json stops at the same depth.
MAX_NESTING = 128
TOO_DEEP = f"the data is nested more than {MAX_NESTING} levels deep; flatten it"
# YAML aliases can make a small file stand for billions of values; anything that walks them would hang.
MAX_VALUES = 1_000_000
TOO_MANY = f"the data expands to more than {MAX_VALUES:,} values (YAML aliases repeat parts); write it without aliases"


def os_reason(exc: OSError) -> str:
    """Why a file operation failed, as the OS says it (`No such file or directory`)."""
    return exc.strerror or str(exc)


# What a file a user hands over may hold: far more than any tasks file, schema, workflow or agent
# (a system prompt that long fits no context window).
MAX_FILE_BYTES = 1024 * 1024
NOT_REGULAR = "not a regular file (a FIFO, device or socket)"


def _a(what: str) -> str:
    return f"an {what}" if what[:1] in "aeiou" else f"a {what}"


def open_regular(
    path: Path, what: str, error: type[SubagentError], max_bytes: int | None = MAX_FILE_BYTES, *, text: bool = True
) -> BinaryIO:
    """`path` opened for reading: a regular file of at most `max_bytes` (None: any size), else one `error` line.

    The open does not wait (O_NONBLOCK) and the opened file is the one checked, so a FIFO, a device
    or a file swapped after an earlier check is refused before anything blocks or is read.

    Args:
        what: the kind of file, as the user knows it ("tasks file", "workflow file").
        text: the file holds text (the refusal says "a plain text file").
    """
    plain = "a plain text file" if text else "a regular file"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a socket
            raise error(f"{path}: {NOT_REGULAR}; {_a(what)} must be {plain}") from None
        raise error(
            f"{path}: cannot read the {what} ({os_reason(exc)}); check that it exists and is readable"
        ) from None
    info = os.fstat(fd)
    problem = None
    if stat.S_ISDIR(info.st_mode):
        problem = f"cannot read the {what} ({os.strerror(errno.EISDIR)}); pass a file, not a folder"
    elif not stat.S_ISREG(info.st_mode):
        problem = f"{NOT_REGULAR}; {_a(what)} must be {plain}"
    elif max_bytes is not None and info.st_size > max_bytes:
        problem = too_large(info.st_size, max_bytes, what)
    if problem is not None:
        os.close(fd)
        raise error(f"{path}: {problem}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def linked_part(root: Path, relative: Path | str) -> Path | None:
    """The first part of `root / relative` that is a symbolic link, checked from `root` down without
    following any (`root` itself is the caller's: resolved, or trusted); None when no part is one.

    A folder a clone controls (a project's memory or skill folder, a file `apply` writes) is used only
    when this is None: a link in it would lead a read or a write outside."""
    path = root
    for part in Path(relative).parts:
        path = path / part
        try:
            if stat.S_ISLNK(os.lstat(path).st_mode):
                return path
        except OSError:  # missing from here down: nothing below can be a link yet
            return None
    return None


def too_large(n_bytes: int, max_bytes: int, what: str) -> str:
    return f"the file is {n_bytes:,} bytes, over the limit of {max_bytes:,} for {_a(what)}; shorten it"


def read_head(
    path: Path, what: str, error: type[SubagentError], max_bytes: int, *, whole: bool = False, text: bool = True
) -> tuple[bytes, bool]:
    """`(at most max_bytes of the file's first bytes, whether that is all of it)`, through `open_regular`.

    Args:
        whole: refuse a file larger than `max_bytes` (else only its head is read: project instructions,
            a GGUF header).
    """
    try:
        with open_regular(path, what, error, max_bytes if whole else None, text=text) as file:
            data = file.read(max_bytes + 1)
    except OSError as exc:
        raise error(
            f"{path}: cannot read the {what} ({os_reason(exc)}); check that it exists and is readable"
        ) from None
    return data[:max_bytes], len(data) <= max_bytes


def read_text(path: Path, what: str, error: type[SubagentError], max_bytes: int = MAX_FILE_BYTES) -> str:
    """The file's UTF-8 text, through `open_regular`; otherwise one `error` line naming it and the fix.

    Args:
        what: the kind of file, as the user knows it ("tasks file", "workflow file").
        max_bytes: the largest file accepted; no more than this is read, even from a file that grows.
    """
    data, complete = read_head(path, what, error, max_bytes, whole=True)
    if not complete:  # it grew after the check
        raise error(f"{path}: the file grew past the limit of {max_bytes:,} bytes for {_a(what)}; shorten it")
    return decode_text(data, path, what, error)


def decode_text(data: bytes, path: Path, what: str, error: type[SubagentError], *, cut: bool = False) -> str:
    """UTF-8 `data` as text (`cut`: the data ends mid-file, so a character cut at its end is dropped)."""
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(data, final=not cut)
    except UnicodeDecodeError:
        raise error(f"{path}: cannot read the {what}: it is not UTF-8 text; save it as UTF-8") from None


def parse_text(text: str, fmt: Format, where: str, error: type[SubagentError]) -> Any:
    """JSON, YAML or TOML text as data; a syntax error or too deep nesting is one `error` line.

    Args:
        where: what the error line starts with, usually the file's path.
    """
    try:
        if fmt == "json":
            data = json.loads(text)
        elif fmt == "yaml":
            data = _load_yaml(text, where, error)
        else:
            data = tomllib.loads(text)
    except RecursionError:
        raise error(f"{where}: {TOO_DEEP}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{where}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{where}: invalid TOML: {exc}") from None
    except ValueError as exc:  # YAML: a date that does not exist (2024-13-45)
        raise error(f"{where}: invalid {fmt.upper()}: {squash(str(exc))}") from None
    if problem := data_problem(data):
        raise error(f"{where}: {problem}")
    return data


def _load_yaml(text: str, where: str, error: type[SubagentError]) -> Any:
    import yaml  # here: most commands read no YAML (an attached `subagent run` reads none)

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{where}: invalid YAML{yaml_problem(exc)}") from None


def data_problem(data: Any) -> str | None:
    """Why `data` is unsafe to walk ("problem; fix"): nested too deep, or expanding to too many values."""
    depth, n_values = measure(data)
    if depth > MAX_NESTING:
        return TOO_DEEP
    if n_values > MAX_VALUES:
        return TOO_MANY
    return None


def measure(data: Any) -> tuple[float, int]:
    """`(depth, values)`: how many lists and mappings deep `data` goes (`inf` if it contains itself), and how
    many values it holds once every shared part (a YAML alias) is counted each time it is used.

    A loop, not recursion, so any depth is safe; each list or mapping is visited once, so a "billion laughs"
    file costs what the file holds, not what it would expand to.
    """
    depths: dict[int, float] = {}
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    pending: list[tuple[Any, bool]] = [(data, False)]
    while pending:
        value, children_done = pending.pop()
        if not isinstance(value, (dict, list)):
            continue
        items = list(value.values()) if isinstance(value, dict) else value
        key = id(value)
        if children_done:  # every child was measured before this marker came back up
            on_path.discard(key)
            depths[key] = 1 + max((depths.get(id(item), 0) for item in items), default=0)
            sizes[key] = 1 + sum(sizes.get(id(item), 1) for item in items)
        elif key in on_path:
            return math.inf, 0
        elif key not in depths:
            on_path.add(key)
            pending.append((value, True))
            pending.extend((item, False) for item in items)
    return depths.get(id(data), 0), sizes.get(id(data), 1)


def load_file(path: Path, fmt: Format, what: str, error: type[SubagentError], max_bytes: int = MAX_FILE_BYTES) -> Any:
    """`read_text` then `parse_text`: a user's data file, every problem one `error` line naming it."""
    return parse_text(read_text(path, what, error, max_bytes), fmt, str(path), error)


def json_line(text: str, key: str) -> int | None:
    """The 1-based line of JSON `text` where the string `key` first appears (a key or a value), for a
    warning that names the line to fix; None when it does not appear as written."""
    at = text.find(json.dumps(key))
    return text.count("\n", 0, at) + 1 if at >= 0 else None


def yaml_problem(exc: yaml.YAMLError, first_line: int = 1) -> str:
    """` at line L column C: problem` for a YAML error (`first_line`: the file line the YAML starts on)."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + first_line} column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc)
    return f"{where}: {squash(problem)}"


# --- pydantic errors --------------------------------------------------------------------------------


def error_path(loc: Sequence[int | str]) -> str:
    """`steps[0].id` for pydantic's location `('steps', 0, 'id')`; empty for the whole value."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def error_message(err: ErrorDetails) -> str:
    """pydantic's message for one error on one line, without its `Value error, ` prefix."""
    return squash(err["msg"].removeprefix("Value error, "))


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
