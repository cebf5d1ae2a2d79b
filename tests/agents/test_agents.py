"""Agent files: parsing, Claude Code files, discovery layers, trust."""

import os
import subprocess
from pathlib import Path

import pytest

from mlx_subagents.agents.discovery import (
    MAX_AGENT_FILE_BYTES,
    AgentCatalog,
    builtin_agents_dir,
    discover_agents,
    user_agents_dir,
)
from mlx_subagents.agents.spec import parse_agent_file
from mlx_subagents.errors import AgentFileError, AgentNotFoundError
from mlx_subagents.tools import TOOL_NAMES
from tests.helpers import REPO

BODY = "You are a test agent.\n"
QWEN = "mlx-community/Qwen3-4B-Instruct-2507-4bit"
MODEL_FIX = f"use a local path, an MLX hub id like {QWEN}, or inherit"


def agent_text(name: str = "helper", extra: str = "", body: str = BODY) -> str:
    return f"---\nname: {name}\ndescription: Helps with tests.\n{extra}---\n\n{body}"


def write(folder: Path, filename: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / filename
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def user_dir() -> Path:
    """The user agents folder (under the temporary home from conftest)."""
    return user_agents_dir()


@pytest.fixture
def project(tmp_path) -> Path:
    root = tmp_path / "project"
    root.mkdir()
    return root


# --- built-ins ------------------------------------------------------------------------------


def test_builtins_load_with_their_tools(user_dir, project):
    catalog = discover_agents(project)

    assert catalog.warnings == []
    assert catalog.names() == ["orchestrator", "planner", "reviewer", "scout", "worker"]
    assert {name: spec.tools for name, spec in catalog.agents.items()} == {
        "orchestrator": ("read", "grep", "find", "ls", "subagent"),
        "scout": ("read", "grep", "find", "ls", "bash"),
        "planner": ("read", "grep", "find", "ls"),
        "reviewer": ("read", "grep", "find", "ls", "bash"),
        "worker": ("read", "grep", "find", "ls", "bash", "edit", "write"),
    }
    assert [catalog.get(n).is_writer() for n in catalog.names()] == [False, False, False, False, True]
    assert (catalog.get("scout").writer, catalog.get("reviewer").writer) == (False, False)
    assert catalog.get("scout").max_turns == 20
    assert catalog.get("worker").max_turns == 40
    assert all(spec.source == "builtin" and spec.warnings == () for spec in catalog.agents.values())
    assert catalog.get("scout").path == builtin_agents_dir() / "scout.md"
    assert "Verdict: approve" in catalog.get("reviewer").system_prompt


# --- parsing ----------------------------------------------------------------------------------


def test_tools_as_comma_string_or_yaml_list(tmp_path):
    comma = write(tmp_path, "a.md", agent_text(extra="tools: read, grep ,find\n"))
    listed = write(tmp_path, "b.md", agent_text(extra="tools:\n  - read\n  - grep\n  - find\n"))

    assert parse_agent_file(comma, "user").tools == ("read", "grep", "find")
    assert parse_agent_file(listed, "user").tools == ("read", "grep", "find")


def test_omitted_tools_mean_all_tools_but_subagent_only_when_named(tmp_path):
    omitted = parse_agent_file(write(tmp_path, "a.md", agent_text()), "user")
    named_path = write(tmp_path, "b.md", agent_text(extra="tools: read, subagent\n"))
    named = parse_agent_file(named_path, "user")
    empty = parse_agent_file(write(tmp_path, "c.md", agent_text(extra="tools: []\n")), "user")

    assert omitted.tools == TOOL_NAMES
    assert omitted.is_writer() is True
    assert named.tools == ("read", "subagent")
    assert named.is_writer() is False
    assert empty.tools == ()


def test_models_grant_the_models_its_calls_may_name(tmp_path):
    comma = parse_agent_file(write(tmp_path, "a.md", agent_text(extra="models: qwen-a, ./local ,\n")), "user")
    listed = parse_agent_file(write(tmp_path, "b.md", agent_text(extra="models:\n  - qwen-a\n  - qwen-a\n")), "user")
    assert (comma.models, listed.models) == (("qwen-a", "./local"), ("qwen-a",))
    bad = write(tmp_path, "c.md", agent_text(extra="models: 3\n"))
    with pytest.raises(AgentFileError) as info:
        parse_agent_file(bad, "user")
    assert str(info.value) == (
        f"{bad}: field 'models' must be a comma-separated string or a list of model names; "
        "e.g. models: qwen2.5-coder-7b, mlx-community/Qwen3-4B-Instruct-2507-4bit"
    )


def test_full_spec_fields(tmp_path):
    path = write(
        tmp_path,
        "a.md",
        f"---\nname: My-Agent\ndescription: '  Does things. '\nmodel: mlx/{QWEN}\n"
        "max_turns: 7\ntemperature: 1\nthinking: 512\noutput_schema:\n  type: object\n---\n\n  Body text.  \n\n",
    )

    spec = parse_agent_file(path, "project")

    assert spec.model_dump() == {
        "name": "my-agent",
        "description": "Does things.",
        "tools": TOOL_NAMES,
        "model": QWEN,
        "max_turns": 7,
        "temperature": 1.0,
        "thinking": 512,
        "output_schema": {"type": "object"},
        "agents": None,
        "full_tools_for": (),
        "models": (),
        "context": "project",
        "writer": None,
        "sandbox": None,
        "network": False,
        "permission": "default",
        "hooks": {"groups": ()},
        "skills": None,
        "memory": None,
        "background": False,
        "mcp_servers": (),
        "mcp_inline": (),
        "mcp_denied": (),
        "sampling": True,
        "isolation": None,
        "grammar": None,
        "engine": None,
        "engine_model": None,
        "system_prompt": "Body text.",
        "source": "project",
        "path": path,
        "warnings": (),
    }


def test_sampling_off_refuses_servers_the_model_and_a_bad_value_is_one_line(tmp_path):
    off = parse_agent_file(write(tmp_path, "a.md", agent_text(extra="sampling: off\n")), "user")
    on = parse_agent_file(write(tmp_path, "b.md", agent_text(extra="sampling: on\n")), "user")
    bad_path = write(tmp_path, "c.md", agent_text(extra="sampling: sometimes\n"))

    assert (off.sampling, on.sampling) == (False, True)
    with pytest.raises(AgentFileError) as info:
        parse_agent_file(bad_path, "user")
    assert str(info.value) == (
        f"{bad_path}: field 'sampling' must be on or off, got 'sometimes'; write 'sampling: on' or 'sampling: off', "
        "or leave it out"
    )


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("inherit", None),
        (f"mlx/{QWEN}", QWEN),
        (QWEN, QWEN),
        ("/models/qwen3-4b", "/models/qwen3-4b"),
        ("./models/tiny", "./models/tiny"),
        ("mlx/google/gemma-3-1b-it", "google/gemma-3-1b-it"),
    ],
)
def test_model_forms(tmp_path, model, expected):
    path = write(tmp_path, "a.md", agent_text(extra=f"model: {model}\n"))

    assert parse_agent_file(path, "user").model == expected


