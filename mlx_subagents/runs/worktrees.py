"""Isolated writers: each in a git worktree of its own, its changes kept on a branch until applied.

A task with `isolation: worktree` works in a new worktree of its workspace's repository, on the branch
`subagent/<run-id>-<label>` made from the parent's HEAD; the parent's uncommitted state (tracked
changes and untracked files that are not ignored) is carried over as a first commit on that branch, so
that the child sees what the parent sees and what comes back is the child's work alone. Worktrees live
under `$MLX_SUBAGENTS_HOME/worktrees/`, outside the workspace, each with a manifest beside it written
before the child starts: whatever ends the child (its answer, a timeout, SIGTERM), `subagent worktrees`
lists what is kept. When the child ends its changes are committed on its branch; no changes, and the
worktree and the branch are removed. `apply` brings a branch's changes into the workspace, refusing
(with the files) when the workspace changed them since or they do not apply.

Every check fails closed, in one line: no git, a workspace outside a repository, a repository with no
commit, a merge (rebase, cherry-pick, revert) in progress, submodules with changes. An isolated task
never runs in the shared tree.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import RequestError
from ..home import make_state_dir, state_home
from ..results import WorktreeResult

ISOLATIONS = ("none", "worktree")
BRANCH_PREFIX = "subagent/"
# Who the commits on a child's branch are by (the agent's name goes in the author's name).
AUTHOR_EMAIL = "subagent@mlx-subagents.invalid"
IN_PROGRESS = ("MERGE_HEAD", "CHERRY_PICK_HEAD", "REVERT_HEAD", "rebase-merge", "rebase-apply")


@dataclass(frozen=True)
class Worktree:
    """One kept worktree, as its manifest says.

    Args:
        name: `<run-id>-<label>`, its folder's and its branch's name.
        repo: the parent's repository root; `folder`: the child's workspace relative to it.
        base: the commit the child started from (the parent's HEAD, plus the carried changes).
    """

    name: str
    path: str
    branch: str
    repo: str
    folder: str
    base: str
    agent: str
    label: str
    task: str
    run_id: str
    status: str = "running"
    diffstat: str = ""
    files: tuple[str, ...] = ()

    @property
    def workspace(self) -> Path:
        """The child's workspace: the parent's folder, at the same place inside the worktree."""
        return Path(self.path) / self.folder


def worktrees_home(home: Path | None = None) -> Path:
    """Where worktrees and their manifests are kept: `$MLX_SUBAGENTS_HOME/worktrees/`."""
    return (home or state_home()) / "worktrees"


def git(repo: Path | str, *args: str, input: bytes | None = None, check: bool = True) -> str:
    """Run git in `repo`; a failure is a `RequestError` with git's own first line."""
    done = subprocess.run(["git", "-C", str(repo), *args], input=input, capture_output=True)
    if check and done.returncode != 0:
        why = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines()
        raise RequestError(f"git {args[0]} failed in {repo}: {why[0] if why else f'exit {done.returncode}'}")
    return done.stdout.decode(errors="replace")


def check_isolation(folder: Path) -> Path:
    """The repository root an isolated task in `folder` branches from, or a one-line `RequestError`
    naming why it cannot be isolated (never a silent run in the shared tree)."""
    fix, plain = "run it without isolation: worktree, or", "run it without isolation: worktree"
    if shutil.which("git") is None:
        raise RequestError(f"isolation: worktree needs git, which is not on PATH; install git or {plain}")
    done = subprocess.run(["git", "-C", str(folder), "rev-parse", "--show-toplevel"], capture_output=True)
    if done.returncode != 0:
        raise RequestError(
            f"isolation: worktree needs a git repository, and {folder} is not inside one; {fix} git init"
        )
    repo = Path(done.stdout.decode().strip()).resolve()
    if subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "-q", "HEAD"], capture_output=True).returncode:
        raise RequestError(
            f"isolation: worktree needs a commit to branch from, and {repo} has none; {fix} commit first"
        )
    for marker in IN_PROGRESS:
        if Path(repo, git(repo, "rev-parse", "--git-path", marker).strip()).exists():
            raise RequestError(
                f"isolation: worktree cannot carry {repo}: a {marker.split('_')[0].split('-')[0].lower()} is in "
                f"progress; finish or abort it, or {plain}"
            )
    changed = [
        line.split()[-1] for line in git(repo, "status", "--porcelain=v2").splitlines() if _dirty_submodule(line)
    ]
    if changed:
        raise RequestError(
            f"isolation: worktree cannot carry {repo}: submodule(s) with changes ({', '.join(changed)}); commit them "
            f"in the submodule, or {plain}"
        )
    return repo


def _dirty_submodule(line: str) -> bool:
    parts = line.split()
    return line[:1] in "12" and len(parts) > 2 and parts[2].startswith("S") and parts[2] != "S..."


