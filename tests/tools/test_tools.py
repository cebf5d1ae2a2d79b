"""The workspace tools on real files and real subprocesses."""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import psutil
import pytest

from mlx_subagents.errors import ToolError, WorkspaceEscapeError
from mlx_subagents.tools import (
    KNOWN_TOOLS,
    MEMORY_TOOLS,
    READ_ONLY_TOOLS,
    REGISTRY,
    TOOL_CLASSES,
    TOOL_NAMES,
    WRITER_TOOLS,
    Tool,
    ToolRegistry,
    ToolResult,
    Workspace,
    kill_all_processes,
    make_tools,
    processes,
)
from mlx_subagents.tools.background_bash import CommandLog, CommandTask
from mlx_subagents.tools.base import MAX_OUTPUT_BYTES
from mlx_subagents.tools.edit import replace_checked
from mlx_subagents.tools.grep import MAX_GREP_READ_BYTES, GrepTool
from tests.helpers import REPO, alive

SECRET = "TOP-SECRET"


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    """A small project tree, and a sibling `outside/secret.txt` no tool may touch."""
    root = tmp_path / "ws"
    files = {
        "README.md": "# Demo\n",
        "src/app.py": "def main():\n    print('hello')\n    return 0\n",
        "src/util.py": "import os\n\n\ndef helper():\n    return os.getcwd()\n",
        "docs/guide.md": "Say hello.\n",
        ".hidden/notes.py": "hello hidden\n",
        ".git/config": "hello git\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "src/logo.bin").write_bytes(b"\x00hello\x00")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside/secret.txt").write_text(SECRET + "\n")
    return Workspace(root)


@pytest.fixture
def tools(ws: Workspace) -> dict[str, Tool]:
    return make_tools(TOOL_NAMES, ws)


@pytest.fixture
def grep(ws: Workspace) -> GrepTool:
    """The grep tool: always ripgrep, from the `ripgrep` dependency."""
    return GrepTool(ws)


def run(tool: Tool, **arguments: Any) -> ToolResult:
    return asyncio.run(tool.call(arguments))


def ok(text: str) -> ToolResult:
    return ToolResult(text)


def err(text: str) -> ToolResult:
    return ToolResult(f"Error: {text}", is_error=True)


def add_escape_links(ws: Workspace) -> None:
    """Symlinks inside the workspace that lead outside it (one dangling)."""
    outside = ws.root.parent / "outside"
    (ws.root / "link.txt").symlink_to(outside / "secret.txt")
    (ws.root / "linkdir").symlink_to(outside, target_is_directory=True)
    (ws.root / "dangling").symlink_to(outside / "new.txt")


# --- registry, schemas, labels -------------------------------------------------------------


def test_registry_names_and_read_only_set(tmp_path: Path) -> None:
    assert TOOL_NAMES == ("read", "grep", "find", "ls", "bash", "edit", "write")
    assert list(TOOL_CLASSES) == list(TOOL_NAMES)
    assert READ_ONLY_TOOLS == frozenset({"read", "grep", "find", "ls"})
    made = make_tools(["ls", "read"], tmp_path)
    assert list(made) == ["ls", "read"]
    assert made["ls"].workspace == Workspace(tmp_path)


def test_the_name_lists_are_derived_from_the_tool_classes() -> None:
    from mlx_subagents.agents.claude import CLAUDE_TASK_TOOL, CLAUDE_TOOL_MAP
    from mlx_subagents.agents.hooks import CLAUDE_NAMES

    assert [cls.name for cls in REGISTRY.classes] == [
        *("read", "grep", "find", "ls", "bash", "edit", "write", "subagent"),
        *("task_status", "task_output", "task_send", "task_cancel"),
    ]
    assert KNOWN_TOOLS == ("read", "grep", "find", "ls", "bash", "edit", "write", "subagent")
    assert WRITER_TOOLS == frozenset({"edit", "write", "bash"})
    assert MEMORY_TOOLS == frozenset({"edit", "write"})
    assert CLAUDE_TOOL_MAP == {
        "Read": "read",
        "Grep": "grep",
        "Glob": "find",
        "LS": "ls",
        "Bash": "bash",
        "Edit": "edit",
        "MultiEdit": "edit",
        "Write": "write",
    }
    assert CLAUDE_NAMES == {
        "read": ("Read",),
        "grep": ("Grep",),
        "find": ("Glob",),
        "ls": ("LS",),
        "bash": ("Bash",),
        "edit": ("Edit", "MultiEdit"),
        "write": ("Write",),
        "subagent": ("Task", "Agent"),
    }
    assert CLAUDE_TASK_TOOL.pattern == r"(?:Task|Agent)\((.*)\)"
    assert [cls.name for cls in REGISTRY.classes if cls.read_only and cls.writes] == []


def test_a_registered_tool_class_gets_into_every_name_list() -> None:
    class NotesTool(Tool):
        name = "notes"
        description = "Keep notes."
        read_only = False
        writes = True
        writes_memory = True
        by_default = True
        claude_names = ("NotebookEdit",)

    class PeekTool(Tool):  # comes with another tool's grant: in no list of names a file may hold
        name = "peek"
        description = "Peek."
        read_only = True
        writes = False
        granted_with = "notes"

    registry = ToolRegistry((*REGISTRY.classes, NotesTool, PeekTool))
    assert registry.known == (*KNOWN_TOOLS, "notes")
    assert registry.by_default == {**TOOL_CLASSES, "notes": NotesTool}
    assert registry.read_only == READ_ONLY_TOOLS
    assert registry.writers == WRITER_TOOLS | {"notes"}
    assert registry.memory_writers == MEMORY_TOOLS | {"notes"}
    assert registry.claude_map == {**REGISTRY.claude_map, "NotebookEdit": "notes"}
    assert registry.claude_names == {**REGISTRY.claude_names, "notes": ("NotebookEdit",)}


