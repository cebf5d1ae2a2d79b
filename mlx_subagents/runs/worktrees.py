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

import fcntl
import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from ..errors import DamagedStateError, RequestError, SubagentError
from ..home import make_state_dir, state_home
from ..results import WorktreeResult
from ..userfiles import linked_part, load_file
from .git import git, git_bytes, git_ok, git_text, run_git

ISOLATIONS = ("none", "worktree")
BRANCH_PREFIX = "subagent/"
# Who the commits on a child's branch are by (the agent's name goes in the author's name).
AUTHOR_EMAIL = "subagent@mlx-subagents.invalid"
IN_PROGRESS = ("MERGE_HEAD", "CHERRY_PICK_HEAD", "REVERT_HEAD", "rebase-merge", "rebase-apply")
MAX_MANIFEST_BYTES = 1024 * 1024
Warn = Callable[[str], None]


def _warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr)


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


def check_isolation(folder: Path) -> Path:
    """The repository root an isolated task in `folder` branches from, or a one-line `RequestError`
    naming why it cannot be isolated (never a silent run in the shared tree)."""
    fix, plain = "run it without isolation: worktree, or", "run it without isolation: worktree"
    if shutil.which("git") is None:
        raise RequestError(f"isolation: worktree needs git, which is not on PATH; install git or {plain}")
    done = run_git(folder, "rev-parse", "--show-toplevel")
    if done.returncode != 0:
        raise RequestError(
            f"isolation: worktree needs a git repository, and {folder} is not inside one; {fix} git init"
        )
    repo = Path(done.stdout.decode().strip()).resolve()
    if not git_ok(repo, "rev-parse", "--verify", "-q", "HEAD"):
        raise RequestError(
            f"isolation: worktree needs a commit to branch from, and {repo} has none; {fix} commit first"
        )
    for marker in IN_PROGRESS:
        if Path(repo, git(repo, "rev-parse", "--git-path", marker).strip()).exists():
            raise RequestError(
                f"isolation: worktree cannot carry {repo}: a {marker.split('_')[0].split('-')[0].lower()} is in "
                f"progress; finish or abort it, or {plain}"
            )
    status = git(repo, "status", "--porcelain=v2", "--ignore-submodules=dirty")  # their commits, never entered
    changed = [line.split()[-1] for line in status.splitlines() if _dirty_submodule(line)]
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
    state carried as a first commit, its manifest written (and its lock held, `hold_worktree`) before
    it is returned."""
    repo = check_isolation(folder)
    name = f"{run_id}-{_slug(label)}"
    place = make_state_dir(worktrees_home(home), home=home) / name
    branch = BRANCH_PREFIX + name
    hold_worktree(name, home)
    try:
        git(repo, "worktree", "add", "-q", "-b", branch, str(place), "HEAD")
    except BaseException:
        release_worktree(name)
        raise
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
    diff = git_bytes(repo, "diff", "HEAD", "--binary")
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


def finish_worktree(worktree: Worktree, status: str, home: Path | None = None, warn: Warn = _warn) -> Worktree | None:
    """Commit what the child changed on its branch, record it and let go of its lock; None (worktree and
    branch removed) when it changed nothing. Nested repositories are left out, in one `warn` line; a
    commit git refuses is one `warn` line too, and the manifest still records how the task ended."""
    try:
        place = Path(worktree.path)
        task = worktree.task.strip()
        first = task.splitlines()[0][:72] if task else "its task"
        message = f"{worktree.agent} [{worktree.label}]: {first}\n\n{task}"
        try:
            if nested := _commit(place, f"{worktree.agent} (mlx-subagents)", message):
                warn(
                    f"worktree {worktree.name}: left out {', '.join(nested)}: a git repository of its own, which the "
                    f"tool's git does not enter; its files stay in {place}"
                )
        except RequestError as exc:
            warn(f"worktree {worktree.name}: its changes were not committed ({exc}); they stay in {place}")
            kept = Worktree(**{**asdict(worktree), "status": status})
            _save(kept, home)
            return kept
        files = tuple(p for p in git(place, "diff", "--name-only", "-z", worktree.base, "HEAD").split("\0") if p)
        if not files:
            remove_worktree(worktree, home)
            return None
        stat = git(place, "diff", "--shortstat", worktree.base, "HEAD").strip()
        kept = Worktree(**{**asdict(worktree), "status": status, "diffstat": stat, "files": files})
        _save(kept, home)
        return kept
    finally:
        release_worktree(worktree.name)


def worktree_result(kept: Worktree | None) -> WorktreeResult:
    """What a result says of a finished worktree: its branch and diffstat, or no changes (removed)."""
    if kept is None:
        return WorktreeResult()
    return WorktreeResult(
        branch=kept.branch, name=kept.name, path=kept.path, diffstat=kept.diffstat, files=list(kept.files)
    )


def reopen_worktree(worktree: Worktree, home: Path | None = None) -> Worktree:
    """A finished worktree made ready for the task's next generation (a message to a background task):
    held and marked running again, or made anew on the same branch name when it changed nothing and
    was removed."""
    if not Path(worktree.path).exists():
        folder = Path(worktree.repo) / worktree.folder
        return make_worktree(
            folder, run_id=worktree.run_id, label=worktree.label, agent=worktree.agent, task=worktree.task, home=home
        )
    hold_worktree(worktree.name, home)
    running = Worktree(**{**asdict(worktree), "status": "running"})
    _save(running, home)
    return running


def _commit(place: Path, author: str, message: str) -> list[str]:
    """Commit everything in `place` but its nested repositories (`nested_repositories`), which are never
    entered; the author and message cleaned of what git refuses (a NUL). The nested ones left out."""
    nested = nested_repositories(place)
    git(place, "add", "-A", "--", ".", *(f":(exclude,literal){path}" for path in nested))
    if git_ok(place, "diff", "--cached", "--quiet"):
        return nested
    who = {"user.name": git_text(author), "user.email": AUTHOR_EMAIL}
    git(place, "commit", "-q", "--no-verify", "-m", git_text(message), config=who)
    return nested


def nested_repositories(place: Path) -> list[str]:
    """The folders in `place` that are git repositories of their own (a `.git` inside, made by an agent
    or not): untracked ones, which git lists ending in `/` and would add as a gitlink after reading them
    (an empty one fails the commit), and tracked gitlinks. Found without entering them."""
    untracked = git(place, "ls-files", "--others", "--exclude-standard", "-z").split("\0")
    gitlinks = [e.split("\t", 1)[1] for e in git(place, "ls-files", "-s", "-z").split("\0") if e.startswith("160000 ")]
    return sorted({p.rstrip("/") for p in untracked if p.endswith("/")} | set(gitlinks))


def remove_worktree(worktree: Worktree, home: Path | None = None) -> None:
    """Remove a worktree, its branch, its manifest and its lock."""
    git(worktree.repo, "worktree", "remove", "--force", worktree.path, check=False)
    git(worktree.repo, "branch", "-D", worktree.branch, check=False)
    _manifest(worktree.name, home).unlink(missing_ok=True)
    release_worktree(worktree.name)
    _lock_path(worktree.name, home).unlink(missing_ok=True)


# --- who holds a worktree: a lock per worktree, held while a task runs in it ---------------------------

_held: dict[str, int] = {}  # this process's held worktrees: name -> the lock file's descriptor


def hold_worktree(name: str, home: Path | None = None) -> None:
    """Hold the worktree `name` for this process (a task runs in it): `prune` leaves it alone. An
    `flock`, so the OS lets go when the process ends, and a killed run never leaves it held."""
    if name in _held:
        return
    fd = os.open(_lock_path(name, home), os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise RequestError(
            f"the worktree {name} is in use by another process (a task running in it); wait until it ends"
        ) from None
    _held[name] = fd


def hold_worktree_of(folder: Path, home: Path | None = None) -> str | None:
    """Hold the kept worktree `folder` lies in (a resumed isolated task works there), so that `prune`
    leaves it alone meanwhile; its name, None when `folder` is in none."""
    folder = folder.resolve()
    for worktree in list_worktrees(home, warn=lambda _line: None):
        if folder.is_relative_to(Path(worktree.path)):
            hold_worktree(worktree.name, home)
            return worktree.name
    return None


def release_worktree(name: str) -> None:
    """Let go of this process's hold on a worktree (its task has ended)."""
    if (fd := _held.pop(name, None)) is not None:
        os.close(fd)