@pytest.mark.parametrize(
    ("model", "provider"),
    [
        ("openai/gpt-4o", "openai"),
        ("anthropic/claude-sonnet-4", "anthropic"),
        ("Gemini/gemini-2.5-pro", "gemini"),
        ("ollama:llama3", "ollama"),
        ("bedrock/x", "bedrock"),
        ("groq/llama-3.1-8b", "groq"),
    ],
)
def test_remote_provider_model_is_refused(tmp_path, model, provider):
    path = write(tmp_path, "a.md", agent_text(extra=f"model: {model}\n"))

    with pytest.raises(AgentFileError) as info:
        parse_agent_file(path, "user")

    assert str(info.value) == (
        f"{path}: field 'model': '{model}' is a remote '{provider}' model; "
        f"only local MLX models run here; {MODEL_FIX} "
        f"(write mlx/{model} if it is a Hugging Face repo)"
    )


def test_claude_alias_is_an_error_in_our_own_files(tmp_path):
    path = write(tmp_path, "a.md", agent_text(extra="model: sonnet\n"))

    with pytest.raises(AgentFileError) as info:
        parse_agent_file(path, "user")

    assert str(info.value) == (f"{path}: field 'model': 'sonnet' is a Claude model, not a local one; {MODEL_FIX}")


