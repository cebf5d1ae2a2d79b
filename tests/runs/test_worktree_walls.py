"""The walls around worktrees: the tool's git runs nothing a repository or a sandboxed agent wrote,
a sandboxed isolated task writes its own worktree and not the parent's tree, `apply` never writes
through a link, damaged manifests and task text are one line, and `prune` spares what a task holds."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.errors import RequestError
from mlx_subagents.runs.tasks import TaskSpec
from mlx_subagents.runs.worktrees import (
    apply_worktree,
    finish_worktree,
    in_use,
    list_worktrees,
    make_worktree,
    prune_worktrees,
    release_worktree,
    worktrees_home,
)
from tests.helpers import call, go, make_runner, needs_bwrap, scripted_host, write_agent
from tests.runs.test_worktrees import git, make_repo


def plant_programs(repo: Path, marker: Path) -> None:
    """Every way a repository makes git run a program during worktree add, add, commit and apply: its
    hooks, a `core.hooksPath` folder of hooks, and `core.fsmonitor`."""
    script = f'#!/bin/sh\necho "$0" >> {marker}\n'
    hooks = repo / ".git" / "hooks"
    other = repo / "other-hooks"
    other.mkdir()
    for folder in (hooks, other):
        for name in ("post-checkout", "pre-commit", "commit-msg", "post-commit", "reference-transaction"):
            (folder / name).write_text(script)
            (folder / name).chmod(0o755)
    monitor = repo / "monitor.sh"
    monitor.write_text(script)
    monitor.chmod(0o755)
    git(repo, "config", "core.fsmonitor", str(monitor))


def plant_drivers(repo: Path, marker: Path, git_dir: Path | None = None) -> None:
    """Every program a repository's config and attributes make git run on the trees the tool commits,
    diffs and applies: a filter (clean, smudge, a long-running process), a diff driver (textconv and
    command), a merge driver and `diff.external`, selected by a `.gitattributes` in the tree and by
    `info/attributes`; and hooks and `core.fsmonitor` (`plant_programs`)."""
    run = f'sh -c "echo $0 >> {marker}; cat"'
    settings = {
        "filter.evil.clean": run.replace("$0", "clean"),
        "filter.evil.smudge": run.replace("$0", "smudge"),
        "filter.evil.process": run.replace("$0", "process"),
        "diff.evil.textconv": run.replace("$0", "textconv"),
        "diff.evil.command": run.replace("$0", "diff-command"),
        "merge.evil.driver": run.replace("$0", "merge"),
        "diff.external": run.replace("$0", "external"),
    }
    for key, value in settings.items():
        git(repo, "config", key, value)
    (repo / ".gitattributes").write_text("* filter=evil diff=evil merge=evil\n")
    info = (git_dir or repo / ".git") / "info"
    info.mkdir(exist_ok=True)
    (info / "attributes").write_text("* filter=evil diff=evil merge=evil\n")
    plant_programs(repo, marker)


def test_a_repository_an_agent_made_in_a_subfolder_runs_nothing_in_the_tools_git(tmp_path: Path) -> None:
    """A workspace inside a repository has no `.git` of its own to protect: a sandboxed agent may make one
    there, with drivers, attributes, hooks and a monitor. The user's next isolated run in that folder
    branches from it, carries, commits and applies with none of them running."""
    outer = make_repo(tmp_path / "outer")
    folder = outer / "sub"
    folder.mkdir()
    (folder / "code.txt").write_text("one\n")
    marker = tmp_path / "ran.txt"
    git(folder, "init", "-q", "-b", "main")  # what the agent did, in its sandbox
    plant_drivers(folder, marker)
    git(folder, "add", "-A")
    git(folder, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "planted")
    assert "process" in marker.read_text()  # the planted programs are real: plain git runs them
    marker.unlink()
    (folder / "draft.txt").write_text("draft\n")  # uncommitted: carried into the worktree

    tree = make_worktree(folder, run_id="r1", label="w", agent="worker", task="edit")
    (Path(tree.path) / "code.txt").write_text("three\n")
    kept = finish_worktree(tree, "completed")
    assert kept is not None
    assert apply_worktree(kept) == ["code.txt"]
    prune_worktrees()

    assert not marker.exists(), marker.read_text()
    assert (folder / "code.txt").read_text() == "three\n"


def test_a_nested_repository_in_a_worktree_is_left_out_and_never_entered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An isolated writer plants a repository inside its worktree (drivers, hooks, a monitor, and a
    `.gitmodules` naming it) and an empty `git init`: the end-of-task commit enters neither, leaves
    both out in one line, and commits the rest."""
    repo = make_repo(tmp_path / "repo")
    marker = tmp_path / "ran.txt"
    tree = make_worktree(repo, run_id="r1", label="w", agent="worker", task="edit")
    place = Path(tree.path)
    nested, empty = place / "nested", place / "empty"
    nested.mkdir()
    git(nested, "init", "-q", "-b", "main")
    (nested / "inner.txt").write_text("inner\n")
    plant_drivers(nested, marker)
    git(nested, "add", "-A")
    git(nested, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "nested")
    marker.unlink()
    empty.mkdir()
    git(empty, "init", "-q")  # no commit: `git add -A` of it fails the whole commit
    (place / ".gitmodules").write_text('[submodule "nested"]\n\tpath = nested\n\turl = ./nested\n')
    (place / "shared.txt").write_text("changed\n")

    kept = finish_worktree(tree, "completed")

    assert kept is not None and kept.status == "completed"
    assert kept.files == (".gitmodules", "shared.txt")
    assert git(repo, "ls-tree", "-r", "--name-only", kept.branch).split() == [".gitmodules", "notes.txt", "shared.txt"]
    assert capsys.readouterr().err == (
        f"warning: worktree {tree.name}: left out empty, nested: a git repository of its own, which the tool's git "
        f"does not enter; its files stay in {place}\n"
    )
    assert not marker.exists(), marker.read_text()