def in_use(name: str, home: Path | None = None) -> bool:
    """Whether a live process (this one or another) holds the worktree `name`."""
    if name in _held:
        return True
    try:
        fd = os.open(_lock_path(name, home), os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False  # no lock file: nothing has held it since it was made
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing lets go of the probe's own lock
    return False


# --- the kept worktrees: their manifests --------------------------------------------------------------


def list_worktrees(home: Path | None = None, warn: Warn = _warn) -> list[Worktree]:
    """Every kept worktree, oldest first (its manifest; one of an interrupted child says `running`). A
    manifest that cannot be read (damaged, not a regular file, not a manifest) is left out with one
    `warn` line naming it; nothing else stops."""
    folder = worktrees_home(home)
    if not folder.is_dir():
        return []
    kept = []
    for manifest in sorted(folder.glob("*.json")):
        try:
            kept.append(read_manifest(manifest))
        except SubagentError as exc:
            warn(f"skipped {exc}")
    return kept


def read_manifest(path: Path) -> Worktree:
    """One manifest, through the guarded reader; a `DamagedStateError` line naming it and the fix."""
    data = load_file(path, "json", "worktree manifest", DamagedStateError, MAX_MANIFEST_BYTES)
    names = {f.name: f for f in fields(Worktree)}
    fix = "remove it (and the worktree beside it, if any, with git worktree remove)"
    if not isinstance(data, dict):
        raise DamagedStateError(f"{path}: not a worktree manifest (a JSON {type(data).__name__}); {fix}")
    missing = [n for n, f in names.items() if f.default is MISSING and f.default_factory is MISSING and n not in data]
    wrong = [k for k, v in data.items() if k in names and k != "files" and not isinstance(v, str)]
    files = data.get("files", [])
    if missing or wrong or not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        problem = f"missing {', '.join(missing)}" if missing else f"not text: {', '.join(wrong) or 'files'}"
        raise DamagedStateError(f"{path}: a damaged worktree manifest ({problem}); {fix}")
    return Worktree(**{k: v for k, v in data.items() if k in names and k != "files"}, files=tuple(files))


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
    files, when the workspace changed them since the child started, when a path goes through a
    symlink in the workspace (git's fallback would write where it points), or when they do not apply."""
    repo = Path(worktree.repo)
    _refresh(worktree)
    worktree = Worktree(**{**asdict(worktree), "files": _changed(worktree)})
    if linked := {f: link for f in worktree.files if (link := linked_part(repo, f)) is not None}:
        shown = ", ".join(f"{f} (through {link})" for f, link in linked.items())
        raise RequestError(
            f"cannot apply {worktree.branch}: {shown} is a symlink in the workspace, and a change through it would "
            "land outside; remove or replace the link there, or merge the branch yourself"
        )
    changed = [f for f in worktree.files if _content(repo, f) != _at(repo, worktree.base, f)]
    if changed:
        raise RequestError(
            f"cannot apply {worktree.branch}: the workspace has changed {', '.join(changed)} since the child started; "
            "commit or undo those changes there, or merge the branch yourself"
        )
    patch = git_bytes(repo, "diff", "--binary", worktree.base, worktree.branch)
    if run_git(repo, "apply", "--3way", "--binary", "-", input=patch).returncode != 0:
        raise RequestError(f"cannot apply {worktree.branch}: it conflicts in {', '.join(worktree.files)}")
    return list(worktree.files)


def prune_worktrees(home: Path | None = None, warn: Warn = _warn) -> list[Worktree]:
    """Remove the kept worktrees no live process holds (`in_use`) whose branch is merged into the
    repository's HEAD, applied (the workspace holds its files as the branch does), or abandoned (its
    folder is gone); then `git worktree prune` in each repository. The ones removed; each one held is
    one `warn` line."""
    removed, repos = [], set()
    for worktree in list_worktrees(home, warn):
        repos.add(worktree.repo)
        if in_use(worktree.name, home):
            warn(f"kept {worktree.name}: a task is still running in it (prune it once that task ends)")
            continue
        gone = not Path(worktree.path).exists() or not Path(worktree.repo).exists()
        if gone or _merged(worktree) or _applied(worktree):
            remove_worktree(worktree, home) if Path(worktree.repo).exists() else _manifest(worktree.name, home).unlink()
            removed.append(worktree)
    for repo in repos:
        if Path(repo).exists():
            git(repo, "worktree", "prune", check=False)
    return removed


def _merged(worktree: Worktree) -> bool:
    return git_ok(worktree.repo, "merge-base", "--is-ancestor", worktree.branch, "HEAD")


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
    done = run_git(repo, "show", f"{commit}:{path}")
    return done.stdout if done.returncode == 0 else None


def _slug(label: str) -> str:
    """A label as a branch and folder name: `orchestrator > worker#2` -> `orchestrator-worker-2`."""
    return re.sub(r"[^A-Za-z0-9._]+", "-", label).strip("-.") or "task"


def _manifest(name: str, home: Path | None) -> Path:
    return worktrees_home(home) / f"{name}.json"


def _lock_path(name: str, home: Path | None) -> Path:
    return worktrees_home(home) / f"{name}.lock"


def _save(worktree: Worktree, home: Path | None) -> None:
    path = _manifest(worktree.name, home)
    path.with_suffix(".tmp").write_text(json.dumps({**asdict(worktree), "files": list(worktree.files)}, indent=1))
    path.with_suffix(".tmp").replace(path)
