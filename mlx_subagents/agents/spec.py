"""`AgentSpec`: one agent, read from a markdown file with YAML frontmatter.

An agent file is a `---` fenced YAML header (name, description, tools, model, ...) followed by
the system prompt. Every field has one reader that turns a bad value into one line naming the file,
the field and the fix: here, or in `tool_fields.py` (the fields that name tools, MCP servers and
agents) and `model_fields.py` (the model, the engine, temperature and thinking). Claude Code files (`.claude/agents`) are read in their dialect
(`claude.py`); where the files are found is `discovery.py`.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import AgentFileError
from ..home import long_name_problem
from ..text import name_list
from ..tools import WRITER_TOOLS
from ..tools.mcp_config import McpServerConfig, matches
from ..userfiles import read_text
from .claude import CLAUDE_FIELDS, is_claude_file, unsupported_note
from .frontmatter import agent_error as _fail
from .frontmatter import read_frontmatter
from .hooks import HookConfigError, Hooks, parse_hooks
from .model_fields import (
    MAX_TEMPERATURE,
    parse_engine,
    parse_model,
    parse_models,
    parse_temperature,
    parse_thinking_field,
)
from .tool_fields import NAME_PATTERN, mcp_denied, parse_agents, parse_mcp_servers, parse_tools

Source = Literal["builtin", "user", "project"]


FIELDS = (
    "name", "description", "tools", "agents", "context", "model", "max_turns", "temperature", "output_schema", "engine",
    "engine_model", "thinking", "writer", "sandbox", "network", "permission", "hooks", "skills", "memory", "background", "effort", "mcpServers", "isolation", "grammar",
    "models", "sampling",
)  # fmt: skip
# Fields only for display (in Claude Code's agent list), accepted silently in every agent file.
DISPLAY_FIELDS = ("color",)
LENIENT_FIELDS = frozenset(FIELDS + CLAUDE_FIELDS + DISPLAY_FIELDS)


class AgentSpec(BaseModel):
    """One agent, parsed from its markdown file.

    `tools` omitted in the frontmatter means every tool in `TOOL_NAMES` (Claude Code's rule:
    an omitted allowlist inherits all tools); `subagent` is granted only when named. An empty
    string or list means no tools. `model` None means the session's default local model.
    `warnings` holds what was ignored while loading (dropped Claude tools, Claude model aliases,
    unknown fields). `agents` names the agents it may start through `subagent` (None: any);
    `full_tools_for` those of them that keep tools it lacks itself (written `worker!`). `context`
    `none` leaves the project's AGENTS.md/CLAUDE.md out of its system prompt. `writer` is what its file
    says about holding the workspace's writer lease (None: decided by its tools, see `is_writer`).
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    name: str = Field(pattern=f"^{NAME_PATTERN}$")
    description: str = Field(min_length=1)
    tools: tuple[str, ...]
    model: str | None = None
    max_turns: int | None = Field(default=None, gt=0)
    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE)
    # A thinking model's budget per reply, in tokens (0: off); None: the run's, else the default.
    thinking: int | None = Field(default=None, ge=0)
    # Whether this agent's tool calls are constrained by the call grammar; None: the run's, else on.
    grammar: bool | None = None
    output_schema: dict[str, Any] | None = None
    # An OpenAI-compatible engine (base URL) and its model id: this agent's model calls go there.
    engine: str | None = None
    engine_model: str | None = None
    agents: tuple[str, ...] | None = None
    full_tools_for: tuple[str, ...] = ()
    # The models its `subagent` calls may name for a child (`models:`), besides the operator's grants.
    models: tuple[str, ...] = ()
    context: Literal["project", "none"] = "project"
    writer: bool | None = None
    # Whether its `bash` runs sandboxed (None: by its source, see `sandbox_default`); `network` lets it out.
    sandbox: bool | None = None
    network: bool = False
    # `plan`: only read-only tools, for it and its children (`permission:`, Claude Code's `permissionMode:`).
    permission: Literal["default", "plan"] = "default"
    # Its file's own `hooks:` (Claude Code's shape), fired for this agent only (`agents/hooks.py`).
    hooks: Hooks = Field(default_factory=Hooks)
    # The skills it is offered, each preloaded in full (None: every skill found, none preloaded).
    skills: tuple[str, ...] | None = None
    # Where it keeps notes across runs (see `agents/memory.py`); None: no memory.
    memory: Literal["user", "project", "local"] | None = None
    # A `subagent` call that starts it runs in the background unless the call says `"background": false`.
    background: bool = False
    # MCP servers its `mcpServers:` names (configured elsewhere) or defines inline; MCP tools it may not call.
    mcp_servers: tuple[str, ...] = ()
    mcp_inline: tuple[McpServerConfig, ...] = ()
    mcp_denied: tuple[str, ...] = ()
    # Whether the MCP servers it calls may have its model answer their sampling requests (`sampling: off`).
    sampling: bool = True
    # `worktree`: its tasks run in a git worktree of their own unless the call site says otherwise.
    isolation: Literal["none", "worktree"] | None = None
    system_prompt: str = Field(min_length=1)
    source: Source
    path: Path
    warnings: tuple[str, ...] = ()

    def is_writer(self, denied: Collection[str] = ()) -> bool:
        """Whether it holds its workspace's writer lease: as its file's `writer:` says, else when it can
        change files (`edit`, `write` or `bash`; tools its parent `denied` do not count).

        `writer: false` declares that it only looks (the built-in scout and reviewer run `git log` or
        the tests through bash): it runs alongside the writers. A declaration, not a sandbox.
        """
        if self.writer is not None:
            return self.writer
        return any(tool in WRITER_TOOLS and tool not in denied for tool in self.tools)

    def grants(self, tool: str) -> bool:
        """Whether its file grants a tool: named in `tools`, or an MCP tool one of its `mcp__<server>__*`
        names, and not in its `disallowedTools`."""
        if not tool.startswith("mcp__"):
            return tool in self.tools
        return not any(matches(tool, d) for d in self.mcp_denied) and any(matches(tool, t) for t in self.tools)


