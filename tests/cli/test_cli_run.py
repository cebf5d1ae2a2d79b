"""`subagent run / agents / doctor` as a user runs them: real subprocesses, real files, the
scripted model (`--model scripted:FILE`) or the tiny real model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlx_subagents.cli.doctor import grammar_line
from tests.helpers import REPO, alive, call

pytestmark = [pytest.mark.process, pytest.mark.usefixtures("preloaded_cli")]  # process: all but one doctor test

APP_PY = "import json\n\ndef load_config(path):\n    return json.load(open(path))\n"
SECRET = "hunter2-do-not-leak"
BUILTINS = ["orchestrator", "planner", "reviewer", "scout", "worker"]
JSON_FIELDS = {
    "agent",
    "task",
    "status",
    "output",
    "reasoning",
    "error",
    "usage",
    "model",
    "tool_mode",
    "stop_reason",
    "duration_s",
}
USAGE_FIELDS = {"input_tokens", "output_tokens", "cached_tokens", "context_tokens", "turns"}

# Documented in the README beside issue 3's fields: what resume and the multi-run modes need; and
# what a delegating task's sub-agents used (issue 26, item 11); an isolated task's branch (issue 30); the time
# waited behind other sessions' prefills (issue 40); the tokens drafted and kept (issue 67).
EXTRA_FIELDS = {"label", "step_id", "run_id", "transcript", "parsed", "children", "worktree"}
EXTRA_USAGE = {"compactions", "kv_bytes", "constrained_calls", "constrained_answers", "prefill_wait_s", "kv_bits"}
EXTRA_USAGE |= {"drafted_tokens", "accepted_tokens"}


# What `subagent run` imports before it runs: while `preloaded_cli` (conftest.py) holds it, `cli` runs each
# command in a fork of a process that imported them (tests/preloaded.py), not 1 s of CPU a command anew.
CLI_PRELOAD = [
    "mlx_subagents.cli", "mlx_subagents.cli.commands.run", "mlx_subagents.runs.runner", "mlx_subagents.runs.execution",
    "mlx_subagents.runs.prepare", "mlx_subagents.host.scripted",
]  # fmt: skip
CLI_PYTHON = [sys.executable]


def cli_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of `cli`'s commands: ours, this checkout on the path, no `$COLUMNS` nor default model."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    for name in ("MLX_SUBAGENTS_MODEL", "COLUMNS"):
        full_env.pop(name, None)
    return full_env


def cli(*args: str | Path, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`subagent ARGS...` in a process of its own, output to pipes as in CI: stdin is not a terminal
    and no `$COLUMNS`, so a long message must still come out as one line."""
    full_env = cli_env(env)
    return subprocess.run(
        [*CLI_PYTHON, "-m", "mlx_subagents.cli", *map(str, args)],
        cwd=REPO,
        env=full_env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    """A small project, and a sibling `outside/` holding a secret."""
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    (root / "src" / "app.py").write_text(APP_PY)
    (root / "README.md").write_text("# Demo\n")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text(f"password={SECRET}\n")
    return root


# -- subagent run ------------------------------------------------------------------------------


def test_run_json_prints_the_documented_object_and_shows_tool_calls(
    tmp_path: Path, ws: Path, write_script: Any
) -> None:
    answer = "Findings:\n- src/app.py:3-4 — load_config parses the config\n\nSummary: src/app.py."
    script = write_script(
        [
            call("bash", command="ls src"),
            call("ls", path="."),
            call("grep", pattern="load_config"),
            call("find", pattern="*.py"),
            call("read", path="src/app.py", offset=3, limit=2),
            call("read", path="src/app.py"),
            answer,
        ],
    )
    proc = cli("run", "scout", "where is the config parsed?", "--model", script, "--cwd", ws, "--json")

    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert {
        k: data[k] for k in ("agent", "task", "status", "output", "error", "model", "tool_mode", "stop_reason")
    } == {
        "agent": "scout",
        "task": "where is the config parsed?",
        "status": "completed",
        "output": answer,
        "error": None,
        "model": script,
        "tool_mode": "native",
        "stop_reason": "completed",
    }
    assert data["usage"]["turns"] == 7
    assert data["usage"]["input_tokens"] > data["usage"]["cached_tokens"] > 0
    assert data["usage"]["output_tokens"] > 0 and data["usage"]["context_tokens"] > 0
    assert isinstance(data["duration_s"], float) and 0 <= data["duration_s"] < 10
    assert JSON_FIELDS <= set(data) and USAGE_FIELDS <= set(data["usage"])
    # Progress goes to stderr, one label per tool call, in order; stdout holds only the JSON.
    assert proc.stderr.splitlines() == [
        "$ ls src",
        "ls .",
        'grep "load_config" .',
        "find *.py",
        "read src/app.py:3-4",
        "read src/app.py",
    ]
    assert set(data) == JSON_FIELDS | EXTRA_FIELDS and set(data["usage"]) == USAGE_FIELDS | EXTRA_USAGE


def test_run_refuses_paths_outside_the_workspace_and_leaks_nothing(tmp_path: Path, ws: Path, write_script: Any) -> None:
    secret = tmp_path / "outside" / "secret.txt"
    (ws / "link.txt").symlink_to(secret)
    script = write_script(
        [
            call("read", path="../outside/secret.txt"),
            call("read", path=str(secret)),
            call("read", path="link.txt"),
            call("grep", pattern="password", path=".."),
            "Findings: none\n\nSummary: nothing outside the workspace.",
        ],
    )
    proc = cli("run", "scout", "find the password", "--model", script, "--cwd", ws)

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "Findings: none\n\nSummary: nothing outside the workspace.\n"
    assert SECRET not in proc.stdout + proc.stderr
    root = ws.resolve()
    lines = proc.stderr.splitlines()
    assert lines[:8] == [
        line[:200]
        for line in [  # the display cuts a tool's error at 200 characters
            "read ../outside/secret.txt",
            f"Error: path '../outside/secret.txt' is outside the workspace {root}; use a path inside it",
            f"read {secret}",
            f"Error: path '{secret}' is outside the workspace {root}; use a path inside it",
            "read link.txt",
            f"Error: path 'link.txt' is outside the workspace {root} (it is a symlink to {secret.resolve()}); "
            "use a path inside it",
            'grep "password" ..',
            f"Error: path '..' is outside the workspace {root}; use a path inside it",
        ]
    ]
    usage = [line for line in lines[8:] if line.startswith("scout: completed (completed) in ")]
    assert len(usage) == 1 and ", 5 turns, " in usage[0]


@pytest.mark.slow
def test_bash_timeout_kills_the_whole_process_tree(tmp_path: Path, ws: Path, write_script: Any) -> None:
    command = "sleep 300 & echo $! > pids.txt; echo $$ >> pids.txt; sleep 300"
    script = write_script(
        [
            call("bash", command=command, timeout=1),
            call("bash", command="cat pids.txt | wc -l"),
            "The command timed out.",
        ],
    )
    tic = time.monotonic()
    proc = cli("run", "worker", "run the slow command", "--model", script, "--cwd", ws, timeout=120)
    elapsed = time.monotonic() - tic

    assert proc.returncode == 0, proc.stderr
    assert elapsed < 100  # killed at its 1 s timeout, not after the 300 s sleeps (slack for a loaded start)
    pids = [int(line) for line in (ws / "pids.txt").read_text().split()]
    assert len(pids) == 2  # the background sleep and bash itself
    assert [pid for pid in pids if alive(pid)] == []
    lines = proc.stderr.splitlines()
    assert lines[:2] == [f"$ {command}", "Error: command timed out after 1s; its process group was killed"]
    assert lines[2] == "$ cat pids.txt | wc -l"
    assert proc.stdout == "The command timed out.\n"


@pytest.mark.slow
def test_ambiguous_edit_leaves_the_file_alone_and_the_run_goes_on(tmp_path: Path, ws: Path, write_script: Any) -> None:
    original = "def a():\n    return 1\n\ndef b():\n    return 1\n"
    (ws / "src" / "twice.py").write_bytes(original.encode())
    script = write_script(
        [
            call("edit", path="src/twice.py", old_text="    return 1\n", new_text="    return 2\n"),
            call("edit", path="src/twice.py", old_text="def b():\n    return 1\n", new_text="def b():\n    return 2\n"),
            "Changed b() in src/twice.py to return 2.",
        ],
    )
    proc = cli("run", "worker", "make b return 2", "--model", script, "--cwd", ws, "--json")

    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert (data["status"], data["output"], data["usage"]["turns"]) == (
        "completed",
        "Changed b() in src/twice.py to return 2.",
        3,
    )
    assert proc.stderr.splitlines() == [
        "edit src/twice.py",
        "Error: old_text occurs 2 times in src/twice.py; include more surrounding lines so it matches exactly once",
        "edit src/twice.py",
    ]
    # The ambiguous edit changed nothing; only the unique one did.
    assert (ws / "src" / "twice.py").read_bytes() == original.replace(
        "b():\n    return 1", "b():\n    return 2"
    ).encode()


def test_ambiguous_edit_alone_leaves_the_file_byte_identical(tmp_path: Path, ws: Path, write_script: Any) -> None:
    original = b"x = 1\r\nx = 1\r\n"
    (ws / "dup.txt").write_bytes(original)
    script = write_script(
        [
            call("edit", path="dup.txt", old_text="x = 1", new_text="x = 2"),
            "Could not edit: the text occurs twice.",
        ],
    )
    proc = cli("run", "worker", "set x to 2", "--model", script, "--cwd", ws)

    assert proc.returncode == 0, proc.stderr
    assert (ws / "dup.txt").read_bytes() == original
    assert "Error: old_text occurs 2 times in dup.txt" in proc.stderr
    assert proc.stdout == "Could not edit: the text occurs twice.\n"


def test_a_failed_run_exits_1(tmp_path: Path, ws: Path, write_script: Any) -> None:
    script = write_script([call("ls", path="."), call("ls", path="src")])
    proc = cli("run", "scout", "look", "--model", script, "--cwd", ws, "--max-turns", "1", "--json")

    data = json.loads(proc.stdout)
    assert (data["status"], data["stop_reason"]) == ("failed", "max_turns")
    assert data["error"] == "reached the limit of 1 turns without a final answer"
    assert "Traceback" not in proc.stderr
    assert proc.returncode == 1


def test_compaction_on_a_small_window_through_the_cli(tmp_path: Path, ws: Path, write_script: Any) -> None:
    big = "".join(f"line {i:03d}: settings value number {i} for the config parser\n" for i in range(200))
    (ws / "big.txt").write_text(big)
    reads = [call("read", path="big.txt", offset=1 + 17 * i, limit=17) for i in range(4)]
    summary = "## Goal\nFind the parser.\n## Progress\nRead big.txt in windows of 17 lines."
    # Window 2700 scales to 675 tokens reserved and 1350 kept; with the scout's head (~1,150 tokens,
    # its background-command tools included) and a 300-token summary, only ~580 tokens of history fit
    # below the trigger (2700 - 675), so after the third read (each ~355 tokens, call + result) the
    # first two are summarised and the third kept. Tool outputs fix these counts, not the temp path.
    script = write_script({"replies": [*reads[:3], summary, reads[3], "Done: big.txt."], "context_window": 2700})
    proc = cli("run", "scout", "read big.txt", "--model", script, "--cwd", ws, "--json")

    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert (data["status"], data["output"], data["usage"]["turns"]) == ("completed", "Done: big.txt.", 5)
    lines = proc.stderr.splitlines()
    labels = [f"read big.txt:{1 + 17 * i}-{17 + 17 * i}" for i in range(4)]
    assert lines[:3] == labels[:3] and lines[4] == labels[3]
    compacted = [lines[3]]
    assert compacted[0].startswith("compacted ")
    before, after = map(int, compacted[0].removeprefix("compacted ").removesuffix(" tokens").split(" -> "))
    assert 1800 < before and after < before


def test_tool_labels_are_shown_literally(tmp_path: Path, ws: Path, write_script: Any) -> None:
    script = write_script(
        [
            call("read", path="src/[id]/page.tsx"),
            call("bash", command="echo '[/]' '[/]'"),
            "done",
        ],
    )
    proc = cli("run", "scout", "look", "--model", script, "--cwd", ws)

    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[:3] == [
        "read src/[id]/page.tsx",
        "Error: path 'src/[id]/page.tsx' does not exist in the workspace; use ls or find to see what is there",
        "$ echo '[/]' '[/]'",
    ]


# -- agents ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_agent_discovery_errors_and_project_agent_consent(tmp_path: Path, ws: Path, write_script: Any) -> None:
    agents_dir = ws / ".mlx-subagents" / "agents"
    agents_dir.mkdir(parents=True)
    (agents_dir / "broken.md").write_text("name: broken\nno frontmatter here\n")
    (agents_dir / "remote.md").write_text(
        "---\nname: remote\ndescription: uses a cloud model\nmodel: openai/gpt-4o\n---\nYou are remote.\n"
    )
    (agents_dir / "helper.md").write_text(
        "---\nname: helper\ndescription: lists files\ntools: ls\n---\nYou list files.\n"
    )

    listing = cli("agents", "--cwd", ws, "--json")
    assert listing.returncode == 0, listing.stderr
    rows = json.loads(listing.stdout)
    assert [(r["name"], r["source"]) for r in rows] == [
        ("helper", "project"),
        *((name, "builtin") for name in BUILTINS),
    ]
    assert rows[0]["tools"] == ["ls"] and rows[0]["file"] == str((agents_dir / "helper.md").resolve())
    warnings = listing.stderr.splitlines()
    assert len(warnings) == 2
    assert warnings[0].startswith(f"warning: skipped {(agents_dir / 'broken.md').resolve()}: no frontmatter; ")
    assert warnings[1].startswith(
        f"warning: skipped {(agents_dir / 'remote.md').resolve()}: field 'model': 'openai/gpt-4o' is a remote "
        "'openai' model; only local MLX models run here; "
    )

    script = write_script([call("ls", path="."), "README.md and src/."])
    refused = cli("run", "helper", "list", "--model", script, "--cwd", ws)
    assert refused.returncode == 2
    assert refused.stdout == "" and "Traceback" not in refused.stderr
    assert refused.stderr.splitlines()[-1] == (
        f"error: agent 'helper' comes from the project file {(agents_dir / 'helper.md').resolve()}; "
        "its bash runs sandboxed in this workspace. Re-run with --yes-agents (or --yes) to allow it."
    )

    allowed = cli("run", "helper", "list", "--model", script, "--cwd", ws, "--yes", "--verbose")
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stdout == "README.md and src/.\n"
    # `run` shows the agent files' warnings too, before it starts.
    assert allowed.stderr.splitlines()[:4] == [*warnings, f"helper on {script} (tool mode: native)", "ls ."]


def test_unknown_agent_lists_the_available_ones(tmp_path: Path, ws: Path, write_script: Any) -> None:
    script = write_script(["unused"])
    proc = cli("run", "nope", "task", "--model", script, "--cwd", ws)

    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == "error: unknown agent 'nope'; available: orchestrator, planner, reviewer, scout, worker\n"


# -- bad usage and missing models -----------------------------------------------------------------


def test_a_missing_model_folder_is_one_line(ws: Path) -> None:
    proc = cli("run", "scout", "task", "--model", "/nonexistent/folder", "--cwd", ws)

    assert proc.returncode == 2
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr == (
        "error: model folder /nonexistent/folder does not exist; pass an existing folder or a hub id like "
        "mlx-community/Qwen3-4B-Instruct-2507-4bit\n"
    )


@pytest.mark.slow
def test_the_default_model_offline_and_not_cached_says_how_to_get_it(tmp_path: Path, ws: Path) -> None:
    proc = cli("run", "scout", "task", "--cwd", ws, env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})

    assert proc.returncode == 2
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    model = "mlx-community/Qwen3-4B-Instruct-2507-4bit"
    assert proc.stderr == (
        f"error: model '{model}' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
        f"download it once while online (`hf download {model}`) or pass a local folder\n"
    )


