"""Hooks from the settings files and agent files: real hook scripts, fired for every agent of the tree."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.agents.discovery import discover_agents
from mlx_subagents.agents.hooks import HookConfigError
from mlx_subagents.events import Event
from mlx_subagents.runs.tasks import TaskSpec
from tests.helpers import all_dead, call, go

# Logs each event it reads to $HOOK_LOG (one JSON line) and blocks any bash command that runs `rm`.
GUARD = """\
import json, os, sys
event = json.load(sys.stdin)
with open(os.environ["HOOK_LOG"], "a") as log:
    log.write(json.dumps(event) + "\\n")
if event["hook_event_name"] == "PreToolUse" and event["tool_input"]["command"].startswith("rm "):
    print(f"no rm here ({event['agent']}, depth {event['depth']})", file=sys.stderr)
    sys.exit(2)
"""


def user_home() -> Path:
    return Path(os.environ["MLX_SUBAGENTS_HOME"])


def user_agent(name: str, front: str) -> None:
    folder = user_home() / "agents"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.md").write_text(f"---\nname: {name}\ndescription: {name} agent\n{front}---\nDo the task.\n")


def settings(path: Path, hooks: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"permissions": {"allow": []}, "hooks": hooks}))


def command_hooks(matcher: str | None, *commands: str, timeout: float | None = None) -> list[dict[str, Any]]:
    hooks = [{"type": "command", "command": c, **({"timeout": timeout} if timeout else {})} for c in commands]
    return [{"hooks": hooks, **({"matcher": matcher} if matcher is not None else {})}]


def results(events: list[Event], label: str) -> list[str]:
    return [e.data["output"] for e in events if e.kind == "tool_result" and e.label == label]


def test_settings_hooks_fire_for_every_agent_of_a_three_level_tree(
    scripted_runner: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    guard, log = tmp_path / "guard.py", tmp_path / "hooks.jsonl"
    guard.write_text(GUARD)
    monkeypatch.setenv("HOOK_LOG", str(log))
    run_guard = f"{shlex.quote(sys.executable)} {guard}"
    settings(
        user_home() / "settings.json",
        {
            "PreToolUse": command_hooks("Bash", run_guard),  # Claude Code's name of our bash
            "PostToolUse": command_hooks("bash", run_guard),
            "SubagentStart": command_hooks(None, run_guard),
            "SubagentStop": command_hooks(None, run_guard),
            "Stop": command_hooks(None, run_guard),
        },
    )
    user_agent("top", "tools: bash, subagent\nagents: mid\n")
    user_agent("mid", "tools: bash, subagent\nagents: tail\n")
    user_agent("tail", "tools: bash\n")
    for name in ("top", "mid", "tail"):
        (tmp_path / f"{name}.txt").write_text("keep")

    def replies(name: str, child: str | None) -> dict[str, Any]:
        steps = [call("bash", command=f"rm {name}.txt"), call("bash", command=f"echo hello from {name}")]
        steps += [call("subagent", agent=child, task="go on")] if child else []
        return {"replies": [*steps, {"content": f"{name} done"}]}

    script = {"agents": {"top": replies("top", "mid"), "mid": replies("mid", "tail"), "tail": replies("tail", None)}}
    events: list[Event] = []
    result = go(scripted_runner(script, events, max_depth=3), "run", TaskSpec("top", "start"))

    assert result.ok, result.error
    assert all((tmp_path / f"{name}.txt").read_text() == "keep" for name in ("top", "mid", "tail"))
    labels = {"top": "top", "mid": "top > mid#1", "tail": "top > mid#1 > tail#1"}
    for depth, (name, label) in enumerate(labels.items()):
        blocked, ran = results(events, label)[:2]
        assert blocked == f"Error: a PreToolUse hook blocked this call: no rm here ({name}, depth {depth})"
        assert ran == f"hello from {name}"
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    fired = [(e["hook_event_name"], e["agent"]) for e in seen]
    assert fired == [
        ("PreToolUse", "top"),
        ("PreToolUse", "top"),
        ("PostToolUse", "top"),
        ("SubagentStart", "mid"),
        ("PreToolUse", "mid"),
        ("PreToolUse", "mid"),
        ("PostToolUse", "mid"),
        ("SubagentStart", "tail"),
        ("PreToolUse", "tail"),
        ("PreToolUse", "tail"),
        ("PostToolUse", "tail"),
        ("Stop", "tail"),
        ("SubagentStop", "tail"),
        ("Stop", "mid"),
        ("SubagentStop", "mid"),
        ("Stop", "top"),
    ]
    post = [e for e in seen if e["hook_event_name"] == "PostToolUse"]
    assert [e["tool_response"] for e in post] == [
        {"output": f"hello from {name}", "is_error": False} for name in ("top", "mid", "tail")
    ]
    assert [(e["parent"], e["depth"], e["tool_name"]) for e in post] == [
        (None, 0, "bash"),
        ("top", 1, "bash"),
        ("top > mid#1", 2, "bash"),
    ]
    # A child's run is saved inside its parent's, under a run id of its own.
    assert {e["run_id"] for e in seen if e["agent"] == "top"} == {result.run_id}
    assert len({e["run_id"] for e in seen}) == 3
    assert {e["cwd"] for e in seen} == {str(tmp_path)}
    stop_tail = next(e for e in seen if e["hook_event_name"] == "SubagentStop" and e["agent"] == "tail")
    assert (stop_tail["status"], stop_tail["output"]) == ("completed", "tail done")
    assert not [e for e in events if e.kind == "hook_warning"]


@pytest.mark.slow
def test_a_hook_that_hangs_fails_or_prints_bad_json_is_one_warning_and_the_call_goes_on(
    scripted_runner: Any, tmp_path: Path
) -> None:
    hang = "echo $$ > hook.pid; sleep 30"
    settings(
        user_home() / "settings.json",
        {"PreToolUse": command_hooks(".*", hang, "echo broken >&2; exit 1", "echo '{not json'", timeout=1)},
    )
    events: list[Event] = []
    script = [call("bash", command="echo still ran"), {"content": "done"}]
    result = go(scripted_runner(script, events), "run", TaskSpec("worker", "go"))

    assert result.ok
    assert results(events, "worker") == ["still ran"]
    warnings = [e.data["message"] for e in events if e.kind == "hook_warning"]
    origin = str(user_home() / "settings.json")
    assert warnings == [
        f"PreToolUse hook {hang!r} ({origin}) timed out after 1s and was killed; not blocking",
        f"PreToolUse hook 'echo broken >&2; exit 1' ({origin}) failed with exit code 1: broken; not blocking",
        f"PreToolUse hook \"echo '{{not json'\" ({origin}) printed invalid JSON (Expecting property name enclosed "
        "in double quotes); not blocking",
    ]
    assert all_dead([int((tmp_path / "hook.pid").read_text())])


def test_a_projects_claude_settings_hooks_run_only_with_yes(scripted_runner: Any, tmp_path: Path) -> None:
    settings(tmp_path / ".claude" / "settings.json", {"PreToolUse": command_hooks("Bash", "echo ran >> hook-ran.txt")})
    script = [call("bash", command="echo hi"), {"content": "done"}]

    events: list[Event] = []
    assert go(scripted_runner(script, events), "run", TaskSpec("worker", "go")).ok
    assert not (tmp_path / "hook-ran.txt").exists()
    [warning] = [e.data["message"] for e in events if e.kind == "hook_warning"]
    path = tmp_path / ".claude" / "settings.json"
    assert warning == f"the hooks in {path} did not run: they come with the project; re-run with --yes to allow them"

    assert go(scripted_runner(script, assume_yes=True), "run", TaskSpec("worker", "go")).ok
    assert (tmp_path / "hook-ran.txt").read_text() == "ran\n"


def test_an_agent_files_hooks_fire_for_that_agent_only(scripted_runner: Any, tmp_path: Path) -> None:
    hooks = json.dumps({"PreToolUse": command_hooks("bash", "echo guarded says no >&2; exit 2")})
    user_agent("guarded", f"tools: bash, subagent\nagents: free\nhooks: {hooks}\n")
    user_agent("free", "tools: bash\n")
    script = {
        "agents": {
            "guarded": {
                "replies": [
                    call("bash", command="echo a"),
                    call("subagent", agent="free", task="go"),
                    {"content": "ok"},
                ]
            },
            "free": {"replies": [call("bash", command="echo b"), {"content": "ok"}]},
        }
    }
    events: list[Event] = []
    assert go(scripted_runner(script, events), "run", TaskSpec("guarded", "go")).ok
    assert results(events, "guarded")[0] == "Error: a PreToolUse hook blocked this call: guarded says no"
    assert results(events, "guarded > free#1") == ["b"]


def test_bad_hooks_are_one_line_naming_the_file(scripted_runner: Any, tmp_path: Path) -> None:
    path = user_home() / "settings.json"
    settings(path, {"PreToolUse": [{"matcher": "(", "hooks": [{"type": "command", "command": "true"}]}]})
    with pytest.raises(HookConfigError) as caught:
        go(scripted_runner([{"content": "done"}]), "run", TaskSpec("worker", "go"))
    assert str(caught.value).startswith(f"{path}: hooks.PreToolUse[0]: 'matcher' '(' is not a valid regex (")
    user_agent("odd", 'hooks: {"OnSave": []}\n')
    catalog = discover_agents(tmp_path)
    assert "odd" not in catalog.agents
    assert any("field 'hooks': unknown hook event 'OnSave'; use one of PreToolUse" in w for w in catalog.warnings)


def test_a_stop_hook_that_blocks_sends_the_agent_back_to_work(scripted_runner: Any, tmp_path: Path) -> None:
    once = "test -f asked || { touch asked; echo 'run the tests first' >&2; exit 2; }"
    settings(user_home() / "settings.json", {"Stop": command_hooks(None, once)})
    runner = scripted_runner([{"content": "done early"}, {"content": "done"}])
    result = go(runner, "run", TaskSpec("worker", "go"))
    assert (result.output, result.usage.turns) == ("done", 2)
    messages = runner.preparer.hosts[next(iter(runner.preparer.hosts))].history["worker"][-1]
    assert messages[-1] == {"role": "user", "content": "A Stop hook did not accept the answer: run the tests first"}


def test_a_broken_project_settings_file_is_one_warning_naming_its_line_and_the_run_goes_on(
    scripted_runner: Any, tmp_path: Path
) -> None:
    path = tmp_path / ".claude" / "settings.json"
    path.parent.mkdir()
    path.write_text('{\n  // the team\'s hooks\n  "hooks": {}\n}\n')  # a comment: not JSON
    script = [call("bash", command="echo hi"), {"content": "done"}]
    events: list[Event] = []

    assert go(scripted_runner(script, events, assume_yes=True), "run", TaskSpec("worker", "go")).ok

    assert [e.data["message"] for e in events if e.kind == "hook_warning"] == [
        f"{path}: invalid JSON at line 2 column 3: Expecting property name enclosed in double quotes; its hooks are "
        "left out (write it as plain JSON, without comments)"
    ]
    assert results(events, "worker") == ["hi"]


def test_a_bad_event_or_matcher_in_a_project_file_leaves_out_that_part_only_and_only_after_consent(
    scripted_runner: Any, tmp_path: Path
) -> None:
    path = tmp_path / ".claude" / "settings.json"
    good = command_hooks("Bash", "echo ran >> hook-ran.txt")
    bad_matcher = [{"matcher": "Bash(", "hooks": [{"type": "command", "command": "echo never >> hook-ran.txt"}]}]
    path.parent.mkdir()
    path.write_text(json.dumps({"hooks": {"OnSave": good, "PreToolUse": [*bad_matcher, *good]}}, indent=1))
    script = [call("bash", command="echo hi"), {"content": "done"}]

    # Without consent the hooks are not even checked: the one line says they need it.
    events: list[Event] = []
    assert go(scripted_runner(script, events), "run", TaskSpec("worker", "go")).ok
    assert [e.data["message"] for e in events if e.kind == "hook_warning"] == [
        f"the hooks in {path} did not run: they come with the project; re-run with --yes to allow them"
    ]

    events.clear()
    assert go(scripted_runner(script, events, assume_yes=True), "run", TaskSpec("worker", "go")).ok

    warnings = [e.data["message"] for e in events if e.kind == "hook_warning"]
    lines = path.read_text().splitlines()
    event, matcher = (next(n for n, line in enumerate(lines, 1) if key in line) for key in ('"OnSave"', '"Bash("'))
    assert warnings.pop(0) == (  # --yes names what it lets run unsandboxed, and from which file
        f"--yes: the project file {path} has hooks: commands that run unsandboxed, as you, around the agents' tool "
        "calls"
    )
    assert warnings == [
        f"{path} line {event}: unknown hook event 'OnSave'; use one of PreToolUse, PostToolUse, SubagentStart, "
        "SubagentStop, Stop; its hooks are left out, the others run",
        f"{path} line {matcher}: hooks.PreToolUse[0]: 'matcher' 'Bash(' is not a valid regex (missing ), unterminated "
        "subpattern at position 4); fix or remove it; that hook group is left out, the others run",
    ]
    assert (tmp_path / "hook-ran.txt").read_text() == "ran\n"  # the good group ran, once
