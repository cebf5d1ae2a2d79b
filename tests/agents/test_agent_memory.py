"""Agent memory (issue 31): `memory: user | project | local`, the head of MEMORY.md in the system prompt,
the memory folder writable only by an agent that can edit files, and no line lost between writers; and
`background: true` in an agent file, the call site winning."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from mlx_subagents.home import state_home
from mlx_subagents.runs.tasks import TaskSpec
from tests.helpers import call, make_runner, run_parent, scripted_host, write_agent


def run_all(runner: Any, *agents: str) -> list[Any]:
    async def main() -> list[Any]:
        async with runner:
            return [await runner.run(TaskSpec(agent, "work")) for agent in agents]

    return asyncio.run(main())


def tool_outputs(host: Any, session: str) -> list[str]:
    return [m["content"] for m in host.history[session][-1] if m["role"] == "tool"]


def test_memory_head_goes_into_the_prompt_cut_at_200_lines(tmp_path: Path) -> None:
    write_agent(tmp_path, "keeper", "read, edit", front="memory: local\n")
    folder = tmp_path / ".mlx-subagents" / "agent-memory-local" / "keeper"
    folder.mkdir(parents=True)
    (folder / "MEMORY.md").write_text("".join(f"note {n}\n" for n in range(1, 251)))
    host = scripted_host({"agents": {"keeper": {"replies": ["ok"]}}})
    run_all(make_runner(tmp_path, host, assume_yes=True), "keeper")
    prompt = host.history["keeper"][0][0]["content"]
    path = ".mlx-subagents/agent-memory-local/keeper/MEMORY.md"  # in the workspace: no prompt names its folder
    notes = "\n".join(f"note {n}" for n in range(1, 201))
    cut = f"[memory cut at 200 lines; read {path} for the rest]"
    assert f"Your memory ({path}), kept across runs:\n\n{notes}\n{cut}\n\nKeep what you learn" in prompt
    assert "note 201" not in prompt


def test_a_writer_keeps_its_user_memory_outside_the_workspace(tmp_path: Path) -> None:
    write_agent(tmp_path, "keeper", "read, write, edit", front="memory: user\n")
    memory = state_home() / "agent-memory"
    keeper_file = str(memory / "keeper" / "MEMORY.md")
    script = {
        "agents": {
            "keeper": {"replies": [call("write", path=keeper_file, content="# notes\n"), "ok"]},
        }
    }
    host = scripted_host(script)
    run_all(make_runner(tmp_path, host, assume_yes=True), "keeper")
    assert Path(keeper_file).read_text() == "# notes\n"
    assert tool_outputs(host, "keeper") == [f"Wrote 8 bytes to {keeper_file}"]


def test_a_read_only_agent_gets_its_memory_without_write_access(tmp_path: Path) -> None:
    write_agent(tmp_path, "looker", "read, grep", front="memory: project\n")
    folder = tmp_path / ".mlx-subagents" / "agent-memory" / "looker"
    folder.mkdir(parents=True)
    (folder / "MEMORY.md").write_text("the tests live in t/\n")
    outside = state_home() / "elsewhere.md"
    outside.parent.mkdir(parents=True, exist_ok=True)
    outside.write_text("x\n")
    host = scripted_host({"agents": {"looker": {"replies": [call("read", path=str(outside)), "ok"]}}})
    run_all(make_runner(tmp_path, host, assume_yes=True), "looker")
    prompt = host.history["looker"][0][0]["content"]
    assert (
        "Your memory (.mlx-subagents/agent-memory/looker/MEMORY.md), kept across runs:\n\nthe tests live in t/\n\n"
        "All paths are relative" in prompt
    )
    assert "Keep what you learn" not in prompt
    assert tool_outputs(host, "looker")[0].startswith(f"Error: path '{outside}' is outside the workspace")


def test_a_project_memory_leaves_the_workspace_out_of_the_system_prompt(tmp_path: Path) -> None:
    """Two workspaces, one agent with `memory: project` whose notes are the same: one system prompt, so
    one shared prefix (its memory was named by its absolute path, docs/agents.md says none is); the
    relative path it names is the one its tools edit."""
    prompts = []
    for name in ("one", "two"):
        root = tmp_path / name
        write_agent(root, "keeper", "read, edit", front="memory: project\n")
        path = ".mlx-subagents/agent-memory/keeper/MEMORY.md"
        script = {
            "agents": {"keeper": {"replies": [call("edit", path=path, old_text="\n", new_text=f"\n- {name}\n"), "ok"]}}
        }
        host = scripted_host(script)
        run_all(make_runner(root, host, assume_yes=True), "keeper")
        prompts.append(host.history["keeper"][0][0]["content"])
        assert (root / path).read_text() == f"# Memory of keeper\n- {name}\n"
    assert prompts[0] == prompts[1] and str(tmp_path) not in prompts[0]


def test_two_parallel_writers_of_one_agent_both_keep_their_line(tmp_path: Path) -> None:
    write_agent(tmp_path, "keeper", "read, edit, write", front="memory: project\n")
    path = tmp_path / ".mlx-subagents" / "agent-memory" / "keeper" / "MEMORY.md"
    head = "# Memory of keeper\n"

    def append(line: str) -> list[Any]:
        return [call("edit", path=str(path), old_text=head, new_text=f"{head}{line}\n"), "ok"]

    script = {"sessions": {"keeper-1": {"replies": append("- a")}, "keeper-2": {"replies": append("- b")}}}
    host = scripted_host(script)
    runner = make_runner(tmp_path, host, assume_yes=True)

    async def main() -> Any:
        async with runner:
            return await runner.parallel([TaskSpec("keeper", "one"), TaskSpec("keeper", "two")])

    result = asyncio.run(main())
    assert [r.output for r in result.results] == ["ok", "ok"], [(r.error, r.stop_reason) for r in result.results]
    assert sorted(path.read_text().splitlines()) == ["# Memory of keeper", "- a", "- b"]
    for session in ("keeper-1", "keeper-2"):
        assert tool_outputs(host, session)[0].startswith("Edited ")


def test_a_background_agent_starts_in_the_background_unless_the_call_says_not(tmp_path: Path) -> None:
    write_agent(tmp_path, "sleeper", "read", front="background: true\n")
    write_agent(tmp_path, "boss", "read, subagent", front="agents: sleeper\n")
    calls = [
        call("subagent", agent="sleeper", task="nap"),
        call("subagent", agent="sleeper", task="x", background=False),
    ]
    script = {"agents": {"boss": {"replies": [*calls, "done"]}, "sleeper": {"replies": ["rested"]}}}
    host = scripted_host(script)
    result = run_parent(make_runner(tmp_path, host, assume_yes=True), agent="boss")
    assert result.output == "done"
    started, waited = tool_outputs(host, "boss")
    assert started.startswith("Started in the background: sleeper#1. Carry on with other work;")
    assert waited.startswith("rested\n\n[sub-agent run ") and waited.endswith("; task_send continues sleeper#2]")
