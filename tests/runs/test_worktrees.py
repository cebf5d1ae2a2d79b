"""Isolated writers (`isolation: worktree`): each in a git worktree of its own, on a branch from the
parent's HEAD with its uncommitted state; the changes come back as a branch that `apply` brings in."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.errors import RequestError
from mlx_subagents.runs.tasks import TaskSpec
from mlx_subagents.runs.worktrees import apply_worktree, find_worktree, list_worktrees, worktrees_home
from mlx_subagents.tools.delegation import delegation_schema
from tests.helpers import call, go, make_runner, needs_sandbox, scripted_host, spawn_cli, write_agent

# Writes when it started and ended (overlapping runs prove they did not take turns), the parent's
# uncommitted state as it sees it, and its own folder's name into the shared file.
STAMPED = (
    "date +%s.%N > stamps.txt; cat notes.txt new.txt >> seen.txt; sleep 1; "
    "basename $(git rev-parse --show-toplevel) > shared.txt; date +%s.%N >> stamps.txt"
)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def make_repo(path: Path) -> Path:
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    (path / "shared.txt").write_text("original\n")
    (path / "notes.txt").write_text("committed\n")
    git(path, "add", "-A")
    git(path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    return path


@pytest.mark.slow
def test_two_isolated_workers_write_one_file_at_once_and_only_the_first_applies(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    (repo / "notes.txt").write_text("uncommitted edit\n")  # tracked change, not committed
    (repo / "new.txt").write_text("untracked file\n")
    (repo / ".gitignore").write_text("ignored.txt\n")
    (repo / "ignored.txt").write_text("never carried\n")
    host = scripted_host({"agents": {"worker": {"replies": [call("bash", command=STAMPED), {"content": "done"}]}}})
    tasks = [TaskSpec("worker", "edit shared.txt", label=n, isolation="worktree") for n in ("a", "b")]

    outcome = go(make_runner(repo, host), "parallel", tasks)

    assert [r.status for r in outcome.results] == ["completed", "completed"]
    trees = [r.worktree for r in outcome.results]
    assert [t.branch for t in trees] == [f"subagent/{outcome.run_id}-a", f"subagent/{outcome.run_id}-b"]
    assert [t.diffstat for t in trees] == ["3 files changed, 5 insertions(+), 1 deletion(-)"] * 2
    assert all(Path(t.path).parent == worktrees_home() for t in trees)
    starts, ends = zip(*(map(float, git(repo, "show", f"{t.branch}:stamps.txt").split()) for t in trees))
    assert max(starts) < min(ends), "the isolated writers took turns"
    for t in trees:  # each saw the parent's uncommitted state, and nothing ignored
        assert git(repo, "show", f"{t.branch}:seen.txt") == "uncommitted edit\nuntracked file\n"
        assert git(repo, "show", f"{t.branch}:shared.txt") == f"{Path(t.path).name}\n"
        assert git(repo, "log", "-1", "--format=%an|%s", t.branch) == "worker (mlx-subagents)|worker [" + (
            f"{t.name.rsplit('-', 1)[-1]}]: edit shared.txt\n"
        )
        assert not (Path(t.path) / "ignored.txt").exists()
    assert (repo / "shared.txt").read_text() == "original\n"  # untouched until apply
    assert git(repo, "status", "--porcelain") == " M notes.txt\n?? .gitignore\n?? new.txt\n"

    assert apply_worktree(find_worktree(trees[0].name)) == ["seen.txt", "shared.txt", "stamps.txt"]
    assert (repo / "shared.txt").read_text() == f"{Path(trees[0].path).name}\n"
    with pytest.raises(RequestError) as refused:
        apply_worktree(find_worktree(trees[1].branch))
    assert str(refused.value) == (
        f"cannot apply {trees[1].branch}: the workspace has changed seen.txt, shared.txt, stamps.txt since the "
        "child started; commit or undo those changes there, or merge the branch yourself"
    )
    assert [w.name for w in list_worktrees()] == [t.name for t in trees]


def test_an_unchanged_child_leaves_nothing_and_cannot_reach_out_of_its_worktree(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    (tmp_path / "secret.txt").write_text("outside\n")
    (repo / "out").symlink_to(tmp_path / "secret.txt")  # an untracked symlink, carried as it is
    reads = [call("read", path=p) for p in ("../repo/notes.txt", str(repo / "notes.txt"), "out")]
    host = scripted_host({"agents": {"worker": {"replies": [*reads, {"content": "nothing to change"}]}}})

    result = go(make_runner(repo, host), "run", TaskSpec("worker", "look", isolation="worktree"))

    assert result.status == "completed"
    assert result.worktree is not None and result.worktree.branch is None
    assert result.worktree.describe("worker") == "[worker: no changes in its worktree; removed]"
    tree = next(iter(host.history.values()))[-1]
    errors = [m["content"] for m in tree if m["role"] == "tool"]
    assert all("is outside the workspace" in e and "/worktrees/" in e for e in errors), errors
    assert "(it is a symlink to" in errors[2]
    assert git(repo, "worktree", "list").count("\n") == 1
    assert git(repo, "branch", "--list", "subagent/*") == ""
    assert list_worktrees() == [] and not any(worktrees_home().iterdir())


def test_isolation_that_cannot_be_had_is_one_line_and_nothing_runs(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    host = scripted_host([{"content": "never"}])

    with pytest.raises(RequestError) as not_a_repo:
        go(make_runner(plain, host), "run", TaskSpec("worker", "x", isolation="worktree"))
    repo = make_repo(tmp_path / "repo")
    git(repo, "checkout", "-q", "-b", "other")
    (repo / "shared.txt").write_text("other\n")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "other")
    git(repo, "checkout", "-q", "main")
    (repo / "shared.txt").write_text("main\n")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "main")
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "merge", "-q", "other"],
        capture_output=True,
    )
    with pytest.raises(RequestError) as merging:
        go(make_runner(repo, host), "run", TaskSpec("worker", "x", isolation="worktree"))

    assert str(not_a_repo.value) == (
        f"isolation: worktree needs a git repository, and {plain} is not inside one; run it without isolation: "
        "worktree, or git init"
    )
    assert str(merging.value) == (
        f"isolation: worktree cannot carry {repo}: a merge is in progress; finish or abort it, or run it without "
        "isolation: worktree"
    )
    assert host.history == {} and list_worktrees() == []


@needs_sandbox  # a project agent's bash: sandboxed
def test_the_call_site_wins_over_the_agent_file_and_the_parent_reads_the_branch(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    write_agent(repo, "fixer", "[bash]", front="isolation: worktree\n")
    write_agent(repo, "lead", "[subagent]", front="agents: [fixer!]\n")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "agent")
    fix = call("bash", command="echo fixed > shared.txt")
    delegations = [
        call("subagent", agent="fixer", task="fix it", label="own"),  # the file's isolation
        call("subagent", tasks=[{"agent": "fixer", "task": "fix it", "label": "shared", "isolation": "none"}]),
    ]
    script = {
        "agents": {
            "lead": {"replies": [*delegations, {"content": "all done"}]},
            "fixer": {"replies": [fix, {"content": "fixed"}, fix, {"content": "fixed"}]},
        }
    }
    host = scripted_host(script)

    result = go(make_runner(repo, host, assume_yes=True), "run", TaskSpec("lead", "fix"))

    assert result.status == "completed"
    messages = host.history["lead"][-1]
    first, second = [m["content"] for m in messages if m["role"] == "tool"]
    kept = list_worktrees()
    assert len(kept) == 1 and kept[0].label == "lead > own"
    assert first.endswith(
        f"\n[own: changes on branch {kept[0].branch} (1 file changed, 1 insertion(+), 1 deletion(-)); apply with: "
        f"subagent apply {kept[0].name}]"
    )
    assert "worktree" not in second and "subagent/" not in second
    assert (repo / "shared.txt").read_text() == "fixed\n"  # `isolation: none` at the call site: the shared tree
    assert git(repo, "show", f"{kept[0].branch}:shared.txt") == "fixed\n"


def test_the_cli_lists_shows_applies_and_prunes_what_isolated_tasks_left(
    tmp_path: Path, run_cli: Any, write_script: Any
) -> None:
    repo = make_repo(tmp_path / "repo")
    edit = {"replies": [call("bash", command="echo $PWD > shared.txt"), {"content": "edited"}]}
    model = write_script({"agents": {"worker": {"replies": edit["replies"] * 2}}})
    tasks = ["-t", "worker", "edit", "-t", "worker", "edit"]

    code, out, _ = run_cli("parallel", *tasks, "--isolation", "worktree", "--json", "-m", model, "-C", str(repo))
    assert code == 0
    data = json.loads(out)
    names = [r["worktree"]["name"] for r in data["results"]]
    assert names == [f"{data['run_id']}-worker-1", f"{data['run_id']}-worker-2"]

    code, out, _ = run_cli("worktrees", "--json")
    listed = json.loads(out)["worktrees"]
    assert [(w["name"], w["status"], w["files"], w["repo"]) for w in listed] == [
        (n, "completed", ["shared.txt"], str(repo.resolve())) for n in names
    ]
    code, out, _ = run_cli("worktrees")
    assert out.splitlines() == [
        f"{n}  completed subagent/{n}  1 file changed, 1 insertion(+), 1 deletion(-)  {label} (worker)  "
        f"{repo.resolve()}"
        for n, label in zip(names, ("worker-1", "worker-2"))
    ]
    code, out, _ = run_cli("show", "last")
    assert f"apply with: subagent apply {names[0]}" in out and f"apply with: subagent apply {names[1]}" in out
    assert [w["name"] for w in json.loads(run_cli("show", "last", "--json")[1])["worktrees"]] == names

    assert run_cli("apply", f"subagent/{names[0]}") == (
        0,
        "shared.txt\n",
        f"applied subagent/{names[0]} to {repo.resolve()}\nremove its worktree and branch with: subagent worktrees prune\n",
    )
    assert (repo / "shared.txt").read_text() == f"{listed[0]['path']}\n"
    code, out, err = run_cli("apply", names[1])
    assert (code, out) == (2, "")
    assert err == (
        f"error: cannot apply subagent/{names[1]}: the workspace has changed shared.txt since the child started; "
        "commit or undo those changes there, or merge the branch yourself\n"
    )
    assert (
        run_cli("apply", "nothing")[2]
        == f"error: no kept worktree 'nothing'; kept: {', '.join(names)} (see subagent worktrees)\n"
    )

    assert run_cli("worktrees", "prune") == (0, f"removed {names[0]} (subagent/{names[0]})\n", "")
    assert [w.name for w in list_worktrees()] == names[1:]
    assert git(repo, "branch", "--format=%(refname:short)", "--list", "subagent/*").split() == [f"subagent/{names[1]}"]
    assert git(repo, "worktree", "list").count("\n") == 2


@needs_sandbox  # a project agent's bash: sandboxed
def test_a_background_isolated_task_works_in_its_worktree_and_its_output_names_the_branch(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    write_agent(repo, "fixer", "[bash]")
    write_agent(repo, "lead", "[subagent]", front="agents: [fixer!]\n")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "agents")
    start = call("subagent", agent="fixer", task="fix it", background=True, isolation="worktree")
    wait = call("task_output", id="fixer#1", wait=10)
    script = {
        "agents": {
            "lead": {"replies": [start, wait, call("task_send", id="fixer#1", message="look again"), wait, "done"]},
            "fixer": {"replies": [call("bash", command="echo fixed > shared.txt"), "fixed", "nothing more"]},
        }
    }
    host = scripted_host(script)

    result = go(make_runner(repo, host, assume_yes=True), "run", TaskSpec("lead", "fix"))

    assert result.status == "completed"
    [kept] = list_worktrees()
    assert (kept.label, kept.status, kept.files) == ("lead > fixer#1", "completed", ("shared.txt",))
    outputs = [m["content"] for m in host.history["lead"][-1] if m["role"] == "tool"]
    line = (
        f"[fixer#1: changes on branch {kept.branch} (1 file changed, 1 insertion(+), 1 deletion(-)); apply with: "
        f"subagent apply {kept.name}]"
    )
    assert outputs[1] == f"fixer#1 completed\n{line}\n\nfixed"
    assert outputs[3] == f"fixer#1 completed\n{line}\n\nnothing more"  # a second generation, in the same worktree
    assert (repo / "shared.txt").read_text() == "original\n"  # the shared tree untouched until apply
    assert git(repo, "show", f"{kept.branch}:shared.txt") == "fixed\n"
    assert (
        git(repo, "log", "-1", "--format=%an|%s", kept.branch)
        == "fixer (mlx-subagents)|fixer [lead > fixer#1]: fix it\n"
    )


@pytest.mark.slow
@pytest.mark.process
def test_sigterm_commits_what_the_child_did_on_its_branch_and_keeps_the_worktree_listed(
    tmp_path: Path, run_cli: Any, write_script: Any
) -> None:
    repo = make_repo(tmp_path / "repo")
    ready = tmp_path / "ready"
    slow = f"echo half done > shared.txt; touch {ready}; exec sleep 30"
    model = write_script({"agents": {"worker": {"replies": [call("bash", command=slow), "never reached"]}}})
    proc = spawn_cli("run", "worker", "edit", "--isolation", "worktree", "-m", model, "-C", str(repo))
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the child never started its command"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    assert proc.returncode == 143, err
    [kept] = list_worktrees()
    line = (
        f"[worker: changes on branch {kept.branch} (1 file changed, 1 insertion(+), 1 deletion(-)); apply with: "
        f"subagent apply {kept.name}]"
    )
    assert line in err.splitlines()
    assert (kept.status, kept.files) == ("aborted", ("shared.txt",))
    assert git(repo, "show", f"{kept.branch}:shared.txt") == "half done\n"
    assert git(Path(kept.path), "status", "--porcelain") == ""  # all of it committed
    assert (repo / "shared.txt").read_text() == "original\n"
    code, out, _ = run_cli("worktrees", "--json")
    assert [w["name"] for w in json.loads(out)["worktrees"]] == [kept.name]


def test_isolation_is_offered_only_inside_a_git_repository() -> None:
    """Every field of the `subagent` schema costs a small model's context: `isolation` is there only
    where it can work."""
    with_it = delegation_schema(background=True, isolation=True)
    without = delegation_schema(background=True)
    assert "isolation" in with_it["properties"] and "isolation" in with_it["properties"]["tasks"]["items"]["properties"]
    assert "isolation" not in without["properties"]
    assert "isolation" not in without["properties"]["chain"]["items"]["properties"]