def test_make_tools_rejects_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        make_tools(["read", "rm"], tmp_path)
    assert str(info.value) == ("unknown tool 'rm'; available: read, grep, find, ls, bash, edit, write")


EXPECTED_PARAMS = {
    "read": (["path", "offset", "limit"], ["path"]),
    "grep": (["pattern", "path", "glob", "ignore_case"], ["pattern"]),
    "find": (["pattern", "path"], ["pattern"]),
    "ls": (["path"], []),
    "bash": (["command", "timeout", "background"], ["command"]),
    "edit": (["path", "old_text", "new_text"], ["path", "old_text", "new_text"]),
    "write": (["path", "content"], ["path", "content"]),
}


def _keys(node: Any) -> set[str]:
    if isinstance(node, dict):
        return set(node) | {key for value in node.values() for key in _keys(value)}
    if isinstance(node, list):
        return {key for value in node for key in _keys(value)}
    return set()


@pytest.mark.parametrize("name", TOOL_NAMES)
def test_schema_has_documented_params(name: str) -> None:
    cls = TOOL_CLASSES[name]
    schema = cls.schema()
    function = schema["function"]
    properties, required = EXPECTED_PARAMS[name]
    assert schema["type"] == "function"
    assert function["name"] == name
    assert function["description"] == cls.description and cls.description
    assert list(function["parameters"]["properties"]) == properties
    assert function["parameters"].get("required", []) == required
    assert all(prop["description"] for prop in function["parameters"]["properties"].values())
    assert "title" not in _keys(schema)


def test_schema_details_the_model_relies_on() -> None:
    read = TOOL_CLASSES["read"].schema()["function"]["parameters"]["properties"]
    assert read["offset"] == {
        "default": 1,
        "description": "1-based line number to start from.",
        "minimum": 1,
        "type": "integer",
    }
    bash = TOOL_CLASSES["bash"].schema()["function"]["parameters"]["properties"]
    assert (bash["timeout"]["default"], bash["timeout"]["maximum"]) == (120, 600)


def test_describe_labels(tools: dict[str, Tool]) -> None:
    assert tools["bash"].describe({"command": "ls src"}) == "$ ls src"
    assert tools["bash"].describe({"command": "make\nmake test"}) == "$ make ..."
    assert tools["read"].describe({"path": "src/app.py", "offset": 1, "limit": 40}) == ("read src/app.py:1-40")
    assert tools["read"].describe({"path": "src/app.py"}) == "read src/app.py"
    assert tools["grep"].describe({"pattern": "def main", "path": "src"}) == ('grep "def main" src')
    assert tools["grep"].describe({"pattern": "x", "glob": "*.py", "ignore_case": True}) == (
        'grep "x" . --glob *.py -i'
    )
    assert tools["find"].describe({"pattern": "**/*.py"}) == "find **/*.py"
    assert tools["find"].describe({"pattern": "*.md", "path": "docs"}) == "find *.md in docs"
    assert tools["ls"].describe({"path": "src"}) == "ls src"
    assert tools["ls"].describe({}) == "ls ."
    assert tools["edit"].describe({"path": "src/a.py"}) == "edit src/a.py"
    assert tools["write"].describe({"path": "src/a.py"}) == "write src/a.py"


# --- argument validation -------------------------------------------------------------------


def test_bad_argument_type_is_an_error_result_naming_the_field(tools: dict[str, Tool]) -> None:
    assert run(tools["read"], path="src/app.py", offset="abc") == err(
        "invalid arguments for read: 'offset' (integer): Input should be a valid integer, "
        "unable to parse string as an integer, got 'abc'; call read again with corrected arguments"
    )
    assert run(tools["grep"], pattern=["x"]) == err(
        "invalid arguments for grep: 'pattern' (string): Input should be a valid string, "
        "got ['x']; call grep again with corrected arguments"
    )


def test_missing_and_out_of_range_arguments(tools: dict[str, Tool]) -> None:
    assert run(tools["edit"], path="a.py", old_text="x") == err(
        "invalid arguments for edit: 'new_text' (string): Field required; call edit again with corrected arguments"
    )
    assert run(tools["bash"], command="true", timeout=601) == err(
        "invalid arguments for bash: 'timeout' (integer): Input should be less than or equal "
        "to 600, got 601; call bash again with corrected arguments"
    )


def test_arguments_that_are_not_an_object(tools: dict[str, Tool]) -> None:
    result = asyncio.run(tools["ls"].call("src"))  # type: ignore[arg-type]
    assert result.is_error
    assert result.output.startswith(
        "Error: invalid arguments for ls: 'arguments' (object): Input should be a valid dictionary"
    )


# --- workspace -----------------------------------------------------------------------------


def test_workspace_resolves_inside_paths(ws: Workspace) -> None:
    root = ws.root
    assert ws.resolve("src/app.py") == root / "src/app.py"
    assert ws.resolve(str(root / "docs")) == root / "docs"
    assert ws.resolve("src/../README.md") == root / "README.md"
    assert ws.resolve("new/dir/file.txt") == root / "new/dir/file.txt"
    assert ws.resolve(".") == root
    assert ws.relative(root) == "."
    assert ws.relative(root / "src/app.py") == "src/app.py"


def test_workspace_refuses_escapes(ws: Workspace) -> None:
    add_escape_links(ws)
    outside = ws.root.parent / "outside"
    for path in ["..", "../outside/secret.txt", str(outside), "link.txt", "linkdir/x", "dangling"]:
        with pytest.raises(WorkspaceEscapeError):
            ws.resolve(path)
    with pytest.raises(WorkspaceEscapeError) as info:
        ws.resolve("link.txt")
    assert str(info.value) == (
        f"path 'link.txt' is outside the workspace {ws.root} "
        f"(it is a symlink to {outside / 'secret.txt'}); use a path inside it"
    )


