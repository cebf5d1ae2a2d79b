"""The tool's own git: every git command the runner runs (worktrees, their commits, `apply`, `prune`).

A sandboxed agent writes in its workspace, and git reads programs to run from a repository: hooks
(`.git/hooks/*`, `core.hooksPath`), `core.fsmonitor`, and `GIT_*` variables. None of that may run
later outside the sandbox, so every call here turns hooks and the file-system monitor off on its
command line (which wins over every config file) and runs without the environment's `GIT_*`; the
sandbox keeps `.git` read-only (`tools/sandbox.py`), so a repository's config cannot gain a filter or
an include either. What git records (commit messages, author names) is cleaned of what git refuses
(a NUL) or misreads (other control characters), so a task's text never makes a commit fail.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from ..errors import RequestError

# Command-line config wins over the system, global and repository files: no hook, no fsmonitor.
SAFE_CONFIG = ("-c", f"core.hooksPath={os.devnull}", "-c", "core.fsmonitor=false")
# Control characters but tab and newline: git stops at a NUL, and the rest garble logs and terminals.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def git_env() -> dict[str, str]:
    """This process's environment without `GIT_*` (`GIT_DIR`, `GIT_CONFIG_*` could point git elsewhere
    or turn hooks back on)."""
    return {key: value for key, value in os.environ.items() if not key.startswith("GIT_")}


def run_git(repo: Path | str, *args: str, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    """`git -C repo ARGS` with hooks and fsmonitor off and no `GIT_*` from the environment; its output
    captured, whatever its exit code."""
    command = ["git", *SAFE_CONFIG, "-C", str(repo), *args]
    stdin = subprocess.DEVNULL if input is None else None  # never the MCP server's protocol channel
    return subprocess.run(command, input=input, capture_output=True, env=git_env(), stdin=stdin)


def git(repo: Path | str, *args: str, input: bytes | None = None, check: bool = True) -> str:
    """`run_git`'s standard output as text; a failure (`check`) is a `RequestError` with git's own first line."""
    done = run_git(repo, *args, input=input)
    if check and done.returncode != 0:
        why = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines()
        raise RequestError(f"git {args[0]} failed in {repo}: {why[0] if why else f'exit {done.returncode}'}")
    return done.stdout.decode(errors="replace")


def git_bytes(repo: Path | str, *args: str, input: bytes | None = None) -> bytes:
    """`run_git`'s standard output as bytes (a binary diff); a failure is a `RequestError` as for `git`."""
    done = run_git(repo, *args, input=input)
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        raise RequestError(f"git {args[0]} failed in {repo}: {why[0] if why else f'exit {done.returncode}'}")
    return done.stdout


def git_ok(repo: Path | str, *args: str) -> bool:
    """Whether `git -C repo ARGS` exits 0 (a question: `merge-base --is-ancestor`, `rev-parse --verify`)."""
    return run_git(repo, *args).returncode == 0


def git_text(text: str) -> str:
    """`text` as git may record it: without NUL and the other control characters (tab and newline kept)."""
    return _CONTROL.sub("", text)