@needs_bwrap
def test_an_isolated_agent_that_runs_git_init_ends_completed_with_its_json(tmp_path: Path) -> None:
    """The empty nested `git init` made the isolated commit fail: exit 2, no JSON, the manifest left
    `running`. Now the task ends as it ended, its other changes committed."""
    repo = make_repo(tmp_path / "repo")
    write_agent(repo, "fixer", "[bash]")  # a project agent: sandboxed
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "agent")
    command = "mkdir scratch && git init -q scratch && echo fixed > shared.txt && echo done"
    host = scripted_host({"agents": {"fixer": {"replies": [call("bash", command=command), "fixed it"]}}})

    result = go(make_runner(repo, host, assume_yes=True), "run", TaskSpec("fixer", "fix", isolation="worktree"))

    assert (result.status, result.output) == ("completed", "fixed it")
    assert result.worktree is not None and result.worktree.files == ["shared.txt"]
    assert [w.status for w in list_worktrees()] == ["completed"]


def test_the_tools_git_runs_no_hook_no_fsmonitor_and_ignores_git_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = make_repo(tmp_path / "repo")
    marker = tmp_path / "ran.txt"
    plant_programs(repo, marker)
    git(repo, "add", "-A")
    git(repo, "reset", "-q")
    assert marker.exists()  # the planted programs are real: plain git runs them
    marker.unlink()
    # Variables that would turn hooks back on, or send git to another repository.
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", "core.hooksPath")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", str(repo / "other-hooks"))
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "nowhere"))
    (repo / "notes.txt").write_text("uncommitted\n")  # carried: an apply and a commit in the worktree

    tree = make_worktree(repo, run_id="r1", label="w", agent="worker", task="edit")
    (Path(tree.path) / "shared.txt").write_text("changed\n")
    kept = finish_worktree(tree, "completed")
    assert kept is not None
    assert apply_worktree(kept) == ["shared.txt"]
    assert not marker.exists(), marker.read_text()
    assert (repo / "shared.txt").read_text() == "changed\n"


@needs_bwrap
def test_a_sandboxed_isolated_task_writes_its_worktree_and_not_the_parents_tree(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    write_agent(repo, "fixer", "[bash]")  # a project agent: sandboxed
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "agent")
    hooks = repo / ".git" / "hooks"
    command = (
        f"echo fixed > shared.txt; (echo parent > {repo}/shared.txt) 2>/dev/null || echo PARENT-REFUSED; "
        f"(echo x > {hooks}/post-commit) 2>/dev/null || echo HOOK-REFUSED; "
        "(echo x >> .git) 2>/dev/null || echo GIT-FILE-REFUSED"
    )
    host = scripted_host({"agents": {"fixer": {"replies": [call("bash", command=command), "done"]}}})

    result = go(make_runner(repo, host, assume_yes=True), "run", TaskSpec("fixer", "fix", isolation="worktree"))

    outputs = [m["content"] for m in next(iter(host.history.values()))[-1] if m["role"] == "tool"]
    assert outputs == ["PARENT-REFUSED\nHOOK-REFUSED\nGIT-FILE-REFUSED"]
    assert (repo / "shared.txt").read_text() == "original\n"
    assert not (hooks / "post-commit").exists()
    assert result.worktree is not None and result.worktree.files == ["shared.txt"]
    assert git(repo, "show", f"{result.worktree.branch}:shared.txt") == "fixed\n"


