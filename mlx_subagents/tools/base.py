"""The tool contract: a pydantic parameter model, a JSON schema, and one `call` that never raises.

Tool failures are observations for the model, not exceptions: `call` turns bad arguments,
`ToolError`, `OSError` and any other exception a tool raises into an error `ToolResult` whose first
line says what to fix. Only cancellation goes through.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ValidationError

from ..errors import ToolError
from ..text import one_line
from ..userfiles import error_message, error_path, os_reason
from .editor import Editor
from .threads import DEFAULT_TOOL_TIMEOUT, checkpoint, run_in_thread
from .workspace import Workspace

MAX_OUTPUT_BYTES = 50 * 1024
MAX_LINE_CHARS = 2000
# A failed call's text that says so itself, in its first word ("Error: ...", "error executing ...").
ALREADY_AN_ERROR = re.compile(r"error\b", re.IGNORECASE)


@dataclass(frozen=True)
class ToolResult:
    """What goes back to the model; error outputs start with `Error: `."""

    output: str
    is_error: bool = False


def error_result(message: str) -> ToolResult:
    """An error result whose first line is `Error: <message>`."""
    return ToolResult(f"Error: {message}", is_error=True)


def failed_result(output: str) -> ToolResult:
    """The result of a call whose tool said it failed (an MCP server's `isError`, a chat client's
    `is_error`), as every error result reads, so that the model tells each failure alike. A text that
    already opens with "Error" (Claude Code's "Error: File does not exist.", the MCP SDK's "Error
    executing tool ...") is kept as it is: prefixed, the model and the run's lines read "Error: Error: ..."."""
    if ALREADY_AN_ERROR.match(output):
        return ToolResult(output, is_error=True)
    return error_result(output or "the tool failed")


def clip_line(line: str, max_chars: int = MAX_LINE_CHARS) -> str:
    """Cut one line so a minified file cannot fill the context on its own."""
    if len(line) <= max_chars:
        return line
    return f"{line[:max_chars]}... [line truncated: {len(line)} chars]"


class CappedLines:
    """Keeps the leading lines that fit both caps while counting every line offered, so the count
    is exact while memory stays bounded by the caps."""

    def __init__(self, max_lines: int, max_bytes: int = MAX_OUTPUT_BYTES) -> None:
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        self.kept: list[str] = []
        self.n_total = 0
        self.n_bytes = 0
        self.full = False

    def add(self, line: str) -> None:
        self.n_total += 1
        size = len(line.encode("utf-8", "surrogatepass")) + 1
        self.full = self.full or len(self.kept) >= self.max_lines or self.n_bytes + size > self.max_bytes
        if not self.full:
            self.kept.append(line)
            self.n_bytes += size

    def text(self, what: str, hint: str) -> str:
        """The kept lines; when some were dropped, a last note saying how many and how to narrow."""
        kept = list(self.kept)
        if len(kept) < self.n_total:
            kept.append(f"[... truncated: showing {len(kept)} of {self.n_total} {what}; {hint}]")
        return "\n".join(kept)


def take_capped(lines: Iterable[str], max_lines: int, max_bytes: int = MAX_OUTPUT_BYTES) -> CappedLines:
    """Every line offered to a `CappedLines`, from a tool thread that may be asked to stop."""
    capped = CappedLines(max_lines, max_bytes)
    for line in lines:
        checkpoint()  # a stopped call stops here, however long the listing
        capped.add(line)
    return capped


def cap_lines(lines: Iterable[str], max_lines: int, what: str, hint: str) -> str:
    """Join lines under the caps; when some are dropped, end with a note saying how to narrow."""
    return take_capped(lines, max_lines).text(what, hint)


def _strip_titles(schema: Any) -> Any:
    """Drop pydantic's `title` keys, which only cost the model tokens; keep field names."""
    if isinstance(schema, list):
        return [_strip_titles(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {
        key: (
            {name: _strip_titles(sub) for name, sub in value.items()}
            if key in ("properties", "$defs")
            else _strip_titles(value)
        )
        for key, value in schema.items()
        if key != "title"
    }


def _type_name(prop: dict[str, Any]) -> str:
    """The JSON type a schema property expects, e.g. `integer` or `string or null`."""
    if "type" in prop:
        return str(prop["type"])
    return " or ".join(str(alt["type"]) for alt in prop.get("anyOf", []) if "type" in alt) or "any"


class Tool:
    """A workspace-confined tool; subclasses set the class attributes and `execute` (or `run`).

    What a tool is, is said here once, on its class; the name lists the rest of the package reads
    (`TOOL_NAMES`, the writer tools, the memory tools, Claude Code's names) are derived from the
    registered classes (`tools/__init__.py`).
    """

    name: ClassVar[str]
    description: ClassVar[str]
    Params: ClassVar[type[BaseModel]]
    # Only reads: plan mode keeps it.
    read_only: ClassVar[bool]
    # Can change files: an agent holding it is a writer and holds its workspace's writer lease.
    writes: ClassVar[bool]
    # Writes files through `Workspace.resolve`, so an agent holding it may keep its memory folder (opened
    # to the workspace, `Workspace.memory`); bash is not confined by path, so it does not count.
    writes_memory: ClassVar[bool] = False
    # Granted to an agent whose file has no `tools:` (`subagent` never is: only a file naming it gets it).
    by_default: ClassVar[bool] = False
    # The grant it comes with when that is not its own name (the background tools come with `subagent`).
    granted_with: ClassVar[str | None] = None
    # Comes with being a sub-agent, whatever its file's `tools` say: the runner offers it to a child
    # (`parent_send`), as the session offers `skill` with skills.
    by_delegation: ClassVar[bool] = False
    # Claude Code's names of it: a Claude agent file's `tools` and a hook's matcher may use them.
    claude_names: ClassVar[tuple[str, ...]] = ()
    # Goes through the person's editor where a front end has one (`editor.py`): its files, its terminal,
    # its approval of a change.
    uses_editor: ClassVar[bool] = False
    editor: Editor | None = None

    def __init__(self, workspace: Workspace) -> None:
        self.workspace = workspace

    def with_editor(self, editor: Editor | None) -> Tool:
        """This tool for a session with `editor` (a copy, so a tool shared by sessions keeps its own); the
        tool itself when it does not use one."""
        if not self.uses_editor or editor is None:
            return self
        bound = copy.copy(self)
        bound.editor = editor
        return bound

    @property
    def grant(self) -> str:
        """The name an agent file's `tools` must hold for the agent to get this tool."""
        return self.granted_with or self.name

    @classmethod
    def schema(cls) -> dict[str, Any]:
        """The OpenAI function-tool schema the chat template shows the model."""
        return {
            "type": "function",
            "function": {
                "name": cls.name,
                "description": cls.description,
                "parameters": _strip_titles(cls.Params.model_json_schema()),
            },
        }

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        """Validate `arguments` and run the tool; every expected failure becomes an error result."""
        try:
            params = self.Params.model_validate(arguments)
        except ValidationError as exc:
            return error_result(self._invalid_arguments(exc))
        try:
            return await self.run(params)
        except Exception as exc:  # the boundary: whatever a tool raises, the loop goes on
            return tool_failure(self.name, exc, self.workspace)

    async def run(self, params: Any) -> ToolResult:
        """Run `execute` in a daemon thread, so a slow tool stalls neither the other sessions nor
        the exit, and stop it after `DEFAULT_TOOL_TIMEOUT` or when the call is cancelled."""
        return ToolResult(await run_in_thread(self.execute, params, timeout=DEFAULT_TOOL_TIMEOUT, what=self.name))

    def execute(self, params: Any) -> str:
        """The tool's blocking work; raise `ToolError` with a one-line fix on bad input."""
        raise NotImplementedError

    def describe(self, arguments: dict[str, Any]) -> str:
        """A one-line label for progress display, e.g. `ls src`."""
        return f"{self.name} {arguments.get('path', '.')}"

    def _invalid_arguments(self, exc: ValidationError) -> str:
        props = self.schema()["function"]["parameters"].get("properties", {})
        problems = []
        for err in exc.errors():
            loc = err["loc"]
            field = error_path(loc) or "arguments"
            expected = _type_name(props.get(str(loc[0]), {})) if loc else "object"
            got = "" if err["type"] == "missing" else f", got {one_line(repr(err['input']), 60)}"
            problems.append(f"'{field}' ({expected}): {error_message(err)}{got}")
        return (
            f"invalid arguments for {self.name}: {'; '.join(problems)}; call {self.name} again with corrected arguments"
        )


def tool_failure(name: str, exc: Exception, workspace: Workspace) -> ToolResult:
    """The error result for an exception a tool raised: its own message for a `ToolError`, else
    what failed and that the arguments should change."""
    if isinstance(exc, ToolError):
        return error_result(str(exc))
    if isinstance(exc, OSError):
        where = f" ({one_line(workspace.relative(Path(str(exc.filename))), 120)})" if exc.filename else ""
        return error_result(f"{name} failed: {os_reason(exc)}{where}; check the path and permissions")
    problem = one_line(str(exc), 200) or "no details"
    return error_result(f"{name} failed: {type(exc).__name__}: {problem}; call {name} again with other arguments")
