"""Agent files as people share them (issue 19): `tests/agents/agent_files/`, one small file per case, loaded
through discovery from a project's `.claude/agents` (Claude Code files) and `.mlx-subagents/agents`
(this project's own files)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.agents.discovery import AgentCatalog, discover_agents
from mlx_subagents.agents.spec import parse_agent_file
from mlx_subagents.errors import AgentFileError
from mlx_subagents.tools import TOOL_NAMES

FIXTURES = Path(__file__).parent / "agent_files"
NOT_YAML = "the frontmatter is not valid YAML at line 3 column {}: mapping values are not allowed here; " + (
    "loaded from its 'key: value' lines instead (quote the value to make it valid YAML)"
)


@pytest.fixture
def wild(tmp_path: Path) -> tuple[Path, AgentCatalog]:
    """A project holding every fixture file, and what discovery found in it."""
    shutil.copytree(FIXTURES / "claude", tmp_path / ".claude" / "agents")
    shutil.copytree(FIXTURES / "own", tmp_path / ".mlx-subagents" / "agents")
    return tmp_path, discover_agents(tmp_path, scope="project")


# (file, agent name, tools, model, the warnings after "{path}: ")
LOADED = [
    ("claude/colon-in-description.md", "stats-expert", ("read", "grep", "find"), None, [NOT_YAML.format(42)]),
    ("claude/dotted-name.md", "dotnet-framework-4.8-expert", ("read", "grep"), None, []),
    (
        "claude/unknown-tools.md",
        "browser-helper",
        ("read", "grep", "mcp__github__search"),  # issue 32: MCP tools are kept
        None,
        ["tool(s) not available here, dropped: chrome-mcp, server:tool, TaskList, TeamCreate, WebFetch, Bash(git:*)"],
    ),
    ("claude/model-inherit.md", "follower", TOOL_NAMES, None, []),
    (
        "claude/claude-alias.md",
        "reviewer-opus",
        ("read", "grep", "find", "bash"),
        None,
        ["model 'opus' is a remote Claude model; using the default local model"],
    ),
    ("claude/display-fields.md", "painter", TOOL_NAMES, None, []),
    ("claude/body-looks-like-fields.md", "body-keeper", TOOL_NAMES, None, [NOT_YAML.format(18)]),
    ("own/colon-in-description.md", "own-colon", ("read", "grep"), None, [NOT_YAML.format(39)]),
    ("own/display-fields.md", "own-painter", ("read",), None, []),
]


@pytest.mark.parametrize(("file", "name", "tools", "model", "warnings"), LOADED)
def test_agent_files_from_the_wild_load(
    wild: tuple[Path, AgentCatalog], file: str, name: str, tools: tuple[str, ...], model: None, warnings: list[str]
) -> None:
    root, catalog = wild
    spec = catalog.get(name)
    folder = ".claude/agents" if file.startswith("claude/") else ".mlx-subagents/agents"
    path = root / folder / file.split("/", 1)[1]
    assert spec.path == path
    assert (spec.tools, spec.model, spec.source) == (tools, model, "project")
    assert spec.warnings == tuple(f"{path}: {warning}" for warning in warnings)


def test_the_lenient_reader_keeps_the_whole_value(wild: tuple[Path, AgentCatalog]) -> None:
    _, catalog = wild
    assert catalog.get("stats-expert").description == (
        "Statistics help. Triggers on: 'p-value', 'regression', \"anova\" and on questions about sampling: sizes, power."
    )
    assert catalog.get("own-colon").max_turns == 5  # a number is still a number


def test_the_lenient_reader_never_takes_a_field_from_the_body(wild: tuple[Path, AgentCatalog]) -> None:
    _, catalog = wild
    spec = catalog.get("body-keeper")
    assert spec.description == "Note: the header is not valid YAML, and the body holds lines like fields."
    assert spec.system_prompt == (
        "tools: Bash, Write\nmodel: opus\nname: someone-else\nOnly the header is read for fields."
    )
    assert "someone-else" not in catalog.names()


def test_files_that_cannot_be_recovered_are_skipped_with_one_line(wild: tuple[Path, AgentCatalog]) -> None:
    root, catalog = wild
    claude, own = root / ".claude" / "agents", root / ".mlx-subagents" / "agents"
    assert catalog.warnings == [
        f"skipped {claude / 'no-opening-fence.md'}: no frontmatter; start the file with a '---' line, then name: "
        "and description:, then a closing '---' line",
        f"skipped {claude / 'not-recoverable.md'}: invalid YAML in the frontmatter at line 3 column 19: mapping "
        "values are not allowed here; fix the YAML, or quote the value",
        # Only in this project's own files is an unknown tool an error: a typo there should stop you.
        f"skipped {own / 'unknown-tool.md'}: field 'tools': unknown tool 'gerp'; use tools from: read, grep, find, "
        "ls, bash, edit, write, subagent, or mcp__<server>__<tool>",
    ]
    assert {"no-fence", "broken", "own-typo"}.isdisjoint(catalog.names())


@pytest.mark.parametrize("name", [".hidden", "a/b", "a\\b", "two words", "..", "-x"])
def test_names_with_dots_but_no_separators_spaces_or_leading_dots(tmp_path: Path, name: str) -> None:
    path = tmp_path / "a.md"
    path.write_text(f"---\nname: '{name}'\ndescription: D.\n---\nBody.\n", encoding="utf-8")
    with pytest.raises(AgentFileError) as info:
        parse_agent_file(path, "user")
    assert str(info.value) == (
        f"{path}: field 'name': {name!r} is not a valid agent name; use lowercase letters, digits, '-', '_' and '.', "
        "starting with a letter or digit"
    )


def test_subagent_agents_shows_every_warning(wild: tuple[Path, AgentCatalog], run_cli: Any) -> None:
    root, catalog = wild
    code, out, err = run_cli("agents", "-C", str(root), "--scope", "project", "--json")
    assert code == 0
    assert "dotnet-framework-4.8-expert" in {row["name"] for row in json.loads(out)}
    per_agent = [w for name in catalog.names() for w in catalog.agents[name].warnings]
    assert err.splitlines() == [f"warning: {w}" for w in [*catalog.warnings, *per_agent]]
    assert len(per_agent) == 5