def test_bad_usage_is_a_usage_error_not_a_traceback(ws: Path) -> None:
    proc = cli("run", "scout")  # no task

    assert proc.returncode == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == "Error: Missing argument 'task'."


def test_a_missing_workspace_folder_is_one_line(tmp_path: Path, write_script: Any) -> None:
    script = write_script([call("ls", path="."), "done"])
    proc = cli("run", "scout", "task", "--model", script, "--cwd", tmp_path / "missing")

    assert proc.returncode == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr and "ls ." not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"Error: Invalid value for '--cwd' / '-C': dir '{tmp_path / 'missing'}' does not exist."
    )


# -- doctor ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_doctor_on_the_tiny_model(tiny_qwen3_path: Path) -> None:
    proc = cli("doctor", "--model", tiny_qwen3_path)

    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    first = {}  # each key's first line: "memory" is both the RAM line and mlx's memory use
    for line in lines:
        first.setdefault(line.split(maxsplit=1)[0], line)
    assert first["mlx"].startswith(f"mlx       {mx.__version__}  (mlx-lm ")
    assert first["device"] == f"device    {mx.default_device()}"
    assert first["memory"].startswith("memory    ") and first["memory"].endswith(" GiB RAM")
    assert first["model"] == f"model     {tiny_qwen3_path}"
    assert first["loaded"].startswith(f"loaded    {tiny_qwen3_path.resolve()} in ")
    assert first["loaded"].endswith("; context window 4096 tokens")
    assert first["tools"] == (
        "tools     native: the chat template presents the tools; calls are read in the model's own format"
    )
    assert first["grammar"] == (
        f"grammar   llguidance {version('llguidance')}: a json call grammar compiles for this vocabulary "
        "(1545 tokens) and masks its first token to 3 of them"
    )
    assert first["reply"].startswith("reply     ")
    assert first["speed"].startswith("speed     prompt ") and first["speed"].endswith(" tok/s")
    assert first["drafts"] == "drafts    off (--draft auto: lookup on a GPU only)"  # a CPU
    folder = Path(os.environ["MLX_SUBAGENTS_HOME"]) / "cache" / "prefixes"
    assert first["prefixes"].startswith(f"prefixes  {folder}: 0 prefixes, 0.0 MiB of at most ")
    assert first["prefixes"].endswith(" GiB; `subagent cache` lists them")
    assert first["prefill"] == (
        "prefill   auto: slices of about 8 decode steps' time (at least 16 tokens) while others decode, "
        "the time shared equally; 512 tokens with nothing decoding; oldest prompt first"
    )
    assert lines[-1] == "ok"
    assert "Traceback" not in proc.stderr