def test_unknown_fields_are_ignored_with_a_warning(tmp_path):
    path = write(tmp_path, "a.md", agent_text(extra="max_turn: 5\ncolor: red\npermissionMode: plan\n"))

    spec = parse_agent_file(path, "user")

    assert spec.max_turns is None
    assert spec.warnings == (f"{path}: unknown field(s) max_turn, permissionMode ignored",)  # color is for display


def test_invalid_yaml_error_names_the_file_line(tmp_path):
    path = write(tmp_path, "a.md", "---\nname: a\ndescription: A.\ntools: [read\n---\nBody\n")

    with pytest.raises(AgentFileError) as info:
        parse_agent_file(path, "user")

    assert str(info.value) == (
        f"{path}: invalid YAML in the frontmatter at line 5 column 1: "
        "expected ',' or ']', but got '<stream end>'; fix the YAML, or quote the value"
    )


NAME_FIX = "use lowercase letters, digits, '-', '_' and '.', starting with a letter or digit"
TURNS_FIX = "e.g. max_turns: 20"
TEMPERATURE_FIX = "e.g. temperature: 0.2"
MAPPING_FIX = "write one 'key: value' per line, e.g. name: scout"
BAD_FILES = [
    (
        "No frontmatter.\n",
        "no frontmatter; start the file with a '---' line, then name: and description:, then a closing '---' line",
    ),
    (
        "---\nname: x\n",
        "the frontmatter has no closing '---' line; add a '---' line after the last field",
    ),
    (
        "---\nname: x\ndescription: bad: colon\nnot a field\n---\nBody\n",
        "invalid YAML in the frontmatter at line 3 column 17: mapping values are not allowed here; "
        "fix the YAML, or quote the value",
    ),
    (
        "---\nname: x\ndescription: x\ncreated: 2024-13-45\n---\nBody\n",
        "invalid YAML in the frontmatter: month must be in 1..12; fix the YAML, or quote the value",
    ),
    ("---\n- name\n---\nBody\n", f"the frontmatter is a YAML list, not a mapping; {MAPPING_FIX}"),
    ("---\n---\nBody\n", f"the frontmatter is empty, not a mapping; {MAPPING_FIX}"),
    (
        "---\ndescription: Helps.\n---\nBody\n",
        "field 'name' is missing or empty; add 'name: my-agent' to the frontmatter",
    ),
    (
        "---\nname: ''\ndescription: Helps.\n---\nBody\n",
        "field 'name' is missing or empty; add 'name: my-agent' to the frontmatter",
    ),
    (
        "---\nname: helper\n---\nBody\n",
        "field 'description' is missing or empty; add 'description: what this agent does' to the frontmatter",
    ),
    (
        "---\nname: [a]\ndescription: Helps.\n---\nBody\n",
        "field 'name' must be text, not a list; write 'name: my-agent'",
    ),
    (
        agent_text(name="my agent"),
        f"field 'name': 'my agent' is not a valid agent name; {NAME_FIX}",
    ),
    (agent_text(name="-x"), f"field 'name': '-x' is not a valid agent name; {NAME_FIX}"),
    (
        agent_text(extra="tools: read, glob\n"),
        "field 'tools': unknown tool 'glob'; use tools from: read, grep, find, ls, bash, edit, write, subagent, or mcp__<server>__<tool>",
    ),
    (
        agent_text(extra="tools: {read: true}\n"),
        "field 'tools' must be a comma-separated string or a list of tool names; e.g. tools: read, grep, find",
    ),
    (
        agent_text(extra="max_turns: 0\n"),
        f"field 'max_turns' must be a positive whole number, got 0; {TURNS_FIX}",
    ),
    (
        agent_text(extra="max_turns: '5'\n"),
        f"field 'max_turns' must be a positive whole number, got '5'; {TURNS_FIX}",
    ),
    (
        agent_text(extra="max_turns: true\n"),
        f"field 'max_turns' must be a positive whole number, got True; {TURNS_FIX}",
    ),
    (
        agent_text(extra="temperature: 2.5\n"),
        f"field 'temperature' must be a number from 0 to 2, got 2.5; {TEMPERATURE_FIX}",
    ),
    (
        agent_text(extra="temperature: -0.1\n"),
        f"field 'temperature' must be a number from 0 to 2, got -0.1; {TEMPERATURE_FIX}",
    ),
    (
        agent_text(extra="output_schema: [1]\n"),
        "field 'output_schema' must be a mapping (a JSON schema), not a list; e.g. output_schema: {type: object}",
    ),
    (
        agent_text(body="  \n\n"),
        "the body is empty; write the system prompt below the closing '---'",
    ),
]


