"""The `---` fenced YAML header of an agent file, read strictly, else leniently.

Agent files shared in the wild often hold YAML that strict parsers reject, mostly an unquoted
`description:` containing `: ` ("Triggers on: 'p-value'"). When strict YAML fails, the header is read
again as `key: value` lines: a known field name at the start of a line, the rest of the line and the
indented lines below it as its value. A file that is not recoverable either way keeps the YAML error.
Only the lines between the fences are read: the body never becomes a field.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml

from ..errors import AgentFileError
from ..userfiles import TOO_DEEP, data_problem, yaml_problem

YAML_FIX = "fix the YAML, or quote the value"
LENIENT_NOTE = "loaded from its 'key: value' lines instead (quote the value to make it valid YAML)"
FIELD_LINE = re.compile(r"([A-Za-z_][A-Za-z0-9_-]*):(?:[ \t]+(.*))?$")
# Values the lenient reader still reads as YAML: a flow list or mapping, a quoted string, a number.
YAML_STARTS = ("[", "{", '"', "'")
NUMBER = re.compile(r"[-+]?\d+(\.\d+)?")
BLOCK_SCALAR = re.compile(r"([|>])[-+]?")


def agent_error(path: Path, problem: str, fix: str) -> AgentFileError:
    """The one-line error for a bad agent file: `{path}: {problem}; {fix}`."""
    return AgentFileError(f"{path}: {problem}; {fix}")


def read_frontmatter(path: Path, text: str, fields: Collection[str]) -> tuple[dict[str, Any], str, str | None]:
    """`(fields, body, warning)`; the warning says when the header was not valid YAML but read leniently.

    Args:
        fields: the field names the lenient reader recognises at the start of a line.
    """
    lines = text.removeprefix("\ufeff").splitlines(keepends=True)
    if not lines or lines[0].rstrip() != "---":
        fix = "start the file with a '---' line, then name: and description:, then a closing '---' line"
        raise agent_error(path, "no frontmatter", fix)
    end = next((i for i, line in enumerate(lines) if i and line.rstrip() == "---"), None)
    if end is None:
        raise agent_error(path, "the frontmatter has no closing '---' line", "add a '---' line after the last field")
    header, body = lines[1:end], "".join(lines[end + 1 :])
    warning = None
    try:
        meta = yaml.safe_load("".join(header))
    except RecursionError:
        raise AgentFileError(f"{path}: in the frontmatter, {TOO_DEEP}") from None
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: a bad date, e.g. 2024-13-01
        # The YAML text starts on the file's second line.
        problem = yaml_problem(exc, 2) if isinstance(exc, yaml.YAMLError) else f": {exc}"
        meta = lenient_fields(header, fields)
        if meta is None:
            raise agent_error(path, f"invalid YAML in the frontmatter{problem}", YAML_FIX) from None
        warning = f"{path}: the frontmatter is not valid YAML{problem}; {LENIENT_NOTE}"
    if problem := data_problem(meta):
        raise AgentFileError(f"{path}: in the frontmatter, {problem}")
    if not isinstance(meta, dict):
        kind = "empty" if meta is None else f"a YAML {type(meta).__name__}"
        raise agent_error(
            path, f"the frontmatter is {kind}, not a mapping", "write one 'key: value' per line, e.g. name: scout"
        )
    return meta, body, warning


class _Unreadable(ValueError):
    """A value that starts like YAML (`[`, `{`, a quote) but is not: guessing would change its meaning."""


def lenient_fields(header: list[str], fields: Collection[str]) -> dict[str, Any] | None:
    """The header's `field: value` lines, or None when a line is neither a known field nor indented under one."""
    found: dict[str, list[str]] = {}
    key: str | None = None
    for line in (line.rstrip("\r\n") for line in header):
        if not line.strip() or line.startswith("#"):
            if key is not None and line.strip() == "":
                found[key].append("")  # a paragraph break inside a block value
            continue
        if line[0] in " \t":
            if key is None:
                return None
            found[key].append(line)
            continue
        match = FIELD_LINE.match(line)
        if match is None or match.group(1) not in fields or match.group(1) in found:
            return None
        key = match.group(1)
        found[key] = [(match.group(2) or "").strip()]
    try:
        return {key: _value(first, rest) for key, (first, *rest) in found.items()}
    except _Unreadable:
        return None


def _is_key(key: Any) -> bool:
    return isinstance(key, str) and FIELD_LINE.fullmatch(f"{key}:") is not None


def _value(first: str, rest: list[str]) -> Any:
    """One field's value: a block of YAML below an empty key, a `|` or `>` block, or the text as written."""
    while rest and not rest[-1].strip():
        rest.pop()
    if scalar := BLOCK_SCALAR.fullmatch(first):
        joiner = "\n" if scalar.group(1) == "|" else " "
        return joiner.join(textwrap.dedent("\n".join(rest)).split("\n")).strip()
    if not first and rest:  # a list or mapping written below its key, else text that wraps
        try:
            block = yaml.safe_load(textwrap.dedent("\n".join(rest)))
        except (yaml.YAMLError, ValueError, RecursionError):
            block = None
        # `Use it when: ...` is text that holds ': ', not a mapping: mapping keys are plain names.
        if isinstance(block, list) or (isinstance(block, dict) and all(map(_is_key, block))):
            return block
    text = " ".join(part.strip() for part in [first, *rest] if part.strip())
    if not text.startswith(YAML_STARTS) and not NUMBER.fullmatch(text):
        return text or None
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, ValueError, RecursionError):
        raise _Unreadable(text) from None