ESCAPES = [
    ("read", {"path": "../outside/secret.txt"}),
    ("read", {"path": "{outside}/secret.txt"}),
    ("read", {"path": "link.txt"}),
    ("read", {"path": "linkdir/secret.txt"}),
    ("read", {"path": "src/../../outside/secret.txt"}),
    ("write", {"path": "../outside/secret.txt", "content": "PWNED"}),
    ("write", {"path": "{outside}/new.txt", "content": "PWNED"}),
    ("write", {"path": "link.txt", "content": "PWNED"}),
    ("write", {"path": "linkdir/new.txt", "content": "PWNED"}),
    ("write", {"path": "dangling", "content": "PWNED"}),
    ("edit", {"path": "../outside/secret.txt", "old_text": SECRET, "new_text": "PWNED"}),
    ("edit", {"path": "{outside}/secret.txt", "old_text": SECRET, "new_text": "PWNED"}),
    ("edit", {"path": "link.txt", "old_text": SECRET, "new_text": "PWNED"}),
    ("ls", {"path": "../outside"}),
    ("ls", {"path": "{outside}"}),
    ("ls", {"path": "linkdir"}),
    ("grep", {"pattern": "TOP", "path": "../outside"}),
    ("grep", {"pattern": "TOP", "path": "{outside}/secret.txt"}),
    ("grep", {"pattern": "TOP", "path": "link.txt"}),
    ("grep", {"pattern": "TOP", "path": "linkdir"}),
    ("find", {"pattern": "*", "path": "../outside"}),
    ("find", {"pattern": "*", "path": "{outside}"}),
    ("find", {"pattern": "*", "path": "linkdir"}),
]


@pytest.mark.parametrize(("name", "arguments"), ESCAPES)
def test_paths_outside_the_workspace_are_refused(
    tools: dict[str, Tool], ws: Workspace, name: str, arguments: dict[str, str]
) -> None:
    add_escape_links(ws)
    outside = ws.root.parent / "outside"
    arguments = {key: value.format(outside=outside) for key, value in arguments.items()}
    result = run(tools[name], **arguments)
    assert result.is_error
    assert result.output.startswith(f"Error: path {arguments['path']!r} is outside the workspace {ws.root}")
    assert result.output.endswith("; use a path inside it")
    assert SECRET not in result.output
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert (outside / "secret.txt").read_text() == SECRET + "\n"


def test_whole_tree_tools_do_not_follow_links_outside(tools: dict[str, Tool], ws: Workspace, grep: GrepTool) -> None:
    add_escape_links(ws)
    assert run(grep, pattern="TOP") == ok("No matches for 'TOP' in .")
    assert run(tools["find"], pattern="**/secret*") == ok("No files match '**/secret*' in .")
    assert run(tools["ls"]) == ok(".git/\n.hidden/\nREADME.md\ndangling\ndocs/\nlink.txt\nlinkdir/\nsrc/")


# --- read ----------------------------------------------------------------------------------


def test_read_numbers_lines(tools: dict[str, Tool]) -> None:
    assert run(tools["read"], path="src/app.py") == ok(
        "     1\tdef main():\n     2\t    print('hello')\n     3\t    return 0"
    )


def test_read_window_and_note(tools: dict[str, Tool], ws: Workspace) -> None:
    (ws.root / "ten.txt").write_text("".join(f"line {n}\n" for n in range(1, 11)))
    assert run(tools["read"], path="ten.txt", offset=3, limit=2) == ok(
        "     3\tline 3\n     4\tline 4\n[... truncated: showing lines 3-4 of 10; use offset=5 to read more]"
    )
    assert run(tools["read"], path="ten.txt", offset=9) == ok("     9\tline 9\n    10\tline 10")
    assert run(tools["read"], path="ten.txt", offset=11) == err(
        "offset 11 is past the end of 'ten.txt' (10 lines); use an offset from 1 to 10"
    )


def test_read_caps_long_lines_and_total_bytes(tools: dict[str, Tool], ws: Workspace) -> None:
    (ws.root / "wide.txt").write_text("x" * 2500 + "\n")
    assert run(tools["read"], path="wide.txt") == ok("     1\t" + "x" * 2000 + "... [line truncated: 2500 chars]")
    # 1000 lines of 108 bytes each (with number, tab and newline): 474 fit in 50 KB.
    (ws.root / "big.txt").write_text(("y" * 100 + "\n") * 1000)
    lines = run(tools["read"], path="big.txt", limit=1000).output.split("\n")
    assert len(lines) == 475
    assert lines[473] == "   474\t" + "y" * 100
    assert lines[474] == "[... truncated: showing lines 1-474 of 1000; use offset=475 to read more]"


def test_read_refuses_directories_binaries_and_missing_files(tools: dict[str, Tool], ws: Workspace) -> None:
    assert run(tools["read"], path="src") == err("'src' is a directory, not a file; use ls to list it")
    assert run(tools["read"], path="src/logo.bin") == err(
        "'src/logo.bin' is a binary file (7 bytes); read only shows text files"
    )
    assert run(tools["read"], path="nope.py") == err(
        "path 'nope.py' does not exist in the workspace; use ls or find to see what is there"
    )
    (ws.root / "empty.txt").write_text("")
    assert run(tools["read"], path="empty.txt") == ok("(empty.txt is empty)")