def sandbox_default(spec: AgentSpec) -> bool:
    """Whether the agent's bash runs sandboxed unless the run says otherwise: on for a project agent
    (its file may not turn it off: a cloned repository must not choose its own rights), else as its
    file's `sandbox:` says, off when it says nothing."""
    return spec.source == "project" or bool(spec.sandbox)


def parse_agent_file(path: Path, source: Source, *, claude: bool | None = None) -> AgentSpec:
    """Read one agent file; raise `AgentFileError` (one line: file, field, fix) if it is bad.

    Args:
        claude: read it as a Claude Code file; default: when it sits in a `.claude/agents` folder.
    """
    claude = is_claude_file(path) if claude is None else claude
    meta, body, note = read_frontmatter(path, read_text(path, "agent file", AgentFileError), LENIENT_FIELDS)
    name = _agent_name(path, meta)
    description = _required_text(path, meta, "description", "what this agent does")
    turns_key = "maxTurns" if claude and "maxTurns" in meta else "max_turns"
    system_prompt = body.strip()
    if not system_prompt:
        raise _fail(path, "the body is empty", "write the system prompt below the closing '---'")
    warnings = _field_warnings(path, meta, claude, note)
    agents, full_tools_for = parse_agents(path, meta)
    servers, inline = parse_mcp_servers(path, meta.get("mcpServers"))
    return AgentSpec(
        name=name,
        description=description,
        tools=parse_tools(path, meta, claude, warnings, servers),
        mcp_servers=servers,
        mcp_inline=inline,
        mcp_denied=mcp_denied(path, meta, claude),
        sampling=_parse_switch(path, "sampling", meta.get("sampling"), ("on", "off")) is not False,
        agents=agents,
        full_tools_for=full_tools_for,
        models=parse_models(path, meta.get("models")),
        context=_parse_context(path, meta.get("context")),
        writer=_parse_writer(path, meta.get("writer")),
        sandbox=_parse_switch(path, "sandbox", meta.get("sandbox"), ("on", "off")),
        network=_parse_switch(path, "network", meta.get("network"), ("allow", "deny")) or False,
        permission=_parse_permission(path, meta, warnings),
        hooks=_parse_hooks(path, meta.get("hooks"), warnings),
        skills=_parse_skills(path, meta.get("skills")),
        memory=_parse_memory(path, meta.get("memory")),
        background=_parse_background(path, meta.get("background")),
        isolation=_parse_isolation(path, meta.get("isolation")),
        grammar=_parse_grammar(path, meta.get("grammar")),
        model=parse_model(path, meta.get("model"), claude, warnings),
        max_turns=_parse_max_turns(path, turns_key, meta.get(turns_key)),
        temperature=parse_temperature(path, meta.get("temperature")),
        thinking=parse_thinking_field(path, meta.get("thinking"), meta.get("effort")),
        output_schema=_parse_output_schema(path, meta.get("output_schema")),
        **parse_engine(path, meta.get("engine"), meta.get("engine_model")),
        system_prompt=system_prompt,
        source=source,
        path=path,
        warnings=tuple(warnings),
    )