def make_worktree(
    folder: Path, *, run_id: str, label: str, agent: str, task: str, home: Path | None = None
) -> Worktree:
    """A new worktree for a child working in `folder`: its branch from HEAD, the parent's uncommitted
    state carried as a first commit, its manifest written before it is returned."""
    repo = check_isolation(folder)
    name = f"{run_id}-{_slug(label)}"
    place = make_state_dir(worktrees_home(home), home=home) / name
    branch = BRANCH_PREFIX + name
    git(repo, "worktree", "add", "-q", "-b", branch, str(place), "HEAD")
    worktree = Worktree(
        name=name,
        path=str(place.resolve()),
        branch=branch,
        repo=str(repo),
        folder=folder.resolve().relative_to(repo).as_posix(),
        base=git(repo, "rev-parse", "HEAD").strip(),
        agent=agent,
        label=label,
        task=task,
        run_id=run_id,
    )
    _save(worktree, home)
    try:
        worktree = _carry(repo, worktree, home)
    except BaseException:
        remove_worktree(worktree, home)
        raise
    return worktree


def _carry(repo: Path, worktree: Worktree, home: Path | None) -> Worktree:
    """Carry the parent's tracked changes and untracked (not ignored) files into the worktree, and
    commit them there as the child's base."""
    diff = subprocess.run(["git", "-C", str(repo), "diff", "HEAD", "--binary"], capture_output=True, check=True).stdout
    untracked = [p for p in git(repo, "ls-files", "--others", "--exclude-standard", "-z").split("\0") if p]
    if not diff and not untracked:
        return worktree
    place = Path(worktree.path)
    if diff:
        git(place, "apply", "--whitespace=nowarn", "--binary", "-", input=diff)
    for path in untracked:
        source, target = repo / path, place / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(source.readlink())
        elif source.is_file():
            shutil.copy2(source, target)
    _commit(place, "mlx-subagents", "carried: the parent's uncommitted changes")
    carried = Worktree(**{**asdict(worktree), "base": git(place, "rev-parse", "HEAD").strip()})
    _save(carried, home)
    return carried


def finish_worktree(worktree: Worktree, status: str, home: Path | None = None) -> Worktree | None:
    """Commit what the child changed on its branch and record it; None (worktree and branch removed)
    when it changed nothing."""
    place = Path(worktree.path)
    first = worktree.task.strip().splitlines()[0][:72] if worktree.task.strip() else "its task"
    _commit(
        place, f"{worktree.agent} (mlx-subagents)", f"{worktree.agent} [{worktree.label}]: {first}\n\n{worktree.task}"
    )
    files = tuple(p for p in git(place, "diff", "--name-only", "-z", worktree.base, "HEAD").split("\0") if p)
    if not files:
        remove_worktree(worktree, home)
        return None
    stat = git(place, "diff", "--shortstat", worktree.base, "HEAD").strip()
    kept = Worktree(**{**asdict(worktree), "status": status, "diffstat": stat, "files": files})
    _save(kept, home)
    return kept


def worktree_result(kept: Worktree | None) -> WorktreeResult:
    """What a result says of a finished worktree: its branch and diffstat, or no changes (removed)."""
    if kept is None:
        return WorktreeResult()
    return WorktreeResult(
        branch=kept.branch, name=kept.name, path=kept.path, diffstat=kept.diffstat, files=list(kept.files)
    )


def reopen_worktree(worktree: Worktree, home: Path | None = None) -> Worktree:
    """A finished worktree made ready for the task's next generation (a message to a background task):
    marked running again, or made anew on the same branch name when it changed nothing and was removed."""
    if not Path(worktree.path).exists():
        folder = Path(worktree.repo) / worktree.folder
        return make_worktree(
            folder, run_id=worktree.run_id, label=worktree.label, agent=worktree.agent, task=worktree.task, home=home
        )
    running = Worktree(**{**asdict(worktree), "status": "running"})
    _save(running, home)
    return running


def _commit(place: Path, author: str, message: str) -> None:
    git(place, "add", "-A")
    if not git(place, "status", "--porcelain").strip():
        return
    who = ["-c", f"user.name={author}", "-c", f"user.email={AUTHOR_EMAIL}", "-c", "commit.gpgsign=false"]
    git(place, *who, "commit", "-q", "--no-verify", "-m", message)


def remove_worktree(worktree: Worktree, home: Path | None = None) -> None:
    """Remove a worktree, its branch and its manifest."""
    git(worktree.repo, "worktree", "remove", "--force", worktree.path, check=False)
    git(worktree.repo, "branch", "-D", worktree.branch, check=False)
    _manifest(worktree.name, home).unlink(missing_ok=True)


