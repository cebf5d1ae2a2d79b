"""Every tool failure is an error result, never a crash: known cases, then fuzzed arguments."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_subagents.runs.prepared import Parent
from mlx_subagents.runs.tasks import ModelRef
from mlx_subagents.tools import TOOL_NAMES, Tool, ToolResult, Workspace, make_tools

FUZZED_TOOLS = tuple(name for name in TOOL_NAMES if name != "bash")  # bash runs what it is given: tested apart


def run(tool: Tool, arguments: Any) -> ToolResult:
    return asyncio.run(tool.call(arguments))


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    """A tree with the awkward entries a cloned repository may hold."""
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    (root / "src/app.py").write_text("def main():\n    return 0\n")
    (root / "notes.md").write_text("hello\n" * 3)
    (root / "loop").symlink_to("loop")
    os.mkfifo(root / "pipe.md")
    return Workspace(root)


@pytest.fixture
def subagent(scripted_runner: Any, ws: Workspace) -> Tool:
    """The real `subagent` tool of an orchestrator, delegating through a runner on a scripted model."""
    runner = scripted_runner(["child answer"] * 200, cwd=ws.root, save_transcripts=False)
    parent = Parent(runner.catalog.get("orchestrator"), "o", 0, ModelRef(runner.options.model), None)
    return runner.board_tools(parent, ws)["subagent"]


def test_known_crashes_are_error_results(ws: Workspace, subagent: Tool) -> None:
    tools = make_tools(TOOL_NAMES, ws)
    reversed_range = ToolResult("Error: invalid glob '[z-a]': the range 'z-a' is reversed; write 'a-z'", is_error=True)
    assert run(tools["find"], {"pattern": "[z-a]"}) == reversed_range
    assert run(tools["grep"], {"pattern": "x", "glob": "[z-a]"}) == reversed_range
    assert run(tools["read"], {"path": "notes.md", "offset": 10**30}) == ToolResult(
        f"Error: offset {10**30} is past the end of 'notes.md' (3 lines); use an offset from 1 to 3", is_error=True
    )
    long_cwd = run(subagent, {"agent": "scout", "task": "look", "cwd": "d" * 5000})
    assert long_cwd.is_error and long_cwd.output.startswith("Error: ")
    assert "File name too long" in long_cwd.output and len(long_cwd.output) < 600


def test_an_unexpected_exception_in_a_tool_is_an_error_result(ws: Workspace) -> None:
    class Broken(Tool):
        name = "broken"
        description = "raises"
        read_only = True
        Params = make_tools(["ls"], ws)["ls"].Params

        def execute(self, params: Any) -> str:
            raise KeyError("surprise")

    assert run(Broken(ws), {}) == ToolResult(
        "Error: broken failed: KeyError: 'surprise'; call broken again with other arguments", is_error=True
    )


# Values a model may put anywhere: odd text (globs, regex, NUL, surrogates, long names), any numbers.
TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["[z-a]", "[", "**/[!", "{a,", "(a|aa)+$", "\\", "..", "/", "~", "loop", "pipe.md", "src"]),
    st.text(alphabet="ab/.*[]{}!-?\\", max_size=30),
    st.just("d" * 5000),
)
SCALAR = st.one_of(TEXT, st.integers(), st.integers(min_value=2**62), st.floats(), st.booleans(), st.none())
VALUE = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3))
KEYS = ["path", "pattern", "glob", "offset", "limit", "ignore_case", "old_text", "new_text", "content"]
KEYS += ["agent", "task", "tasks", "chain", "cwd"]


def arguments() -> st.SearchStrategy[Any]:
    return st.one_of(st.dictionaries(st.sampled_from(KEYS) | TEXT, VALUE, max_size=5), VALUE)


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from([*FUZZED_TOOLS, "subagent"]), args=arguments())
def test_fuzzed_arguments_never_crash_a_tool(ws: Workspace, subagent: Tool, name: str, args: Any) -> None:
    tool = subagent if name == "subagent" else make_tools([name], ws)[name]
    result = run(tool, args)
    assert isinstance(result, ToolResult) and isinstance(result.output, str)
    assert result.is_error == result.output.startswith("Error: ") or name == "subagent"
    if isinstance(args, dict):
        assert isinstance(tool.describe(args), str)