@pytest.mark.parametrize(("text", "reason"), BAD_FILES)
def test_bad_file_is_skipped_with_a_warning(user_dir, project, text, reason):
    bad = write(user_dir, "bad.md", text)
    write(user_dir, "good.md", agent_text(name="good"))

    catalog = discover_agents(project)

    assert catalog.warnings == [f"skipped {bad}: {reason}"]
    assert catalog.names() == ["good", "orchestrator", "planner", "reviewer", "scout", "worker"]
    with pytest.raises(AgentFileError) as info:
        parse_agent_file(bad, "user")
    assert str(info.value) == f"{bad}: {reason}"


def test_same_name_twice_in_one_folder_keeps_the_first(user_dir, project):
    first = write(user_dir, "a.md", agent_text(name="helper", body="First.\n"))
    second = write(user_dir, "b.md", agent_text(name="helper", body="Second.\n"))

    catalog = discover_agents(project)

    assert catalog.get("helper").path == first
    assert catalog.warnings == [f"skipped {second}: agent 'helper' is already defined in {first}; rename one of them"]


def test_non_markdown_and_hidden_files_are_ignored(user_dir, project):
    write(user_dir, "notes.txt", "not an agent")
    write(user_dir, ".#helper.md", "editor lock file")

    catalog = discover_agents(project)

    assert catalog.warnings == []
    assert catalog.names() == ["orchestrator", "planner", "reviewer", "scout", "worker"]


# --- Claude Code files ---------------------------------------------------------------------------


def test_claude_file_tools_are_mapped_and_unavailable_ones_dropped(user_dir, project):
    path = write(
        project / ".claude" / "agents",
        "explorer.md",
        "---\nname: explorer\ndescription: Explores.\n"
        "tools: Read, Grep, Glob, LS, Bash, Edit, MultiEdit, Write, WebFetch, WebSearch, "
        "TodoWrite, NotebookEdit, Task, mcp__github__search, Bash(git:*)\n"
        "model: sonnet\ncolor: cyan\npermissionMode: plan\nmaxTurns: 12\n---\nExplore.\n",
    )

    spec = discover_agents(project).get("explorer")

    # Issue 32: an MCP tool is kept (its server's tools are offered when it is configured).
    assert spec.tools == ("read", "grep", "find", "ls", "bash", "edit", "write", "mcp__github__search")
    assert spec.model is None
    assert spec.max_turns == 12
    assert spec.source == "project"
    dropped = "WebFetch, WebSearch, TodoWrite, NotebookEdit, Task, Bash(git:*)"
    assert spec.permission == "plan"  # honoured: read-only tools at run time (issue 33)
    assert spec.warnings == (
        f"{path}: tool(s) not available here, dropped: {dropped}",
        f"{path}: model 'sonnet' is a remote Claude model; using the default local model",
    )


def test_claude_file_without_tools_gets_all_tools_minus_disallowed(tmp_path):
    path = write(
        tmp_path / ".claude" / "agents",
        "a.md",
        "---\nname: a\ndescription: A.\ndisallowedTools: Write, Edit(src/*), WebFetch\nmodel: inherit\n---\nA.\n",
    )

    spec = parse_agent_file(path, "project")

    assert spec.tools == ("read", "grep", "find", "ls", "bash")  # a restricted deny denies the whole tool
    assert spec.is_writer() is True  # bash can change files
    assert spec.warnings == ()


