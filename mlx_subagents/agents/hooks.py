"""Hooks: commands a user's settings attach to tool calls and to each agent's start and end, for the
whole agent tree.

The configuration is Claude Code's (`{"hooks": {"PreToolUse": [{"matcher": "Bash", "hooks": [{"type":
"command", "command": "...", "timeout": 10}]}]}}`), read from `$MLX_SUBAGENTS_HOME/settings.json`, the
project's `.mlx-subagents/settings.json` and its `.claude/settings.json` (the two project files only after
the same consent as project agents), plus an agent file's own `hooks:` (the inner mapping) for that agent.

The user's own settings file is strict: a hook in a shape not known here is one error line, since a
guard that silently does not run would be worse. A project's settings file is read only when a run needs
its hooks and, for its hooks, only after the user's consent; each problem in it (bad JSON, a comment, an
unknown event, a matcher that is not a regex) is one warning naming the file, the line and the fix, and
the run goes on without that part (`read_settings`, `project_hooks`).

A hook command gets the event as JSON on stdin and runs like a `bash` call (`tools/command.py`: its own
process group, killed on its time-out or on cancellation, its strays swept). Exit 0 goes on, unless its
stdout is JSON with `"decision": "block"`; exit 2 blocks, its stderr being the reason; any other failure
(a time-out, another exit code, stdout that is not JSON) is one warning and blocks nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..errors import SubagentError
from ..text import one_line
from ..tools import REGISTRY
from ..tools.command import OutputBuffer, run_command
from ..userfiles import json_line, load_file, parse_text, read_text

HookEvent = Literal["PreToolUse", "PostToolUse", "SubagentStart", "SubagentStop", "Stop"]
HOOK_EVENTS: tuple[HookEvent, ...] = ("PreToolUse", "PostToolUse", "SubagentStart", "SubagentStop", "Stop")
# Claude Code's other events: accepted in its settings files, never fired here.
CLAUDE_ONLY_EVENTS = ("UserPromptSubmit", "Notification", "PreCompact", "SessionStart", "SessionEnd")
DEFAULT_HOOK_TIMEOUT = 60.0  # seconds, Claude Code's default
MAX_HOOK_TIMEOUT = 600.0
BLOCK_EXIT_CODE = 2
SETTINGS_FILE = "settings.json"
# Claude Code's names of our tools, for matchers written for Claude Code (`Bash` matches `bash`).
CLAUDE_NAMES: dict[str, tuple[str, ...]] = REGISTRY.claude_names


class HookConfigError(SubagentError):
    """A settings file's or an agent file's hooks are not in the shape Claude Code documents."""


@dataclass(frozen=True)
class HookCommand:
    """One `command` hook: what runs, for how long at most, and the file it came from (for warnings)."""

    command: str
    timeout: float = DEFAULT_HOOK_TIMEOUT
    origin: str = ""


@dataclass(frozen=True)
class HookGroup:
    """The hooks of one event whose `matcher` (a regex on the tool's or agent's name; None: all) matches."""

    event: HookEvent
    matcher: re.Pattern[str] | None
    commands: tuple[HookCommand, ...]

    def matches(self, name: str) -> bool:
        """Whether the matcher takes `name`, or one of Claude Code's names for the same tool (whole names)."""
        if self.matcher is None:
            return True
        return any(self.matcher.fullmatch(n) for n in (name, *CLAUDE_NAMES.get(name, ())))


@dataclass(frozen=True)
class Hooks:
    """Every hook that applies to one agent, in order: the settings files' first, then its file's."""

    groups: tuple[HookGroup, ...] = ()

    def __add__(self, other: Hooks) -> Hooks:
        return Hooks(self.groups + other.groups)

    def __bool__(self) -> bool:
        return bool(self.groups)

    def matching(self, event: HookEvent, name: str = "") -> list[HookCommand]:
        return [c for g in self.groups if g.event == event and g.matches(name) for c in g.commands]


@dataclass(frozen=True)
class HookOutcome:
    """What the hooks of one event said: whether one blocked and why, and one warning per hook that failed."""

    blocked: bool = False
    reason: str = ""
    warnings: tuple[str, ...] = field(default=())