def test_os_errors_become_error_results(tools: dict[str, Tool]) -> None:
    name = "a" * 300  # longer than any file system allows
    assert run(tools["read"], path=name) == err(
        f"read failed: File name too long ({name[:120]} ...); check the path and permissions"
    )


# --- grep ----------------------------------------------------------------------------------


def test_grep_output(grep: GrepTool) -> None:
    both = "docs/guide.md:1:Say hello.\nsrc/app.py:2:    print('hello')"
    assert run(grep, pattern="hello") == ok(both)
    assert run(grep, pattern="HELLO", ignore_case=True) == ok(both)
    assert run(grep, pattern="hel+o", glob="*.py") == ok("src/app.py:2:    print('hello')")
    assert run(grep, pattern="return", path="src") == ok(
        "src/app.py:3:    return 0\nsrc/util.py:5:    return os.getcwd()"
    )
    assert run(grep, pattern="-?hello", path="src/app.py") == ok("src/app.py:2:    print('hello')")


def test_grep_glob_matches_paths_from_the_root_like_rg(grep: GrepTool) -> None:
    assert run(grep, pattern="return", path="src", glob="src/u*.py") == ok("src/util.py:5:    return os.getcwd()")
    assert run(grep, pattern="return", path="src", glob="u*.py") == ok("src/util.py:5:    return os.getcwd()")
    assert run(grep, pattern="hello", path="src/app.py", glob="*.md") == ok("src/app.py:2:    print('hello')")


def test_globs_match_like_rg_with_globstar_and_braces(tools: dict[str, Tool], grep: GrepTool) -> None:
    find = tools["find"]
    assert run(find, pattern="src/**/*.{py,md}") == ok("src/app.py\nsrc/util.py")
    assert run(find, pattern="**/{README,guide}.md") == ok("README.md\ndocs/guide.md")
    assert run(find, pattern="[!a-t]*.py") == ok("src/util.py")
    assert run(find, pattern="*.PY") == ok("No files match '*.PY' in .")  # case-sensitive everywhere
    assert run(grep, pattern="hello", glob="{docs,src}/*") == ok(
        "docs/guide.md:1:Say hello.\nsrc/app.py:2:    print('hello')"
    )


@pytest.mark.parametrize("name", ["find", "grep"])
def test_a_bad_glob_is_an_error_result(tools: dict[str, Tool], name: str) -> None:
    arguments = {"pattern": "[z-a]"} if name == "find" else {"pattern": "x", "glob": "[z-a]"}
    assert run(tools[name], **arguments) == err("invalid glob '[z-a]': the range 'z-a' is reversed; write 'a-z'")
    arguments = {"pattern": "{1..5000}"} if name == "find" else {"pattern": "x", "glob": "{1..5000}"}
    assert run(tools[name], **arguments) == err(
        "invalid glob '{1..5000}': Pattern limit exceeded the limit of 1000; use a simpler pattern"
    )


def test_grep_no_match_and_bad_regex(grep: GrepTool) -> None:
    assert run(grep, pattern="nothing_here", path="src", glob="*.py") == ok(
        "No matches for 'nothing_here' in src (glob '*.py')"
    )
    assert run(grep, pattern="print(") == err(
        "invalid regex 'print(': unclosed group; escape regex special characters with a backslash"
    )
    assert run(grep, pattern="x", path="missing") == err(
        "path 'missing' does not exist in the workspace; use ls or find to see what is there"
    )


def test_grep_caps_matches(grep: GrepTool, ws: Workspace) -> None:
    (ws.root / "many.txt").write_text("".join(f"match {n}\n" for n in range(1, 251)))
    lines = run(grep, pattern="match", path="many.txt").output.split("\n")
    assert len(lines) == 201
    assert lines[199] == "many.txt:200:match 200"
    assert lines[200] == ("[... truncated: showing 200 of 250 matches; narrow the pattern, path or glob]")


# --- find and ls ---------------------------------------------------------------------------


def test_find_output(tools: dict[str, Tool]) -> None:
    find = tools["find"]
    assert run(find, pattern="**/*.py") == ok(".hidden/notes.py\nsrc/app.py\nsrc/util.py")
    assert run(find, pattern="*.md") == ok("README.md\ndocs/guide.md")
    assert run(find, pattern="*.py", path="src") == ok("src/app.py\nsrc/util.py")
    assert run(find, pattern="src/*.py", path="src") == ok("src/app.py\nsrc/util.py")
    assert run(find, pattern="src/*.{md,bin}") == ok("src/logo.bin")
    assert run(find, pattern="*.rs") == ok("No files match '*.rs' in .")
    assert run(find, pattern="*", path="README.md") == err(
        "'README.md' is a file, not a directory; use read to read it"
    )


def test_ls_output(tools: dict[str, Tool], ws: Workspace) -> None:
    assert run(tools["ls"]) == ok(".git/\n.hidden/\nREADME.md\ndocs/\nsrc/")
    assert run(tools["ls"], path="src") == ok("app.py\nlogo.bin\nutil.py")
    (ws.root / "void").mkdir()
    assert run(tools["ls"], path="void") == ok("(void is empty)")


def test_find_and_ls_cap_their_listings(tools: dict[str, Tool], ws: Workspace) -> None:
    (ws.root / "many").mkdir()
    for n in range(510):
        (ws.root / f"many/f{n:03d}.txt").write_text("")
    found = run(tools["find"], pattern="*.txt", path="many").output.split("\n")
    assert found[-2:] == [
        "many/f499.txt",
        "[... truncated: showing 500 of 510 files; use a narrower pattern or path]",
    ]
    listed = run(tools["ls"], path="many").output.split("\n")
    assert listed[-2:] == [
        "f499.txt",
        "[... truncated: showing 500 of 510 entries; list a subdirectory or use find with a pattern]",
    ]


