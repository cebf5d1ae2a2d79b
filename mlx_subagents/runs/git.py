"""The tool's own git: every git command the runner runs (worktrees, their commits, `apply`, `prune`).

A sandboxed agent writes in its workspace, and git reads programs to run from the trees it works on:
hooks (`.git/hooks/*`, `core.hooksPath`), `core.fsmonitor`, and the drivers that attributes select
(`filter.*.clean`/`smudge`/`process`, `diff.*.textconv`/`command`, `merge.*.driver`) from a config
file and a `.gitattributes` the agent may have written (a repository it made where the workspace had
none, a nested one); `GIT_*` variables can point git elsewhere. None of that may run outside the
sandbox, so every command here runs with no configuration a tree supplies:

- `GIT_*` from the environment dropped, and the tool's own settings given as command-scope config
  (`GIT_CONFIG_COUNT`, which wins over every config file, also in the git processes git starts):
  hooks and the file-system monitor off, submodules never entered or recursed into, no automatic
  gc or maintenance, no signing, no pager;
- every driver any config file of that repository defines (read first with `git config --list`, which
  runs nothing) overridden with an empty command, which git runs as no driver: whatever attributes
  name, from whichever file, no filter, text conversion or merge driver runs;
- `diff`, `show` and `log` with `--no-ext-diff --no-textconv` (`diff.external` included).

Nested repositories are never entered: `worktrees.py` leaves them out of its commits. What git
records (commit messages, author names) is cleaned of what git refuses (a NUL) or misreads (other
control characters), so a task's text never makes a commit fail.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path

from ..errors import RequestError

# Command-scope config, which wins over the system, global and repository files.
SAFE_CONFIG = {
    "core.hooksPath": os.devnull,
    "core.fsmonitor": "false",
    "core.pager": "cat",
    "core.attributesFile": os.devnull,
    "diff.ignoreSubmodules": "all",
    "status.submoduleSummary": "false",
    "submodule.recurse": "false",
    "fetch.recurseSubmodules": "false",
    "commit.gpgSign": "false",
    "gc.auto": "0",
    "maintenance.auto": "false",
}
# A driver's command, by what selects it: an attribute names the driver, config says what it runs.
_DRIVER = re.compile(r"^(filter|diff|merge)\.(.+)\.(clean|smudge|process|textconv|command|driver)$", re.IGNORECASE)
_NO_EXTERNAL = ("--no-ext-diff", "--no-textconv")
_SHOWS_DIFFS = {"diff", "show", "log"}
# Control characters but tab and newline: git stops at a NUL, and the rest garble logs and terminals.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def git_env(config: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without `GIT_*` (`GIT_DIR`, `GIT_CONFIG_*` could point git elsewhere
    or turn hooks back on), and `config` (the tool's settings, then the caller's) as command-scope config."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("GIT_")}
    pairs = list({**SAFE_CONFIG, **(config or {})}.items())
    for i, (key, value) in enumerate(pairs):
        env[f"GIT_CONFIG_KEY_{i}"], env[f"GIT_CONFIG_VALUE_{i}"] = key, value
    env["GIT_CONFIG_COUNT"] = str(len(pairs))
    return env


def driver_overrides(repo: Path | str) -> dict[str, str]:
    """Every driver command the config of `repo` defines (any file, includes too), made empty: git runs
    no driver for an empty command. Reading config runs nothing."""
    done = subprocess.run(
        ["git", "-C", str(repo), "config", "--list", "-z", "--name-only"],
        capture_output=True,
        env=git_env(),
        stdin=subprocess.DEVNULL,
    )
    keys = done.stdout.decode(errors="surrogateescape").split("\0") if done.returncode == 0 else []
    overrides = {}
    for key in keys:
        if match := _DRIVER.match(key):
            overrides[key] = ""
            if match.group(1).lower() == "filter":
                overrides[f"filter.{match.group(2)}.required"] = "false"
    return overrides


def run_git(
    repo: Path | str, *args: str, input: bytes | None = None, config: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    """`git -C repo ARGS` with no configuration the tree supplies (the module's docstring) and `config`
    on top; its output captured, whatever its exit code."""
    extra = _NO_EXTERNAL if args and args[0] in _SHOWS_DIFFS else ()
    command = ["git", "--no-pager", "-C", str(repo), *args[:1], *extra, *args[1:]]
    stdin = subprocess.DEVNULL if input is None else None  # never the MCP server's protocol channel
    env = git_env({**driver_overrides(repo), **(config or {})})
    return subprocess.run(command, input=input, capture_output=True, env=env, stdin=stdin)


def git(
    repo: Path | str,
    *args: str,
    input: bytes | None = None,
    check: bool = True,
    config: Mapping[str, str] | None = None,
) -> str:
    """`run_git`'s standard output as text; a failure (`check`) is a `RequestError` with git's own first line."""
    done = run_git(repo, *args, input=input, config=config)
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