def parse_hooks(data: Any, where: str, warnings: list[str] | None = None, *, lenient: str | None = None) -> Hooks:
    """The hooks of a `hooks` mapping (event -> list of `{matcher, hooks: [...]}`); one `HookConfigError`
    line for a bad shape. Claude Code's events and hook types that do not exist here are left out, each
    with a line in `warnings`.

    Args:
        where: the file (and field) the mapping comes from, for errors, warnings and each hook's origin.
        lenient: the file's text: each bad event or hook group is then left out with one warning naming
            its line, instead of an error (a project's file, `project_hooks`).
    """
    fix = 'write it as {"PreToolUse": [{"matcher": "bash", "hooks": [{"type": "command", "command": "..."}]}]}'
    warnings = [] if warnings is None else warnings

    def refuse(problem: str, key: str, part: str = "its hooks are") -> None:
        if lenient is None:
            raise HookConfigError(f"{where}: {problem}")
        line = json_line(lenient, key)
        warnings.append(f"{where}{f' line {line}' if line else ''}: {problem}; {part} left out, the others run")

    if data is None:
        return Hooks()
    if not isinstance(data, Mapping):
        refuse(f"'hooks' must be a mapping of events; {fix}", "hooks")
        return Hooks()
    groups: list[HookGroup] = []
    for event, entries in data.items():
        if event in CLAUDE_ONLY_EVENTS:
            warnings.append(f"{where}: hook event '{event}' does not happen here; its hooks are ignored")
        elif event not in HOOK_EVENTS:
            refuse(f"unknown hook event {event!r}; use one of {', '.join(HOOK_EVENTS)}", str(event))
        elif not isinstance(entries, list):
            refuse(f"hooks.{event} must be a list; {fix}", str(event))
        else:
            for n, entry in enumerate(entries):
                try:
                    groups.append(_group(event, entry, f"{where}: hooks.{event}[{n}]", warnings))
                except HookConfigError as exc:
                    matcher = entry.get("matcher") if isinstance(entry, Mapping) else None
                    key = matcher if isinstance(matcher, str) and lenient and json_line(lenient, matcher) else event
                    refuse(str(exc).removeprefix(f"{where}: "), key, "that hook group is")
    return Hooks(tuple(g for g in groups if g.commands))


def _group(event: HookEvent, entry: Any, where: str, warnings: list[str] | None) -> HookGroup:
    if not isinstance(entry, Mapping) or not isinstance(entry.get("hooks"), list):
        raise HookConfigError(f'{where} must be a mapping with a "hooks" list (and an optional "matcher")')
    matcher = entry.get("matcher")
    if matcher is not None and not isinstance(matcher, str):
        raise HookConfigError(f"{where}: 'matcher' must be text (a regex on the tool's name), got {matcher!r}")
    try:
        pattern = None if matcher in (None, "", "*") else re.compile(matcher)
    except re.error as exc:
        raise HookConfigError(
            f"{where}: 'matcher' {matcher!r} is not a valid regex ({exc}); fix or remove it"
        ) from None
    commands = []
    for n, hook in enumerate(entry["hooks"]):
        here = f"{where}.hooks[{n}]"
        if not isinstance(hook, Mapping) or not isinstance(hook.get("type"), str):
            raise HookConfigError(f'{here} must be a mapping with "type": "command" and a "command"')
        if hook["type"] != "command":
            if warnings is not None:
                warnings.append(f"{here}: hook type {hook['type']!r} is not supported here (only 'command'); ignored")
            continue
        command = hook.get("command")
        if not isinstance(command, str) or not command.strip():
            raise HookConfigError(f'{here}: "command" must be a non-empty shell command')
        timeout = hook.get("timeout", DEFAULT_HOOK_TIMEOUT)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_HOOK_TIMEOUT:
            raise HookConfigError(
                f'{here}: "timeout" must be seconds between 0 and {MAX_HOOK_TIMEOUT:g}, got {timeout!r}'
            )
        commands.append(HookCommand(command, float(timeout), origin=where.split(": ")[0]))
    return HookGroup(event, pattern, tuple(commands))


def load_settings_hooks(path: Path, warnings: list[str]) -> Hooks:
    """The `hooks` section of a settings file (its other sections belong to other tools); none if absent."""
    if not path.is_file():
        return Hooks()
    data = load_file(path, "json", "settings file", HookConfigError)
    if not isinstance(data, Mapping):
        raise HookConfigError(f'{path}: a settings file must hold a JSON object; write {{"hooks": {{...}}}}')
    return parse_hooks(data.get("hooks"), str(path), warnings)


