"""Skills (issue 31): discovery beside the agents, the catalog ending each system prompt, the `skill` tool,
`skills:` in agent files, consent for project skills, and delegation never widening what a child is offered."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.agents.skills import CATALOG_HEAD, LINK_FIX, discover_skills
from mlx_subagents.home import state_home
from mlx_subagents.runs.tasks import TaskSpec
from mlx_subagents.runs.transcripts import read_transcript
from tests.helpers import REPO, call, make_runner, run_parent, scripted_host, write_agent


def write_skill(folder: Path, name: str, description: str, body: str = "") -> Path:
    """`folder/NAME/SKILL.md`, with a body of instructions."""
    (folder / name).mkdir(parents=True, exist_ok=True)
    path = folder / name / "SKILL.md"
    path.write_text(f"---\nname: {name}\ndescription: {description}\n---\n{body or f'How to {name}.'}\n")
    return path


def user_skills() -> Path:
    pdf = write_skill(state_home() / "skills", "pdf", "Fill and read PDF forms", "Use pdftk to fill forms.")
    (pdf.parent / "reference.md").write_text("pdftk FILE fill_form DATA output OUT\n")
    write_skill(state_home() / "skills", "review", "Review a diff for bugs")
    return pdf.parent


def skill(name: str, **arguments: Any) -> dict[str, Any]:
    """A scripted reply calling the `skill` tool (`call` takes `name` itself)."""
    return {"tool_calls": [{"name": "skill", "arguments": {"name": name, **arguments}}]}


def system_prompts(host: Any, session: str) -> str:
    return host.history[session][0][0]["content"]


def run_one(runner: Any, agent: str = "scout") -> Any:
    async def main() -> Any:
        async with runner:
            return await runner.run(TaskSpec(agent, "look"))

    return asyncio.run(main())


def test_catalog_ends_the_prompt_and_the_skill_tool_loads_body_and_files(tmp_path: Path) -> None:
    user_skills()
    replies = [skill("pdf"), skill("pdf", file="reference.md"), skill("x"), "ok"]
    host = scripted_host(replies)
    result = run_one(make_runner(tmp_path, host))
    prompt = system_prompts(host, "scout")
    assert prompt.endswith(f"{CATALOG_HEAD}\n- pdf: Fill and read PDF forms\n- review: Review a diff for bugs")
    tools = [m["content"] for m in host.history["scout"][-1] if m["role"] == "tool"]
    assert tools[0] == (
        "# Skill: pdf\n\nUse pdftk to fill forms.\n\n"
        'Files of this skill (read one with skill name="pdf" file="<name>"):\n- reference.md'
    )
    assert tools[1] == "     1\tpdftk FILE fill_form DATA output OUT"
    assert tools[2] == "Error: no skill 'x' is available to this agent; use one of: pdf, review"
    assert result.output == "ok"


def test_skill_files_stay_inside_the_skill_folder(tmp_path: Path) -> None:
    folder = user_skills()
    (tmp_path / "secret.txt").write_text("secret\n")
    os.symlink(tmp_path / "secret.txt", folder / "link.md")
    host = scripted_host([skill("pdf", file="../../../secret.txt"), skill("pdf", file="link.md"), "ok"])
    run_one(make_runner(tmp_path, host))
    tools = [m["content"] for m in host.history["scout"][-1] if m["role"] == "tool"]
    assert all(t.startswith("Error: path ") and "is outside the workspace" in t for t in tools), tools


def test_skills_field_preloads_only_the_listed_ones_and_none_offers_none(tmp_path: Path) -> None:
    user_skills()
    write_agent(tmp_path, "pdfer", "read", front="skills: [pdf]\n")
    write_agent(tmp_path, "plain", "read", front="skills: none\n")
    host = scripted_host({"agents": {"pdfer": {"replies": ["ok"]}, "plain": {"replies": ["ok"]}}})
    runner = make_runner(tmp_path, host, assume_yes=True)

    async def main() -> None:
        async with runner:
            await runner.run(TaskSpec("pdfer", "x"))
            await runner.run(TaskSpec("plain", "x"))

    asyncio.run(main())
    pdfer = system_prompts(host, "pdfer")
    assert pdfer.endswith(f"## Skill: pdf\nUse pdftk to fill forms.\n\n{CATALOG_HEAD}\n- pdf: Fill and read PDF forms")
    assert "Skills (" not in system_prompts(host, "plain")


def test_a_project_skill_is_offered_only_with_yes(tmp_path: Path) -> None:
    write_skill(tmp_path / ".claude" / "skills", "deploy", "Deploy the app")
    for yes in (False, True):
        host = scripted_host(["ok"])
        run_one(make_runner(tmp_path, host, assume_yes=yes))
        assert ("- deploy: Deploy the app" in system_prompts(host, "scout")) is yes


def test_a_child_is_offered_only_the_skills_its_parent_could_use(tmp_path: Path) -> None:
    user_skills()
    write_agent(tmp_path, "boss", "read, subagent", front="skills: [review]\nagents: scout\n")
    script = {
        "agents": {
            "boss": {"replies": [call("subagent", agent="scout", task="look"), "done"]},
            "scout": {"replies": [skill("pdf"), "seen"]},
        }
    }
    host = scripted_host(script)
    result = run_parent(make_runner(tmp_path, host, assume_yes=True), agent="boss")
    assert result.output == "done"
    (child,) = [name for name in host.history if name != "boss"]
    assert system_prompts(host, child).endswith(f"{CATALOG_HEAD}\n- review: Review a diff for bugs")
    tool = [m["content"] for m in host.history[child][-1] if m["role"] == "tool"]
    assert tool == ["Error: no skill 'pdf' is available to this agent; use one of: review"]


def test_hostile_skill_files_are_skipped_with_one_warning_each(tmp_path: Path) -> None:
    folder = tmp_path / ".mlx-subagents" / "skills"
    write_skill(folder, "good", "A good skill")
    (folder / "fifo").mkdir()
    os.mkfifo(folder / "fifo" / "SKILL.md")
    (folder / "zero").mkdir()
    os.symlink("/dev/zero", folder / "zero" / "SKILL.md")
    (folder / "huge").mkdir()
    with open(folder / "huge" / "SKILL.md", "wb") as file:
        file.truncate(10 * 1024 * 1024)
    skills, warnings = discover_skills(tmp_path, "project")
    assert list(skills) == ["good"]
    assert [w.split(": ", 1)[0] for w in warnings] == [
        f"skipped {folder / name / 'SKILL.md'}" for name in ("fifo", "huge", "zero")
    ]
    assert "over the limit of 1,048,576" in warnings[1]
    assert "not a regular file" in warnings[0]
    assert warnings[2].endswith(f"{folder / 'zero' / 'SKILL.md'} is a symbolic link; {LINK_FIX}")


def test_the_catalog_is_byte_stable_so_the_shared_prefix_is_reused(
    tmp_path: Path, tiny_qwen3_path: Path, tiny_qwen3: Any
) -> None:
    from mlx_subagents.testing import ForcedScripts

    user_skills()
    scripts = ForcedScripts(tiny_qwen3[1], {"scout": ["one", "two"]})
    # The tiny tokenizer spends about a token a byte: the scout's prompt and tools take over half of 4,096.
    runner = make_runner(tmp_path, str(tiny_qwen3_path), processor_factory=scripts, context_window=8192)

    async def main() -> Any:
        async with runner:
            return [await runner.run(TaskSpec("scout", "look")) for _ in range(2)]

    first, second = asyncio.run(main())
    assert (first.output, second.output) == ("one", "two")
    prompts = [read_transcript(Path(r.transcript)).messages[0]["content"] for r in (first, second)]
    assert prompts[0] == prompts[1] and CATALOG_HEAD in prompts[0]
    n_prompt = len(tiny_qwen3[1].encode(prompts[0]))
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens >= n_prompt, (second.usage, n_prompt)


def test_skills_command_lists_them_and_agents_verbose_shows_each_agents(tmp_path: Path, run_cli: Any) -> None:
    user_skills()
    write_agent(tmp_path, "pdfer", "read", front="skills: [pdf, ocr]\n")
    code, stdout, _ = run_cli("skills", "--cwd", str(tmp_path), "--json")
    assert code == 0
    pdf = state_home() / "skills" / "pdf" / "SKILL.md"
    assert json.loads(stdout)[0] == {
        "name": "pdf",
        "description": "Fill and read PDF forms",
        "source": "user",
        "path": str(pdf),
        "bytes": pdf.stat().st_size,
    }
    assert [row["name"] for row in json.loads(stdout)] == ["pdf", "review"]
    code, stdout, _ = run_cli("agents", "--cwd", str(tmp_path), "--verbose")
    assert code == 0
    assert "  skills: pdf (preloaded: pdf); not found: ocr\n" in stdout
    assert "  skills: pdf, review\n" in stdout  # the built-ins say nothing: every skill found


@pytest.mark.process
def test_a_cli_run_shows_the_catalog_in_the_transcript_and_the_skill_tool_result(
    tmp_path: Path, preloaded_python: list[str]
) -> None:
    user_skills()
    script = tmp_path / "script.json"
    script.write_text(json.dumps([skill("review"), "reviewed"]))
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}  # the preloaded process's width
    args = ["run", "scout", "look", "--model", f"scripted:{script}", "--cwd", str(tmp_path), "--json"]
    command = [*preloaded_python, "-m", "mlx_subagents.cli", *args]  # a fork of the worker's preloaded process
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    messages = read_transcript(Path(json.loads(proc.stdout)["transcript"])).messages
    assert messages[0]["content"].endswith(
        f"{CATALOG_HEAD}\n- pdf: Fill and read PDF forms\n- review: Review a diff for bugs"
    )
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["# Skill: review\n\nHow to review."]