@pytest.mark.slow
@needs_bwrap
def test_a_background_command_of_a_sandboxed_isolated_task_writes_its_worktree_only(tmp_path: Path) -> None:
    """A background `bash` is made outside `make_tools` (on its agent's board): it gets the same sandbox,
    writing the task's worktree and not the parent's tree (issue 42's note, issue 44 item 1)."""
    repo = make_repo(tmp_path / "repo")
    write_agent(repo, "fixer", "[bash]")  # a project agent: sandboxed
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "agent")
    command = f"echo fixed > shared.txt; (echo parent > {repo}/shared.txt) 2>/dev/null || echo PARENT-REFUSED"
    replies = [call("bash", command=command, background=True), call("task_output", id="bash#1", wait=30), "done"]
    host = scripted_host({"agents": {"fixer": {"replies": replies}}})

    result = go(make_runner(repo, host, assume_yes=True), "run", TaskSpec("fixer", "fix", isolation="worktree"))

    outputs = [m["content"] for m in next(iter(host.history.values()))[-1] if m["role"] == "tool"]
    status, output = outputs[1].split("\n\n")  # its status line shows the command shortened
    assert (status.startswith("bash#1 completed ($ echo fixed > shared.txt;"), output) == (True, "PARENT-REFUSED\n")
    assert (repo / "shared.txt").read_text() == "original\n"
    assert result.worktree is not None and result.worktree.files == ["shared.txt"]
    assert git(repo, "show", f"{result.worktree.branch}:shared.txt") == "fixed\n"