def list_worktrees(home: Path | None = None) -> list[Worktree]:
    """Every kept worktree, oldest first (its manifest; one of an interrupted child says `running`)."""
    folder = worktrees_home(home)
    if not folder.is_dir():
        return []
    kept = []
    for manifest in sorted(folder.glob("*.json")):
        data = json.loads(manifest.read_text())
        kept.append(Worktree(**{**data, "files": tuple(data.get("files", ()))}))
    return kept


def find_worktree(ref: str, home: Path | None = None) -> Worktree:
    """The kept worktree `ref` names: its name, branch, run id or label (when one matches)."""
    ref = ref.strip()
    kept = list_worktrees(home)
    matches = [w for w in kept if ref in (w.name, w.branch, w.run_id, w.label, w.label.split(" > ")[-1])]
    if len(matches) == 1:
        return matches[0]
    names = ", ".join(w.name for w in (matches or kept)) or "none"
    if matches:
        raise RequestError(f"'{ref}' names several kept worktrees ({names}); give one of their names")
    raise RequestError(f"no kept worktree '{ref}'; kept: {names} (see subagent worktrees)")


def apply_worktree(worktree: Worktree) -> list[str]:
    """Bring a child's changes into its parent's workspace; the files changed. Refuses, naming the
    files, when the workspace changed them since the child started, or when they do not apply."""
    repo = Path(worktree.repo)
    _refresh(worktree)
    worktree = Worktree(**{**asdict(worktree), "files": _changed(worktree)})
    changed = [f for f in worktree.files if _content(repo, f) != _at(repo, worktree.base, f)]
    if changed:
        raise RequestError(
            f"cannot apply {worktree.branch}: the workspace has changed {', '.join(changed)} since the child started; "
            "commit or undo those changes there, or merge the branch yourself"
        )
    patch = subprocess.run(
        ["git", "-C", str(repo), "diff", "--binary", worktree.base, worktree.branch], capture_output=True, check=True
    ).stdout
    done = subprocess.run(
        ["git", "-C", str(repo), "apply", "--3way", "--binary", "-"], input=patch, capture_output=True
    )
    if done.returncode != 0:
        raise RequestError(f"cannot apply {worktree.branch}: it conflicts in {', '.join(worktree.files)}")
    return list(worktree.files)


def prune_worktrees(home: Path | None = None) -> list[Worktree]:
    """Remove the kept worktrees whose branch is merged into the repository's HEAD, applied (the
    workspace holds its files as the branch does), or abandoned (its folder is gone); then
    `git worktree prune` in each repository. The ones removed."""
    removed, repos = [], set()
    for worktree in list_worktrees(home):
        repos.add(worktree.repo)
        gone = not Path(worktree.path).exists() or not Path(worktree.repo).exists()
        if gone or _merged(worktree) or _applied(worktree):
            remove_worktree(worktree, home) if Path(worktree.repo).exists() else _manifest(worktree.name, home).unlink()
            removed.append(worktree)
    for repo in repos:
        if Path(repo).exists():
            git(repo, "worktree", "prune", check=False)
    return removed


def _merged(worktree: Worktree) -> bool:
    done = subprocess.run(["git", "-C", worktree.repo, "merge-base", "--is-ancestor", worktree.branch, "HEAD"])
    return done.returncode == 0


def _applied(worktree: Worktree) -> bool:
    files = _changed(worktree)
    return bool(files) and all(
        _content(Path(worktree.repo), f) == _at(worktree.repo, worktree.branch, f) for f in files
    )


def _refresh(worktree: Worktree) -> None:
    """Commit what an interrupted child left uncommitted, so that `apply` brings all of it."""
    if Path(worktree.path).exists() and worktree.status == "running":
        _commit(
            Path(worktree.path),
            f"{worktree.agent} (mlx-subagents)",
            f"{worktree.agent} [{worktree.label}]: interrupted",
        )


def _changed(worktree: Worktree) -> tuple[str, ...]:
    return tuple(
        p for p in git(worktree.repo, "diff", "--name-only", "-z", worktree.base, worktree.branch).split("\0") if p
    )


def _content(repo: Path, path: str) -> bytes | None:
    file = repo / path
    return file.read_bytes() if file.is_file() and not file.is_symlink() else None


def _at(repo: Path | str, commit: str, path: str) -> bytes | None:
    done = subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{path}"], capture_output=True)
    return done.stdout if done.returncode == 0 else None


def _slug(label: str) -> str:
    """A label as a branch and folder name: `orchestrator > worker#2` -> `orchestrator-worker-2`."""
    return re.sub(r"[^A-Za-z0-9._]+", "-", label).strip("-.") or "task"


def _manifest(name: str, home: Path | None) -> Path:
    return worktrees_home(home) / f"{name}.json"


def _save(worktree: Worktree, home: Path | None) -> None:
    path = _manifest(worktree.name, home)
    path.with_suffix(".tmp").write_text(json.dumps({**asdict(worktree), "files": list(worktree.files)}, indent=1))
    path.with_suffix(".tmp").replace(path)