def _agent_name(path: Path, meta: dict[str, Any]) -> str:
    """The `name` field, lowercased: required, not too long, and a valid agent name."""
    name = _required_text(path, meta, "name", "my-agent").lower()
    if problem := long_name_problem(name, "field 'name': agent name"):
        raise AgentFileError(f"{path}: {problem}")
    if not re.fullmatch(NAME_PATTERN, name):
        raise _fail(
            path,
            f"field 'name': {name!r} is not a valid agent name",
            "use lowercase letters, digits, '-', '_' and '.', starting with a letter or digit",
        )
    return name


def _field_warnings(path: Path, meta: dict[str, Any], claude: bool, note: str | None) -> list[str]:
    """The file's first warnings: the frontmatter's `note`, then the fields it ignores (unknown ones in
    our own format, those Claude Code has and we do not in Claude's); the field readers add theirs."""
    warnings = [note] if note else []
    if not claude and (unknown := sorted(str(k) for k in meta if k not in FIELDS + DISPLAY_FIELDS)):
        warnings.append(f"{path}: unknown field(s) {name_list(unknown)} ignored")
    if claude and (unsupported := unsupported_note(path, meta)):
        warnings.append(unsupported)
    return warnings


def _required_text(path: Path, meta: dict[str, Any], key: str, example: str) -> str:
    value = meta.get(key)
    if isinstance(value, str) and value.strip():
        return value.strip()
    if value is None or isinstance(value, str):
        fix = f"add '{key}: {example}' to the frontmatter"
        raise _fail(path, f"field '{key}' is missing or empty", fix)
    problem = f"field '{key}' must be text, not a {type(value).__name__}"
    raise _fail(path, problem, f"write '{key}: {example}'")


def _parse_context(path: Path, value: Any) -> Literal["project", "none"]:
    if value is None or value == "project":
        return "project"
    if value == "none" or value is False:
        return "none"
    raise _fail(path, f"field 'context' must be 'project' or 'none', got {value!r}", "e.g. context: none")


