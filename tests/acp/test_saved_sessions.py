"""Which saved runs an editor may continue as a session (in process: no agent process is needed)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import acp
import pytest

from mlx_subagents.acp.agent import EditorAgent
from mlx_subagents.runs.options import RunOptions
from mlx_subagents.runs.tasks import TaskSpec
from tests.helpers import go


def test_only_a_run_of_one_agent_in_the_editors_folder_continues_as_a_session(
    tmp_path: Path, scripted_runner: Any
) -> None:
    several = go(scripted_runner(["one"]), "parallel", [TaskSpec("scout", "a"), TaskSpec("planner", "b")])
    single = go(scripted_runner(["two"]), "run", TaskSpec("scout", "where is main?"))
    agent = EditorAgent(make_runner=None, options=RunOptions(), version="0")  # type: ignore[arg-type]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def refused(method: str, cwd: Path, run_id: str | None) -> str:
        with pytest.raises(acp.RequestError) as caught:
            asyncio.run(getattr(agent, method)(cwd=str(cwd), session_id=run_id, mcp_servers=[]))
        assert caught.value.code == -32602
        return str(caught.value)

    assert refused("resume_session", tmp_path, several.run_id) == (
        f"run {several.run_id} has 2 tasks (a parallel run); only a run of one agent continues as a session"
    )
    assert refused("load_session", elsewhere, single.run_id) == (
        f"run {single.run_id} was made in {tmp_path}, not in {elsewhere}; load it with that cwd"
    )
    listed = asyncio.run(agent.list_sessions(cwd=str(tmp_path))).sessions
    assert [(s.session_id, s.title) for s in listed] == [(single.run_id, "where is main?")]
    assert agent.sessions == {}  # nothing refused was opened