def read_settings(path: Path, warnings: list[str]) -> tuple[Any, str] | None:
    """A project settings file's `hooks` section and its text, parsed as JSON and nothing more (its hooks
    are checked after consent, `project_hooks`); None when it has none, or cannot be read (one warning)."""
    if not path.is_file():
        return None
    try:
        text = read_text(path, "settings file", HookConfigError)
        data = parse_text(text, "json", str(path), HookConfigError)
    except HookConfigError as exc:
        warnings.append(f"{exc}; its hooks are left out (write it as plain JSON, without comments)")
        return None
    if not isinstance(data, Mapping):
        warnings.append(f'{path}: a settings file holds a JSON object ({{"hooks": {{...}}}}); its hooks are left out')
        return None
    if not data.get("hooks"):
        return None
    return data["hooks"], text


def project_hooks(section: Any, path: Path, text: str, warnings: list[str]) -> Hooks:
    """The hooks of a project settings file's `hooks` section, leniently: each event or hook group that is
    not in Claude Code's shape is left out with one warning naming the line (`text`: the file's); the
    others are kept."""
    return parse_hooks(section, str(path), warnings, lenient=text)


def find_project_settings(cwd: Path, user_level: set[Path]) -> list[Path]:
    """The project's settings files, nearest first: `.mlx-subagents/settings.json` and `.claude/settings.json`
    at or above `cwd`, never a user-level one (`user_level`: resolved paths, such as `~/.claude/settings.json`)."""
    found = []
    for relative in (f".mlx-subagents/{SETTINGS_FILE}", f".claude/{SETTINGS_FILE}"):
        for folder in (cwd, *cwd.parents):
            candidate = folder / relative
            if candidate.is_file() and candidate.resolve() not in user_level:
                found.append(candidate)
                break
    return found


async def fire(hooks: Hooks, event: HookEvent, name: str, payload: Mapping[str, Any], cwd: Path) -> HookOutcome:
    """Run the hooks of `event` that match `name`, one after another, until one blocks.

    Args:
        name: the tool's name (our own: `bash`), or the agent's for SubagentStart and SubagentStop.
        payload: the event as the hooks read it on stdin (`hook_event_name` is added here).
    """
    matching = hooks.matching(event, name)
    if not matching:  # the common case: no hooks, so no event to write (a tool's whole output, for PostToolUse)
        return HookOutcome(False, "", ())
    data = json.dumps({"hook_event_name": event, **payload}, default=str).encode()
    warnings: list[str] = []
    for hook in matching:
        out, err = OutputBuffer(), OutputBuffer()
        code = await run_command(
            ["bash", "-c", hook.command], cwd=cwd, timeout=hook.timeout, output=out, errors=err, stdin=data
        )
        what = f"{event} hook {one_line(hook.command, 60)!r} ({hook.origin})"
        if code is None:
            warnings.append(f"{what} timed out after {hook.timeout:g}s and was killed; not blocking")
        elif code == BLOCK_EXIT_CODE:
            reason = err.text().strip() or f"blocked by the {what}"
            return HookOutcome(True, reason, tuple(warnings))
        elif code != 0:
            detail = one_line(err.text().strip(), 200)
            warnings.append(f"{what} failed with exit code {code}{': ' + detail if detail else ''}; not blocking")
        elif (decision := _decision(out.text(), what, warnings)) is not None:
            return HookOutcome(True, decision, tuple(warnings))
    return HookOutcome(False, "", tuple(warnings))


def _decision(stdout: str, what: str, warnings: list[str]) -> str | None:
    """The reason a hook's JSON output blocks with (`decision: block`, or Claude Code's newer
    `hookSpecificOutput.permissionDecision: deny`), None when it does not; plain text is no decision."""
    text = stdout.strip()
    if not text.startswith("{"):
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        warnings.append(f"{what} printed invalid JSON ({exc.msg}); not blocking")
        return None
    if not isinstance(data, dict):
        return None
    specific = data.get("hookSpecificOutput") if isinstance(data.get("hookSpecificOutput"), dict) else {}
    if data.get("decision") == "block":
        return str(data.get("reason") or f"blocked by the {what}")
    if specific.get("permissionDecision") == "deny":
        return str(specific.get("permissionDecisionReason") or f"blocked by the {what}")
    return None