def test_claude_file_unknown_tool_is_dropped_and_remote_model_an_error(tmp_path):
    folder = tmp_path / ".claude" / "agents"
    unknown = write(folder, "a.md", agent_text(name="a", extra="tools: Read, Frobnicate\n"))
    remote = write(folder, "b.md", agent_text(name="b", extra="model: openai/gpt-4o\n"))

    spec = parse_agent_file(unknown, "project")
    with pytest.raises(AgentFileError) as remote_info:
        parse_agent_file(remote, "project")

    assert spec.tools == ("read",)
    assert spec.warnings == (f"{unknown}: tool(s) not available here, dropped: Frobnicate",)
    assert str(remote_info.value).startswith(f"{remote}: field 'model': 'openai/gpt-4o' is a remote 'openai' model;")


def test_effort_maps_to_the_thinking_budget_and_every_claude_field_is_honoured_or_named(tmp_path):
    folder = tmp_path / ".claude" / "agents"
    extra = "effort: low\nbackground: true\nhooks: {}\nisolation: worktree\nmcpServers: [github]\nskills: [pdf]\n"
    claude = write(folder, "c.md", agent_text(name="c", extra=extra))
    ours = write(tmp_path, "o.md", agent_text(name="o", extra="effort: high\n"))
    both = write(tmp_path, "b.md", agent_text(name="b", extra="effort: low\nthinking: 10\n"))
    bad = write(tmp_path, "x.md", agent_text(name="x", extra="effort: max\n"))

    spec = parse_agent_file(claude, "project")

    assert (spec.thinking, spec.background, spec.skills) == (1024, True, ("pdf",))
    assert (spec.isolation, spec.mcp_servers) == ("worktree", ("github",))
    assert spec.warnings == ()  # every Claude Code field it uses is honoured
    initial = write(folder, "i.md", agent_text(name="i", extra="initialPrompt: hi\n"))
    named = f"{initial}: Claude Code field(s) initialPrompt not supported here, ignored"
    assert parse_agent_file(initial, "project").warnings == (named,)
    assert parse_agent_file(ours, "user").thinking == 16384
    with pytest.raises(AgentFileError) as both_info:
        parse_agent_file(both, "user")
    assert (
        str(both_info.value) == f"{both}: fields 'effort' and 'thinking' both set the thinking budget; keep one of them"
    )
    with pytest.raises(AgentFileError) as bad_info:
        parse_agent_file(bad, "user")
    assert str(bad_info.value) == f"{bad}: field 'effort' must be low, medium or high, got 'max'; e.g. effort: low"


# --- discovery layers ------------------------------------------------------------------------


def test_layers_builtin_then_user_then_project(user_dir, project):
    write(user_dir, "scout.md", agent_text(name="scout", body="User scout.\n"))
    write(user_dir, "planner.md", agent_text(name="planner", body="User planner.\n"))
    project_dir = project / ".mlx-subagents" / "agents"
    write(project_dir, "scout.md", agent_text(name="scout", body="Project scout.\n"))

    catalog = discover_agents(project)

    assert catalog.get("scout").system_prompt == "Project scout."
    assert catalog.get("scout").source == "project"
    assert catalog.get("planner").system_prompt == "User planner."
    assert catalog.get("planner").source == "user"
    assert catalog.get("worker").source == "builtin"
    assert catalog.project_root == project.resolve()


def test_mlx_subagents_folder_wins_over_claude_folder(user_dir, project):
    write(project / ".claude" / "agents", "x.md", agent_text(name="helper", body="Claude.\n"))
    write(project / ".claude" / "agents", "y.md", agent_text(name="other", body="Claude other.\n"))
    write(project / ".mlx-subagents" / "agents", "x.md", agent_text(name="helper", body="Ours.\n"))

    catalog = discover_agents(project)

    assert catalog.get("helper").system_prompt == "Ours."
    assert catalog.get("other").system_prompt == "Claude other."
    assert catalog.warnings == []