def _parse_skills(path: Path, value: Any) -> tuple[str, ...] | None:
    """`skills:` as a list or comma-separated names; `none` (or an empty list) offers none."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [] if value.strip().lower() == "none" else value.split(",")
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _fail(path, "field 'skills' must be a list of skill names or 'none'", "e.g. skills: [pdf, review]")
    names = [item.strip().lower() for item in value if item.strip()]
    if bad := [n for n in names if not re.fullmatch(NAME_PATTERN, n)]:
        raise _fail(path, f"field 'skills': {bad[0]!r} is not a skill name", "e.g. skills: [pdf, review]")
    return tuple(dict.fromkeys(names))


def _parse_memory(path: Path, value: Any) -> Literal["user", "project", "local"] | None:
    if value is None or value in ("user", "project", "local"):
        return value
    raise _fail(path, f"field 'memory' must be user, project or local, got {value!r}", "e.g. memory: project")


def _parse_background(path: Path, value: Any) -> bool:
    if value is None or isinstance(value, bool):
        return bool(value)
    raise _fail(path, f"field 'background' must be true or false, got {value!r}", "e.g. background: true")


def _parse_grammar(path: Path, value: Any) -> bool | None:
    """`grammar: on|off` (YAML reads a bare on/off as a boolean)."""
    if value is None or isinstance(value, bool):
        return value
    if str(value).strip().lower() in ("on", "off"):
        return str(value).strip().lower() == "on"
    raise _fail(path, f"field 'grammar' must be on or off, got {value!r}", "e.g. grammar: off")


def _parse_isolation(path: Path, value: Any) -> Literal["none", "worktree"] | None:
    if value is None or value in ("none", "worktree"):
        return value
    raise _fail(path, f"field 'isolation' must be 'worktree' or 'none', got {value!r}", "e.g. isolation: worktree")


def _parse_writer(path: Path, value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):  # a header read leniently
        return value.strip().lower() == "true"
    fix = "write 'writer: false' for an agent that only looks (its bash changes nothing), or leave it out"
    raise _fail(path, f"field 'writer' must be true or false, got {value!r}", fix)


def _parse_switch(path: Path, key: str, value: Any, words: tuple[str, str]) -> bool | None:
    """`on`/`off` (or `allow`/`deny`) as True/False; YAML reads a bare on/off as a boolean."""
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in (words[0], "true", "on"):
        return True
    if text in (words[1], "false", "off"):
        return False
    fix = f"write '{key}: {words[0]}' or '{key}: {words[1]}', or leave it out"
    raise _fail(path, f"field '{key}' must be {words[0]} or {words[1]}, got {value!r}", fix)


def _parse_permission(path: Path, meta: dict[str, Any], warnings: list[str]) -> Literal["default", "plan"]:
    """`permission:` (or Claude Code's `permissionMode:`): `plan`, or `default`; Claude Code's
    `acceptEdits` and `bypassPermissions` mean `default` here, where nothing is asked interactively."""
    key = "permission" if "permission" in meta else "permissionMode"
    value = meta.get(key)
    if value is None or value == "default":
        return "default"
    if value == "plan":
        return "plan"
    if value in ("acceptEdits", "bypassPermissions", "dontAsk"):
        warnings.append(f"{path}: {key} '{value}' means 'default' here (no tool call waits for approval)")
        return "default"
    fix = f"write '{key}: plan' (read-only tools) or '{key}: default'"
    raise _fail(path, f"field '{key}' must be plan or default, got {value!r}", fix)


def _parse_hooks(path: Path, value: Any, warnings: list[str]) -> Hooks:
    try:
        return parse_hooks(value, f"{path}: field 'hooks'", warnings)
    except HookConfigError as exc:
        raise AgentFileError(str(exc)) from None


def _parse_max_turns(path: Path, key: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        problem = f"field '{key}' must be a positive whole number, got {value!r}"
        raise _fail(path, problem, f"e.g. {key}: 20")
    return value


def _parse_output_schema(path: Path, value: Any) -> dict[str, Any] | None:
    if value is None or isinstance(value, dict):
        return value
    kind = type(value).__name__
    problem = f"field 'output_schema' must be a mapping (a JSON schema), not a {kind}"
    raise _fail(path, problem, "e.g. output_schema: {type: object}")