def test_apply_never_writes_through_a_symlink_in_the_workspace(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    tree = make_worktree(repo, run_id="r1", label="w", agent="worker", task="add docs")
    (Path(tree.path) / "docs").mkdir()
    (Path(tree.path) / "docs" / "evil.txt").write_text("planted\n")
    kept = finish_worktree(tree, "completed")
    assert kept is not None
    outside = tmp_path / "outside"
    outside.mkdir()
    (repo / "docs").symlink_to(outside)  # appeared in the shared tree after the child started

    with pytest.raises(RequestError) as refused:
        apply_worktree(kept)

    assert str(refused.value) == (
        f"cannot apply {kept.branch}: docs/evil.txt (through {repo / 'docs'}) is a symlink in the workspace, and a "
        "change through it would land outside; remove or replace the link there, or merge the branch yourself"
    )
    assert list(outside.iterdir()) == []  # git apply --3way's fallback would have written it there


def test_a_damaged_manifest_is_one_line_and_the_others_still_list_apply_and_prune(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = make_repo(tmp_path / "repo")
    tree = make_worktree(repo, run_id="r1", label="w", agent="worker", task="edit")
    (Path(tree.path) / "shared.txt").write_text("changed\n")
    kept = finish_worktree(tree, "completed")
    assert kept is not None
    home = worktrees_home()
    (home / "a-bad.json").write_text("{not json")
    (home / "b-list.json").write_text("[1, 2]")
    (home / "c-fields.json").write_text(json.dumps({"name": "x", "path": 3}))
    os.mkfifo(home / "d-fifo.json")  # would hang a plain read

    assert [w.name for w in list_worktrees()] == [kept.name]
    assert apply_worktree(kept) == ["shared.txt"]
    assert [w.name for w in prune_worktrees()] == [kept.name]

    lines = capsys.readouterr().err.splitlines()
    fix = "remove it (and the worktree beside it, if any, with git worktree remove)"
    assert lines[:4] == [
        f"warning: skipped {home / 'a-bad.json'}: invalid JSON at line 1 column 2: Expecting property name enclosed "
        "in double quotes",
        f"warning: skipped {home / 'b-list.json'}: not a worktree manifest (a JSON list); {fix}",
        f"warning: skipped {home / 'c-fields.json'}: a damaged worktree manifest (missing branch, repo, folder, base, "
        f"agent, label, task, run_id); {fix}",
        f"warning: skipped {home / 'd-fifo.json'}: not a regular file (a FIFO, device or socket); a worktree manifest "
        "must be a plain text file",
    ]
    assert lines[4:] == lines[:4]  # prune's listing says the same


def test_a_nul_in_the_task_text_is_left_out_of_the_commit_and_the_worktree_ends(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    tree = make_worktree(repo, run_id="r1", label="w\x00x", agent="worker", task="fix\x00 it\x1b[31m\nfully")
    (Path(tree.path) / "shared.txt").write_text("changed\n")

    kept = finish_worktree(tree, "completed")

    assert kept is not None and kept.status == "completed"
    assert git(repo, "log", "-1", "--format=%B", kept.branch) == "worker [wx]: fix it[31m\n\nfix it[31m\nfully\n\n"
    assert [w.status for w in list_worktrees()] == ["completed"]


@pytest.mark.process  # the holder
def test_prune_spares_a_worktree_a_live_task_holds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo = make_repo(tmp_path / "repo")
    running = make_worktree(repo, run_id="r1", label="busy", agent="worker", task="still working")
    # Not one commit of its own yet: its branch is HEAD's, so it looks merged.
    assert git(repo, "merge-base", "--is-ancestor", running.branch, "HEAD") == ""
    assert in_use(running.name)  # held by this process, which makes it for its task
    release_worktree(running.name)  # as if the task ran in another process: that one holds it
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(worktrees_home() / f"{running.name}.lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert in_use(running.name)

        assert prune_worktrees() == []
        assert Path(running.path).is_dir()
        assert capsys.readouterr().err == (
            f"warning: kept {running.name}: a task is still running in it (prune it once that task ends)\n"
        )
    finally:
        holder.kill()
        holder.wait()
    assert not in_use(running.name)  # the OS let go when the holder died
    assert [w.name for w in prune_worktrees()] == [running.name]
    assert not Path(running.path).exists()


# Holds a worktree's lock as a task's process does, until killed.
HOLD = (
    "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB); "
    "print('held', flush=True); time.sleep(60)"
)


def test_a_fork_asking_for_a_worktree_is_refused_in_one_line(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    forks = [
        call("subagent", fork=True, task="try the other way", isolation="worktree"),  # the call's isolation
        call("subagent", tasks=[{"fork": True, "task": "try", "label": "f", "isolation": "worktree"}]),  # its own
    ]
    host = scripted_host({"agents": {"orchestrator": {"replies": [*forks, "done"]}}})

    result: Any = go(make_runner(repo, host), "run", TaskSpec("orchestrator", "go"))

    assert result.status == "completed"
    outputs = [m["content"] for m in host.history["orchestrator"][-1] if m["role"] == "tool"]
    refusal = "{where}fork': a fork works in its caller's workspace, so isolation: worktree cannot apply; leave out "
    refusal += "isolation, or start a named agent with it; "
    assert [o.split("'", 1)[1].split("; ", 2)[:2] for o in outputs] == [
        refusal.format(where="").split("; ")[:2],
        refusal.format(where="tasks[0].").split("; ")[:2],
    ]
    assert all(o.startswith("Error: invalid subagent call: '") for o in outputs)
    assert list_worktrees() == [] and host.history.keys() == {"orchestrator"}


@pytest.mark.slow
def test_a_resumed_isolated_task_holds_its_worktree_until_it_is_done(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    host = scripted_host({"agents": {"worker": {"replies": [call("write", path="shared.txt", content="one\n"), "ok"]}}})
    result = go(make_runner(repo, host), "run", TaskSpec("worker", "edit", isolation="worktree"))
    assert result.worktree is not None and result.worktree.name is not None
    name = result.worktree.name
    assert not in_use(name)  # the run ended: nothing holds it
    [kept] = list_worktrees()
    apply_worktree(kept)  # applied: prune would remove it, were it not held
    runner = make_runner(repo, scripted_host({"agents": {"worker": {"replies": ["more"]}}}))

    async def resume_and_prune() -> tuple[bool, list[Any]]:
        async with runner:
            handle = await runner.reopen(result.run_id)
            held, pruned = in_use(name), prune_worktrees()
            await handle.ask("go on")
        return held, pruned

    held, pruned = asyncio.run(resume_and_prune())

    assert held and pruned == []
    assert not in_use(name)
    assert [w.name for w in prune_worktrees()] == [name]