@pytest.mark.parametrize(
    ("scope", "expected"),
    [
        ("user", ["from-user", "orchestrator", "planner", "reviewer", "scout", "worker"]),
        ("project", ["from-project", "orchestrator", "planner", "reviewer", "scout", "worker"]),
        ("both", ["from-project", "from-user", "orchestrator", "planner", "reviewer", "scout", "worker"]),
    ],
)
def test_scope_filters_layers(user_dir, project, scope, expected):
    write(user_dir, "u.md", agent_text(name="from-user"))
    write(project / ".mlx-subagents" / "agents", "p.md", agent_text(name="from-project"))

    catalog = discover_agents(project, scope)

    assert catalog.names() == expected
    assert catalog.project_root == (None if scope == "user" else project.resolve())


def test_project_root_is_found_walking_up_from_a_nested_cwd(user_dir, project):
    write(project / ".mlx-subagents" / "agents", "p.md", agent_text(name="from-project"))
    write(project / ".claude" / "agents", "c.md", agent_text(name="from-claude"))
    nested = project / "src" / "pkg" / "deep"
    nested.mkdir(parents=True)

    catalog = discover_agents(nested)

    assert catalog.project_root == project.resolve()
    assert catalog.get("from-project").source == "project"
    assert catalog.get("from-claude").source == "project"


def test_claude_only_project_is_found_too(user_dir, project):
    write(project / ".claude" / "agents", "c.md", agent_text(name="from-claude"))
    nested = project / "src"
    nested.mkdir()

    catalog = discover_agents(nested)

    assert catalog.project_root == project.resolve()
    assert "from-claude" in catalog.names()


def test_no_project_folder_means_no_project_root(user_dir, project):
    catalog = discover_agents(project)

    assert catalog.project_root is None
    assert catalog.names() == ["orchestrator", "planner", "reviewer", "scout", "worker"]


def test_home_level_folders_are_not_project_agents(monkeypatch):
    home = Path.home()
    monkeypatch.delenv("MLX_SUBAGENTS_HOME")
    write(home / ".mlx-subagents" / "agents", "u.md", agent_text(name="from-user"))
    write(home / ".claude" / "agents", "c.md", agent_text(name="claude-user"))
    cwd = home / "code" / "repo"
    cwd.mkdir(parents=True)

    catalog = discover_agents(cwd)

    assert catalog.project_root is None
    assert catalog.get("from-user").source == "user"
    assert "claude-user" not in catalog.names()


# --- catalog and trust -----------------------------------------------------------------------


def test_unknown_agent_lists_the_available_ones(user_dir, project):
    catalog = discover_agents(project)

    with pytest.raises(AgentNotFoundError) as info:
        catalog.get("x")

    assert str(info.value) == "unknown agent 'x'; available: orchestrator, planner, reviewer, scout, worker"
    assert catalog.get("Scout").name == "scout"


def test_empty_catalog_says_none_available():
    with pytest.raises(AgentNotFoundError) as info:
        AgentCatalog().get("x")

    assert str(info.value) == "unknown agent 'x'; available: (none)"


def test_special_and_huge_files_are_skipped_unread(user_dir, project):
    # A cloned repository's agents are read before any confirmation: nothing there may block or
    # read without end. Reading the FIFO would block this test; reading /dev/zero would never end.
    folder = project / ".mlx-subagents" / "agents"
    good = write(folder, "good.md", agent_text(name="good"))
    os.mkfifo(folder / "pipe.md")
    (folder / "zero.md").symlink_to("/dev/zero")
    (folder / "loop.md").symlink_to(folder / "loop.md")
    huge = write(folder, "huge.md", agent_text(name="huge", body="x" * (MAX_AGENT_FILE_BYTES + 1)))

    catalog = discover_agents(project)

    special = "not a regular file (a FIFO, device or socket); an agent file must be a plain text file"
    assert catalog.warnings == [
        f"skipped {huge}: the file is {huge.stat().st_size:,} bytes, over the limit of 1,048,576 for an agent "
        "file; shorten it",
        f"skipped {folder / 'loop.md'}: cannot read the agent file (Too many levels of symbolic links); "
        "check that it exists and is readable",
        f"skipped {folder / 'pipe.md'}: {special}",
        f"skipped {folder / 'zero.md'}: {special}",
    ]
    assert catalog.get("good").path == good