# --- edit and write ------------------------------------------------------------------------


def test_edit_replaces_unique_text(tools: dict[str, Tool], ws: Workspace) -> None:
    app = ws.root / "src/app.py"
    assert run(tools["edit"], path="src/app.py", old_text="'hello'", new_text="'bye'") == ok(
        "Edited src/app.py: replaced text at line 2"
    )
    assert app.read_text() == "def main():\n    print('bye')\n    return 0\n"
    two_lines = "    x = 1\n    return x"
    result = run(tools["edit"], path="src/app.py", old_text="    return 0", new_text=two_lines)
    assert result == ok("Edited src/app.py: replaced text at lines 3-4")
    assert app.read_text() == "def main():\n    print('bye')\n    x = 1\n    return x\n"


def test_edit_keeps_crlf_line_endings(tools: dict[str, Tool], ws: Workspace) -> None:
    (ws.root / "win.txt").write_bytes(b"a\r\nb\r\n")
    assert run(tools["edit"], path="win.txt", old_text="b", new_text="B") == ok(
        "Edited win.txt: replaced text at line 2"
    )
    assert (ws.root / "win.txt").read_bytes() == b"a\r\nB\r\n"


def test_edit_missing_or_ambiguous_text_leaves_file_unchanged(tools: dict[str, Tool], ws: Workspace) -> None:
    dup = ws.root / "dup.txt"
    dup.write_bytes(b"x = 1\nx = 1\n")
    assert run(tools["edit"], path="dup.txt", old_text="x = 1", new_text="x = 2") == err(
        "old_text occurs 2 times in dup.txt; include more surrounding lines so it matches exactly once"
    )
    assert run(tools["edit"], path="dup.txt", old_text="y = 1", new_text="x = 2") == err(
        "old_text not found in dup.txt; read the file and copy the text exactly, including whitespace and indentation"
    )
    assert dup.read_bytes() == b"x = 1\nx = 1\n"


def test_write_creates_nested_dirs_and_overwrites(tools: dict[str, Tool], ws: Workspace) -> None:
    assert run(tools["write"], path="new/deep/file.txt", content="héllo\n") == ok("Wrote 7 bytes to new/deep/file.txt")
    assert (ws.root / "new/deep/file.txt").read_text(encoding="utf-8") == "héllo\n"
    assert run(tools["write"], path="README.md", content="# New\n") == ok("Wrote 6 bytes to README.md")
    assert (ws.root / "README.md").read_text() == "# New\n"
    assert run(tools["write"], path="src", content="x") == err("'src' is a directory; give a file path to write")


# --- bash ----------------------------------------------------------------------------------


def _assert_all_dead(pids: list[int]) -> None:
    deadline = time.monotonic() + 15  # a wait for the kills to land, well under the sleeps' 30 s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in pids if alive(pid)] == []


def _pids(path: Path, count: int = 3) -> list[int]:
    """The pids a spawning command wrote, once all `count` are there."""
    deadline = time.monotonic() + 30  # a wait for a start (slow on a loaded machine), not a measure
    while time.monotonic() < deadline:
        lines = path.read_text().split() if path.exists() else []
        if len(lines) == count:
            return [int(line) for line in lines]
        time.sleep(0.02)
    raise AssertionError(f"the command did not write {count} pids to {path}")


def _spawner(pid_file: Path) -> str:
    """A command with two background sleeps and a foreground one, recording all three pids."""
    return (
        f"sleep 30 & echo $! > {pid_file}; sleep 30 & echo $! >> {pid_file}; "
        f"echo $$ >> {pid_file}; echo started; sleep 30"
    )


def test_bash_output_exit_code_and_cwd(tools: dict[str, Tool], ws: Workspace) -> None:
    bash = tools["bash"]
    assert run(bash, command="echo out; echo err >&2; exit 3") == ok("out\nerr\n[exit code 3]")
    assert run(bash, command="pwd") == ok(str(ws.root))
    assert run(bash, command="true") == ok("(no output)")
    assert run(bash, command="cat") == ok("(no output)")  # stdin is /dev/null


def test_bash_caps_output_keeping_head_and_tail(tools: dict[str, Tool]) -> None:
    result = run(tools["bash"], command="head -c 100000 /dev/zero | tr '\\0' a; printf b")
    assert result == ok(
        "a" * 25600
        + "\n[output truncated: 100001 bytes total; showing the first and last 25600 bytes]\n"
        + "a" * 25599
        + "b"
    )