def test_doctor_says_why_the_grammar_path_does_not_work(tiny_qwen3: Any) -> None:
    slow = type("Slow", (), {"encode": tiny_qwen3[1].encode, "eos_token_ids": [0]})()  # not a fast tokenizer
    assert grammar_line(slow, "json", "<tool_call>", "</tool_call>") == (  # llguidance reads only fast ones
        "grammar   unavailable (ValueError: Only fast tokenizers are supported); tool calls and answers decode freely"
    )
    assert grammar_line(tiny_qwen3[1], None, "", "") == (
        "grammar   none for this model's call format; tool calls and answers decode freely"
    )


@pytest.mark.slow
def test_doctor_reads_a_scripted_model_as_a_run_does(tmp_path: Path) -> None:
    """Its help offers `scripted:FILE`; it failed ("neither a folder nor an imported model")."""
    script = tmp_path / "replay.yaml"
    script.write_text("replies: [hi]\nagents:\n  scout:\n    replies: [a, b]\n")
    proc = cli("doctor", "--model", f"scripted:{script}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-4:] == [
        f"model     scripted:{script}",
        f"loaded    {script}: scripted replies, 1 for any session, 2 for scout; context window 32768 tokens",
        "reply     replayed, not generated: no weights, no device, nothing to time",
        "ok",
    ]
    script.write_text("replies: []\n")
    proc = cli("doctor", "--model", f"scripted:{script}")
    assert proc.returncode == 1 and proc.stdout.splitlines()[-1] == (
        f"FAILED    {script}: the script has no replies: add 'replies' or 'agents.<name>.replies'"
    )


@pytest.mark.slow
def test_doctor_with_a_missing_model_fails(tmp_path: Path) -> None:
    proc = cli("doctor", "--model", "/nonexistent")

    lines = proc.stdout.splitlines()
    assert lines[-1] == (
        "FAILED    model folder /nonexistent does not exist; pass an existing folder or a hub id like "
        "mlx-community/Qwen3-4B-Instruct-2507-4bit"
    )
    assert "Traceback" not in proc.stderr
    assert proc.returncode == 1