@pytest.mark.slow
@pytest.mark.process
def test_a_fifo_agent_file_does_not_hang_a_command(project, tmp_path, preloaded_python):
    folder = project / ".mlx-subagents" / "agents"
    folder.mkdir(parents=True)
    os.mkfifo(folder / "pipe.md")
    (folder / "zero.md").symlink_to("/dev/zero")
    script = tmp_path / "script.json"
    script.write_text('["found it"]')
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}  # the preloaded process's width

    def cli(*args: str) -> subprocess.CompletedProcess[str]:  # a fork of the worker's preloaded process
        command = [*preloaded_python, "-m", "mlx_subagents.cli", *args]
        return subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=60)

    done = cli("run", "scout", "where?", "-m", f"scripted:{script}")
    assert (done.returncode, done.stdout) == (0, "found it\n")
    listed = cli("agents")
    assert listed.returncode == 0
    assert f"skipped {folder / 'pipe.md'}: not a regular file" in listed.stdout + listed.stderr
    assert f"skipped {folder / 'zero.md'}: not a regular file" in listed.stdout + listed.stderr


@pytest.mark.parametrize(("value", "tokens"), [("on", 4096), ("off", 0), ("'on'", 4096), ("0", 0), ("300", 300)])
def test_thinking_field_is_on_off_or_tokens(tmp_path, value, tokens):
    path = write(tmp_path, "a.md", f"---\nname: a\ndescription: d\nthinking: {value}\n---\nBody.\n")
    assert parse_agent_file(path, "project").thinking == tokens


@pytest.mark.parametrize(
    ("front", "writer", "is_writer", "without_bash"),
    [
        ("tools: read, bash\n", None, True, False),  # bash can change files: it takes turns
        ("tools: read, edit\n", None, True, True),
        ("tools: read, bash\nwriter: false\n", False, False, False),  # it declares that it only looks
        ("tools: read\nwriter: true\n", True, True, True),  # forced
        ("tools: read\nwriter: 'false'\n", False, False, False),
    ],
)
def test_writer_field_and_who_takes_turns(tmp_path, front, writer, is_writer, without_bash):
    spec = parse_agent_file(write(tmp_path, "a.md", agent_text(extra=front)), "project")
    assert (spec.writer, spec.is_writer(), spec.is_writer(denied={"bash"})) == (writer, is_writer, without_bash)


def test_a_bad_writer_field_is_one_line(tmp_path):
    path = write(tmp_path, "a.md", agent_text(extra="writer: sometimes\n"))
    with pytest.raises(AgentFileError) as info:
        parse_agent_file(path, "project")
    assert str(info.value) == (
        f"{path}: field 'writer' must be true or false, got 'sometimes'; "
        "write 'writer: false' for an agent that only looks (its bash changes nothing), or leave it out"
    )


def test_a_bad_thinking_field_is_one_line(tmp_path):
    path = write(tmp_path, "a.md", "---\nname: a\ndescription: d\nthinking: lots\n---\nBody.\n")
    with pytest.raises(AgentFileError) as info:
        parse_agent_file(path, "project")
    assert str(info.value) == (
        f"{path}: field 'thinking' must be on, off or a number of tokens, got 'lots'; "
        "e.g. thinking: 2048 (tokens per reply), on or off"
    )


@pytest.mark.parametrize("alias", ["sonnet", "opus", "haiku"])
def test_each_claude_model_alias_warns_and_means_no_model_of_its_own(tmp_path, alias):
    """docs/agents.md said only `haiku` warned; each of Claude's aliases does (the list there is generated
    from `CLAUDE_MODEL_ALIASES`)."""
    path = write(tmp_path / ".claude" / "agents", "a.md", f"---\nname: a\ndescription: A.\nmodel: {alias}\n---\nA.\n")
    spec = parse_agent_file(path, "project")
    assert spec.model is None
    assert spec.warnings == (f"{path}: model '{alias}' is a remote Claude model; using the default local model",)