@pytest.mark.slow
def test_bash_timeout_kills_the_process_group(tools: dict[str, Tool], tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    started = time.monotonic()
    result = run(tools["bash"], command=_spawner(pid_file), timeout=1)
    assert time.monotonic() - started < 15  # killed at its 1 s timeout, not after the 30 s sleeps (load slack)
    assert result == err("command timed out after 1s; its process group was killed\nstarted")
    _assert_all_dead(_pids(pid_file))


def test_bash_cancellation_kills_the_process_group(tools: dict[str, Tool], tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"

    async def cancel_midway() -> list[int]:
        task = asyncio.create_task(tools["bash"].call({"command": _spawner(pid_file)}))
        pids = await asyncio.to_thread(_pids, pid_file)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return pids

    _assert_all_dead(asyncio.run(cancel_midway()))


def test_kill_all_processes_stops_running_commands(tools: dict[str, Tool], tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"

    async def kill_midway() -> tuple[ToolResult, list[int]]:
        task = asyncio.create_task(tools["bash"].call({"command": _spawner(pid_file)}))
        pids = await asyncio.to_thread(_pids, pid_file)
        kill_all_processes()
        return await asyncio.wait_for(task, 5), pids

    result, pids = asyncio.run(kill_midway())
    assert result == ok("started\n[exit code -9]")
    _assert_all_dead(pids)


def test_bash_kills_leftover_background_jobs_on_return(tools: dict[str, Tool], tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    started = time.monotonic()
    result = run(tools["bash"], command=f"sleep 30 & echo $! > {pid_file}; echo done")
    assert result == ok("done")
    assert time.monotonic() - started < 15  # returned with bash, not after its 30 s background job (load slack)
    _assert_all_dead(_pids(pid_file, count=1))


# Commands whose process leaves bash's process group, each writing its pid to PID_FILE.
PY_SETSID = "import os, time; os.setsid(); open('PID_FILE', 'w').write(str(os.getpid())); time.sleep(30)"
PY_DAEMON = "import os, time\nif os.fork(): os._exit(0)\n" + PY_SETSID.replace("; ", "\n")
ESCAPES = {
    "setsid -f": "setsid -f sh -c 'echo $$ > PID_FILE; exec sleep 30'",
    "set -m": "set -m; sh -c 'echo $$ > PID_FILE; exec sleep 30' &",
    "os.setsid": f'PYTHON -c "{PY_SETSID}" &',
    "fork + os.setsid": f'PYTHON -c "{PY_DAEMON}"',
}
if sys.platform == "linux":  # its mark wiped: only the tether, a child subreaper there, still finds it
    ESCAPES["env -i setsid -f"] = "env -i setsid -f sh -c 'echo $$ > PID_FILE; exec sleep 30'"


@pytest.mark.slow
@pytest.mark.parametrize("end", ["returns", "times out", "is cancelled", "kill_all_processes"])
@pytest.mark.parametrize("escape", ESCAPES)
def test_processes_that_leave_the_group_die_with_the_call(
    tools: dict[str, Tool], tmp_path: Path, escape: str, end: str
) -> None:
    pid_file = tmp_path / "pid"
    spawn = ESCAPES[escape].replace("PID_FILE", str(pid_file)).replace("PYTHON", shlex.quote(sys.executable))
    command = f"{spawn}\nwhile [ ! -s {pid_file} ]; do sleep 0.05; done; echo spawned"
    if end != "returns":
        command += f"; echo 1 > {tmp_path / 'ready'}; sleep 30"

    async def call() -> tuple[ToolResult | None, list[int]]:
        task = asyncio.create_task(tools["bash"].call({"command": command, "timeout": 2 if end == "times out" else 60}))
        pids = await asyncio.to_thread(_pids, pid_file, 1)
        if end != "returns":  # the call still runs: the escaped process too, and "spawned" is in the pipe
            assert alive(pids[0])
            await asyncio.to_thread(_pids, tmp_path / "ready", 1)
        if end == "is cancelled":
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return None, pids
        if end == "kill_all_processes":
            kill_all_processes()
        return await asyncio.wait_for(task, 10), pids

    result, pids = asyncio.run(call())
    expected = {
        "returns": ok("spawned"),
        "times out": err("command timed out after 2s; its process group was killed\nspawned"),
        "is cancelled": None,
        "kill_all_processes": ok("spawned\n[exit code -9]"),
    }
    assert result == expected[end]
    _assert_all_dead(pids)


def _state(pid: int) -> tuple[str, int] | None:
    """A process's state letter and its pending signals (a mask: signal n is bit n - 1); None once it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except (FileNotFoundError, ProcessLookupError):  # gone, or ended between the open and the read
        return None
    status = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
    return status["State"][0], int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)


def _pending(mask: int, signum: int) -> bool:
    return bool(mask >> (signum - 1) & 1)


def _kill_waits_for(tether: int) -> bool:
    """Whether the kill is waiting for this stopped tether: asked (SIGUSR1 pending), not yet killed (no SIGKILL)."""
    state = _state(tether)
    return (
        state is not None
        and state[0] == "T"
        and _pending(state[1], signal.SIGUSR1)
        and not _pending(state[1], signal.SIGKILL)
    )


def _killed(pid: int) -> bool:
    """Gone, a zombie, or SIGKILL on its way (delivered as soon as it is scheduled)."""
    state = _state(pid)
    return state is None or state[0] in "ZX" or _pending(state[1], signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="a kill waits for the call's tether on Linux only")
@pytest.mark.parametrize("end", ["times out", "is cancelled", "background cancel"])
def test_the_event_loop_runs_on_while_a_call_is_killed(
    tools: dict[str, Tool], tmp_path: Path, end: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The command stops its tether: asked to kill everything, it cannot answer, and the kill waits for it
    # (TETHER_WAIT_S, shortened here) before it kills the group. Another coroutine on the same loop (another
    # session's tool loop, a server, the host) ticks meanwhile: the kill used to stall the loop throughout.
    monkeypatch.setattr(processes, "TETHER_WAIT_S", 0.5)
    pid_file = tmp_path / "pids"
    command = (
        f"sleep 30 & echo $! > {pid_file}; echo $$ >> {pid_file}; kill -STOP $PPID; echo $PPID >> {pid_file}; "
        "echo started; sleep 30"
    )
    log = CommandLog(tmp_path / "bash_1.log")
    background = CommandTask("bash#1", command, cwd=tmp_path, timeout=60, log=log, on_end=lambda _: None)

    async def kill_while_ticking() -> tuple[int, list[int]]:
        if end == "background cancel":
            await background.start(["bash", "-c", command])
        else:
            call = {"command": command, "timeout": 1 if end == "times out" else 60}
            task = asyncio.create_task(tools["bash"].call(call))
        pids = await asyncio.to_thread(_pids, pid_file)
        tether = pids[-1]
        while psutil.Process(tether).status() != psutil.STATUS_STOPPED:
            await asyncio.sleep(0.01)
        ticks = 0  # the other coroutine's, while the kill waits for the tether

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += _kill_waits_for(tether)
                await asyncio.sleep(0.005)

        ticker = asyncio.create_task(tick())
        if end == "background cancel":
            assert background.cancel("stopped by the test")
            await background.join()
            assert (background.status, log.text()) == ("aborted", "started\n")
        elif end == "is cancelled":
            task.cancel()
            while not _kill_waits_for(tether):
                await asyncio.sleep(0.005)
            task.cancel()  # again, as its kill waits: the call still returns only once the kill is done
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            assert await task == err("command timed out after 1s; its process group was killed\nstarted")
        assert [pid for pid in pids if not _killed(pid)] == []  # before the call returned
        ticker.cancel()
        return ticks, pids

    ticks, pids = asyncio.run(kill_while_ticking())
    assert ticks > 0
    _assert_all_dead(pids)


# --- a hostile tree cannot hang or exhaust a tool ----------------------------------------------------

NOT_REGULAR = "is not a regular file (a FIFO, device or socket)"


def test_special_files_are_refused_before_anything_blocks(tools: dict[str, Tool], ws: Workspace) -> None:
    os.mkfifo(ws.root / "pipe")
    assert run(tools["write"], path="pipe", content="x") == err(f"'pipe' {NOT_REGULAR}; tools only use regular files")
    assert run(tools["edit"], path="pipe", old_text="a", new_text="b") == err("'pipe' is not a regular file")
    assert run(tools["read"], path="pipe") == err("'pipe' is not a regular file")
    assert run(tools["grep"], pattern="x", path="pipe") == err(f"'pipe' {NOT_REGULAR}; grep only reads files")
    assert run(tools["grep"], pattern="hello", path="docs") == ok("docs/guide.md:1:Say hello.")
    os.mkfifo(ws.root / "docs/pipe.md")  # met while walking: skipped, never opened
    assert run(tools["grep"], pattern="hello", path="docs") == ok("docs/guide.md:1:Say hello.")
    assert run(tools["find"], pattern="*.md", path="docs") == ok("docs/guide.md")


def test_ls_lists_a_symlink_loop_instead_of_failing(tools: dict[str, Tool], ws: Workspace) -> None:
    (ws.root / "docs/loop").symlink_to("loop")
    (ws.root / "docs/a").symlink_to("b")
    (ws.root / "docs/b").symlink_to("a")
    assert run(tools["ls"], path="docs") == ok("a\nb\nguide.md\nloop")


def test_grep_runs_a_catastrophic_regex_in_linear_time(tools: dict[str, Tool], ws: Workspace) -> None:
    # Python's backtracking engine takes about 2**n steps here; rg's automaton takes n.
    (ws.root / "evil.txt").write_text("a" * 5000 + "b\n")
    assert run(tools["grep"], pattern="(a|aa)+$", path="evil.txt") == ok("No matches for '(a|aa)+$' in evil.txt")


def test_read_and_grep_of_a_huge_one_line_file_stay_small(tools: dict[str, Tool], ws: Workspace) -> None:
    size = 30 * 1024 * 1024
    with (ws.root / "min.js").open("w") as file:
        for _ in range(size // (1024 * 1024)):
            file.write("var x = 1;" * 104857 + "var ")
        file.write("needle;\n")
    tracemalloc.start()
    try:
        read = run(tools["read"], path="min.js")
        found = run(tools["grep"], pattern="needle", path="min.js")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * 1024 * 1024  # the file is 30 MB: it was never held whole
    n_chars = (ws.root / "min.js").stat().st_size - 1
    assert read == ok(f"     1\t{'var x = 1;' * 200}... [line truncated: {n_chars} chars]")
    assert found == ok(f"min.js:1:{'var x = 1;' * 200} [... omitted end of long line]")


def test_grep_reads_at_most_its_cap_of_rg_output_and_stops_rg(grep: GrepTool, ws: Workspace) -> None:
    # A 50 MB line, then more matching lines than the tool reads: rg prints the line's first 2000
    # bytes, then is killed once its output passes MAX_GREP_READ_BYTES.
    n_lines = 400_000
    with (ws.root / "huge.txt").open("w") as file:
        file.write("match" + "y" * (50 * 1024 * 1024) + "\n")
        file.writelines(f"match {i}\n" for i in range(2, n_lines + 1))
    printed = [f"huge.txt:1:match{'y' * 1995} [... omitted end of long line]"]
    printed += [f"huge.txt:{i}:match {i}" for i in range(2, n_lines + 1)]
    read = "".join(f"{line}\n" for line in printed).encode()[:MAX_GREP_READ_BYTES]
    n_read = read.count(b"\n")  # whole lines within the cap; the cut one is not shown
    tracemalloc.start()
    try:
        result = run(grep, pattern="match", path="huge.txt")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    note = (
        f"[... truncated: showing 200 of {n_read} matches (rg was stopped after {MAX_GREP_READ_BYTES} bytes of "
        "output); narrow the pattern, path or glob]"
    )
    assert (MAX_GREP_READ_BYTES, n_read) == (256_000, 10_229)
    assert result == ok("\n".join(printed[:200]) + "\n" + note)
    assert (len(printed[0]), len(result.output.encode())) == (2042, 6533)  # the bytes the model gets
    assert peak < 2 * 1024 * 1024  # a 50 MB file, 10 MB of output had rg gone on: neither was held
    assert not [p for p in psutil.Process().children(recursive=True) if p.name() == "rg"]


class BlockingTool(Tool):
    """A tool whose work never ends, as a blocked read or write once did."""

    name = "blocking"
    description = "blocks"
    read_only = True
    Params = TOOL_CLASSES["ls"].Params

    def execute(self, params: Any) -> str:
        threading.Event().wait()
        return "never"


def test_a_blocked_tool_is_stopped_by_the_time_limit(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("mlx_subagents.tools.base.DEFAULT_TOOL_TIMEOUT", 0.2)
    assert run(BlockingTool(ws)) == err("blocking took longer than 0.2s and was stopped; narrow the request")


@pytest.mark.slow
@pytest.mark.process
def test_a_blocked_tool_thread_does_not_keep_the_process_from_exiting(ws: Workspace) -> None:
    program = f"""
import asyncio, sys
sys.path.insert(0, {str(REPO)!r})
from tests.tools.test_tools import BlockingTool
from mlx_subagents.tools import Workspace

async def main():
    task = asyncio.ensure_future(BlockingTool(Workspace({str(ws.root)!r})).call({{}}))
    await asyncio.sleep(0.2)
    task.cancel()  # Ctrl-C or --timeout
    try:
        await task
    except asyncio.CancelledError:
        print("cancelled")

asyncio.run(main())
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "cancelled\n")


# --- edit against a concurrent writer; what bash's cap counts ----------------------------------------

APPENDER = """
import sys, time
path, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    with open(path, "a") as file:  # what `echo line >> file` does
        file.write(f"appended {i}\\n")
    time.sleep(0.001)
"""


@pytest.mark.slow
@pytest.mark.process
def test_edit_never_loses_what_a_concurrent_writer_appends(tools: dict[str, Tool], ws: Workspace) -> None:
    path = ws.root / "log.txt"
    path.write_text("counter = 0\n")
    appender = subprocess.Popen([sys.executable, "-c", APPENDER, str(path), "400"])
    n_edits = 0
    n_changed = 0
    try:
        while n_edits < 30:
            result = run(
                tools["edit"], path="log.txt", old_text=f"counter = {n_edits}\n", new_text=f"counter = {n_edits + 1}\n"
            )
            if result.is_error:
                assert result == err("log.txt: the file changed since it was read; read it again")
                n_changed += 1
            else:
                n_edits += 1
    finally:
        appender.wait(timeout=60)
    lines = path.read_text().splitlines()
    assert lines[0] == "counter = 30"
    assert sorted(lines[1:], key=lambda line: int(line.split()[1])) == [f"appended {i}" for i in range(400)]
    assert [p.name for p in ws.root.glob(".log.txt.*")] == []  # no temporary file left


def test_edit_refuses_a_file_changed_since_it_was_read(ws: Workspace) -> None:
    path = ws.root / "a.txt"
    path.write_bytes(b"one\r\ntwo\r\n")
    with pytest.raises(ToolError, match="^a.txt: the file changed since it was read; read it again$"):
        replace_checked(path, "a.txt", b"one\r\n", b"three\r\n")
    assert path.read_bytes() == b"one\r\ntwo\r\n"
    path.chmod(0o640)
    replace_checked(path, "a.txt", b"one\r\ntwo\r\n", b"three\r\n")
    assert (path.read_bytes(), path.stat().st_mode & 0o777) == (b"three\r\n", 0o640)


def test_bash_caps_what_the_model_sees_not_raw_bytes(tools: dict[str, Tool]) -> None:
    # Random bytes decode to U+FFFD (3 bytes of UTF-8) each: capping the raw bytes let 50 KB become 150 KB.
    result = run(tools["bash"], command="head -c 2000000 /dev/urandom")
    head, tail = result.output.split("\n[output truncated: ")[0], result.output.rsplit("]\n", 1)[1]
    assert len(head.encode()) <= 25600 and len(tail.encode()) <= 25600
    assert "[output truncated: 2000000 bytes total; showing the first and last 25600 bytes]" in result.output
    assert len(result.output.encode()) <= MAX_OUTPUT_BYTES + 100
    plain = run(tools["bash"], command="head -c 40000 /dev/urandom")  # under the cap as bytes, not as text
    assert len(plain.output.encode()) <= MAX_OUTPUT_BYTES + 100


def test_hard_links_are_what_the_readme_says(tools: dict[str, Tool], ws: Workspace) -> None:
    outside = ws.root.parent / "outside/secret.txt"
    os.link(outside, ws.root / "hard.txt")
    assert run(tools["read"], path="hard.txt") == ok(f"     1\t{SECRET}")  # the path rules see names only
    assert run(tools["edit"], path="hard.txt", old_text="TOP", new_text="LOW") == ok(
        "Edited hard.txt: replaced text at line 1"
    )
    assert (outside.read_text(), (ws.root / "hard.txt").read_text()) == (f"{SECRET}\n", "LOW-SECRET\n")


def test_a_timed_out_walk_stops_its_thread(
    tools: dict[str, Tool], ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(100):
        (ws.root / f"tree/d{i}").mkdir(parents=True)
    scanned: list[str] = []
    scandir = os.scandir

    def slow_scandir(path: Any) -> Any:  # a slow disk: 10 ms a folder, a second for the whole tree
        scanned.append(str(path))
        time.sleep(0.01)
        return scandir(path)

    monkeypatch.setattr("mlx_subagents.tools.workspace.os.scandir", slow_scandir)
    monkeypatch.setattr("mlx_subagents.tools.base.DEFAULT_TOOL_TIMEOUT", 0.05)
    assert run(tools["find"], pattern="*.nothing") == err(
        "find took longer than 0.05s and was stopped; narrow the request"
    )
    deadline = time.monotonic() + 30  # the walk of all 100 takes about a second; `scanned` tells which
    while any(t.name == "tool find" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the find thread went on walking"
        time.sleep(0.01)
    assert len(scanned) < 50  # told to stop, it stopped at the next folder instead of walking all 100
