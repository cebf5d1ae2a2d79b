"""Files and names a user, a cloned repository or a model hands over: one guard, bounded, one line each.

Every case runs `subagent` as a real process; a case that must not block or read without end is
bounded by the subprocess timeout (a FIFO that were opened for reading would block it; reading
/dev/zero or a sparse file of gigabytes would never finish in time or exhaust memory).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.home import MAX_FILE_NAME_CHARS, file_name
from mlx_subagents.runs.transcripts import runs_dir
from mlx_subagents.text import MAX_WARNING_CHARS
from tests.cli.test_cli_run import cli

# process: all but test_file_name_is_bounded_and_keeps_long_names_apart
pytestmark = [pytest.mark.process, pytest.mark.usefixtures("preloaded_cli")]

LIMIT = "1,048,576"
NOT_REGULAR = "not a regular file (a FIFO, device or socket)"
SPARSE = 8 * 1024**3  # 8 GiB that take no disk space: read whole, they would not fit in memory


def _special(path: Path, kind: str) -> str:
    """Make `path` a FIFO, a link to /dev/zero or a huge sparse file; the path the error names."""
    if kind == "fifo":
        os.mkfifo(path)
        return str(path)
    if kind == "zero":
        path.symlink_to("/dev/zero")
        return str(path)
    with path.open("wb") as f:
        f.truncate(SPARSE)
    return str(path)


def _refusal(shown: str, kind: str, what: str) -> str:
    article = "an" if what[0] in "aeiou" else "a"
    if kind == "huge":
        return f"error: {shown}: the file is {SPARSE:,} bytes, over the limit of {LIMIT} for {article} {what}; shorten it\n"
    return f"error: {shown}: {NOT_REGULAR}; {article} {what} must be a plain text file\n"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fifo", "zero", "huge"])
@pytest.mark.parametrize("what", ["schema file", "tasks file", "workflow file", "scripted model file"])
def test_every_file_a_user_hands_over_is_one_line_and_exit_2(tmp_path: Path, what: str, kind: str) -> None:
    script = tmp_path / "script.json"
    script.write_text('["done"]')
    path = tmp_path / what.replace(" ", "_")
    shown = _special(path, kind)
    args: list[Any] = {
        "schema file": ["run", "scout", "hi", "-m", f"scripted:{script}", "--schema", path],
        "tasks file": ["parallel", "-f", path, "-m", f"scripted:{script}"],
        "workflow file": ["workflow", path, "-m", f"scripted:{script}"],
        "scripted model file": ["run", "scout", "hi", "-m", f"scripted:{path}"],
    }[what]
    if what == "workflow file" and kind == "zero":
        shown = "/dev/zero"  # a workflow path is resolved before it is read
    done = cli(*args, "-C", tmp_path, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", _refusal(shown, kind, what))
    assert not runs_dir().exists()


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_a_model_to_import_that_is_not_a_regular_file_is_one_line(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "model.gguf"
    shown = _special(path, kind)
    done = cli("models", "import", path, "--name", "m", timeout=60)
    expected = f"error: {shown}: {NOT_REGULAR}; a GGUF file must be a regular file\n"
    assert (done.returncode, done.stdout, done.stderr) == (2, "", expected)


# --- project instructions and agent files from a cloned repository ---------------------------------------


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    return repo


def test_a_huge_sparse_agents_md_is_read_only_in_part(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    with (repo / "AGENTS.md").open("wb") as f:
        f.write(b"Always run the tests.\n")
        f.truncate(SPARSE)  # the rest reads as NUL bytes: 8 GiB if it were read whole
    done = cli("agents", "--verbose", "-C", repo, timeout=60)
    assert done.returncode == 0, done.stderr
    # 32,000 bytes read (4 per character at most): the block, its heading and a cut at 8,000.
    assert "project instructions (more than 32," in done.stdout
    assert "characters, cut at 8,000), in this order:\n" in done.stdout
    assert f"  {repo / 'AGENTS.md'}\n" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_an_agents_md_that_is_not_a_regular_file_is_left_out_and_named(tmp_path: Path, kind: str) -> None:
    repo = _repo(tmp_path)
    (repo / "CLAUDE.md").write_text("Be brief.\n")
    shown = _special(repo / "AGENTS.md", kind)
    script = tmp_path / "script.json"
    script.write_text('["found it"]')
    done = cli("run", "scout", "where?", "-m", f"scripted:{script}", "-C", repo, timeout=60)
    assert (done.returncode, done.stdout) == (0, "found it\n")
    listed = cli("agents", "--verbose", "-C", repo, timeout=60)
    assert f"  {repo / 'CLAUDE.md'}\n" in listed.stdout
    assert (
        f"  left out {shown}: {NOT_REGULAR}; a project instructions file must be a plain text file\n" in listed.stdout
    )


def _agent_file(folder: Path, name: str, front: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.md"
    path.write_text(f"---\nname: {name}\ndescription: d\n{front}\n---\nDo it.\n")
    return path


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning:")]


@pytest.mark.slow
def test_a_huge_tool_list_parses_in_linear_time_and_warns_in_one_bounded_line(tmp_path: Path) -> None:
    # 100,000 unknown Claude tools in 1 MB: the old split looked ahead to the end at every comma.
    repo = _repo(tmp_path)
    names = [f"T{i}" for i in range(100_000)]
    path = _agent_file(repo / ".claude" / "agents", "many", "tools: " + ", ".join(names))
    assert path.stat().st_size < 1024 * 1024
    done = cli("agents", "-C", repo, timeout=60)
    assert done.returncode == 0, done.stderr
    shown = ", ".join(names[:10])
    expected = f"warning: {path}: tool(s) not available here, dropped: {shown} (and 99,990 more)"
    assert _warnings(done.stderr) == [expected]


@pytest.mark.slow
def test_commas_without_brackets_and_many_unknown_fields_stay_bounded(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    folder = repo / ".mlx-subagents" / "agents"
    commas = _agent_file(folder, "commas", "tools: " + "read," * 150_000)
    fields = "\n".join(f"f{i:05d}: {'v' * 10}" for i in range(20_000))
    unknown = _agent_file(folder, "fields", fields)
    done = cli("agents", "-C", repo, timeout=60)
    assert done.returncode == 0, done.stderr
    listed = ", ".join(f"f{i:05d}" for i in range(10))
    assert _warnings(done.stderr) == [f"warning: {unknown}: unknown field(s) {listed} (and 19,990 more) ignored"]
    assert "commas" in done.stdout and commas.is_file()


@pytest.mark.slow
def test_every_warning_line_is_capped(tmp_path: Path) -> None:
    # A warning names its file: under folders of long names, the line is cut to the cap.
    repo = _repo(tmp_path)
    deep = repo.joinpath(*["d" * 100] * 5)
    path = _agent_file(deep / ".mlx-subagents" / "agents", "bad", "tools: [read")
    done = cli("agents", "-C", deep, timeout=60)
    (warning,) = _warnings(done.stderr)
    assert warning == f"warning: skipped {path}"[: len("warning: ") + MAX_WARNING_CHARS - 3] + "..."


# --- names that become file names ---------------------------------------------------------------------------


LONG = "x" * 300


def test_a_long_label_is_refused_before_anything_runs(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(json.dumps([{"agent": "scout", "task": "hi", "label": LONG}]))
    script = tmp_path / "script.json"
    script.write_text('["done"]')
    done = cli("parallel", "-f", tasks, "-m", f"scripted:{script}", timeout=60)
    expected = f"error: task label '{'x' * 64}...' is 300 characters, over the limit of 64; shorten it\n"
    assert (done.returncode, done.stdout, done.stderr) == (2, "", expected)
    assert not runs_dir().exists()


def test_a_label_of_any_characters_makes_a_safe_bounded_file(tmp_path: Path) -> None:
    labels = ["../../escape", "a/b\\c: d", "ü" * 64, "." * 64]
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(json.dumps([{"agent": "scout", "task": "hi", "label": label} for label in labels]))
    script = tmp_path / "script.json"
    script.write_text('["done"]')
    done = cli("parallel", "-f", tasks, "-m", f"scripted:{script}", "--json", timeout=60)
    assert done.returncode == 0, done.stderr
    (folder,) = runs_dir().iterdir()
    files = sorted(p.name for p in folder.iterdir() if p.suffix == ".jsonl")
    assert files == ["01-escape.jsonl", "02-a_b_c_d.jsonl", "03-task.jsonl", "04-task.jsonl"]
    assert [r["label"] for r in json.loads(done.stdout)["results"]] == labels


def test_file_name_is_bounded_and_keeps_long_names_apart() -> None:
    first, second = file_name("a" * 300 + "1"), file_name("a" * 300 + "2")
    assert len(first) == len(second) == MAX_FILE_NAME_CHARS
    assert first != second and first.startswith("a" * 70)
    assert file_name("scout > worker") == "scout_worker"
    assert file_name("...") == "task"


def test_a_long_agent_name_is_skipped_with_one_line(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    path = _agent_file(repo / ".mlx-subagents" / "agents", "long", "")
    path.write_text(path.read_text().replace("name: long", f"name: {LONG}"))
    done = cli("agents", "-C", repo, timeout=60)
    assert _warnings(done.stderr) == [
        f"warning: skipped {path}: field 'name': agent name '{'x' * 64}...' is 300 characters, over the limit "
        "of 64; shorten it"
    ]


def test_an_agent_name_of_64_characters_runs(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    name = "a" * 64
    _agent_file(repo / ".mlx-subagents" / "agents", name, "tools: ls")
    script = tmp_path / "script.json"
    script.write_text('["ok"]')
    done = cli("run", name, "hi", "-m", f"scripted:{script}", "-C", repo, "--yes", timeout=60)
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stderr
    (folder,) = runs_dir().iterdir()
    assert (folder / f"01-{name}.jsonl").is_file()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "error"),
    [
        (
            ["models", "import", "x.gguf", "--name", LONG],
            f"model name '{'x' * 64}...' is 300 characters, over the limit of 64; shorten it",
        ),
        (
            ["workflow", LONG],
            f"unknown workflow '{LONG}'; available: none (put NAME.toml in .mlx-subagents/workflows/)",
        ),
    ],
)
def test_long_names_in_lookups_are_one_line(tmp_path: Path, args: list[str], error: str) -> None:
    done = cli(*args, "-C", tmp_path, timeout=60) if args[0] == "workflow" else cli(*args, timeout=60)
    assert (done.returncode, done.stderr) == (2, f"error: {error}\n")


def test_a_long_model_name_is_not_a_traceback(tmp_path: Path) -> None:
    done = cli("run", "scout", "hi", "-m", LONG, "-C", tmp_path, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: model '{LONG}'") and done.stderr.count("\n") == 1


# --- references that name paths, and error text that is not markup -----------------------------------------


@pytest.mark.parametrize(
    "reference", ["../../../etc/passwd", "a/../../b", "x:../../y", "library/m:a/b", "a/b/c/d", ".hidden", "m:..", ":t"]
)
def test_an_ollama_reference_that_names_a_path_is_refused(tmp_path: Path, reference: str) -> None:
    done = cli("models", "import", f"ollama:{reference}", env={"OLLAMA_MODELS": str(tmp_path)}, timeout=60)
    expected = (
        f"error: 'ollama:{reference}' is not an Ollama model name ([host/][namespace/]name[:tag], each part letters, "
        "digits, '.', '_' or '-'); use e.g. ollama:qwen2.5-coder:7b\n"
    )
    assert (done.returncode, done.stdout, done.stderr) == (2, "", expected)


def _manifest(models: Path, digest: Any) -> Path:
    manifest = models / "manifests" / "registry.ollama.ai" / "library" / "m" / "latest"
    manifest.parent.mkdir(parents=True)
    layers = [{"mediaType": "application/vnd.ollama.image.model", "digest": digest}]
    manifest.write_text(json.dumps({"layers": layers}))
    return manifest


@pytest.mark.parametrize(
    "digest",
    ["sha256:../../../../etc/passwd", "/etc/passwd", "sha256:" + "A" * 64, "sha256:" + "a" * 63, "md5:" + "a" * 64, 7],
)
def test_a_manifest_digest_that_is_not_sha256_hex_is_refused(tmp_path: Path, digest: Any) -> None:
    manifest = _manifest(tmp_path, digest)
    done = cli("models", "import", "ollama:m", env={"OLLAMA_MODELS": str(tmp_path)}, timeout=60)
    expected = (
        f"error: {manifest}: the model layer's digest {digest!r} is not sha256: and 64 hex digits; "
        "run `ollama pull m` again\n"
    )
    assert (done.returncode, done.stdout, done.stderr) == (2, "", expected)


@pytest.mark.slow
def test_an_ollama_blob_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    _manifest(tmp_path, "sha256:" + "0" * 64)
    (tmp_path / "blobs").mkdir()
    blob = tmp_path / "blobs" / ("sha256-" + "0" * 64)
    os.mkfifo(blob)
    done = cli("models", "import", "ollama:m", env={"OLLAMA_MODELS": str(tmp_path)}, timeout=60)
    assert (done.returncode, done.stderr) == (2, f"error: {blob}: {NOT_REGULAR}; a GGUF file must be a regular file\n")


@pytest.mark.slow
@pytest.mark.parametrize("name", [":a:", ":thumbs_up:", "[red]x[/]", "[bold]"])
def test_error_lines_are_literal_text(tmp_path: Path, name: str) -> None:
    done = cli("run", name, "hi", "-m", "scripted:none.json", "-C", tmp_path, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: unknown agent '{name}'; available: ")


# --- two writers of one task -------------------------------------------------------------------------------


WAIT_FOR_RELEASE = "touch started; while [ ! -e release ]; do sleep 0.05; done; echo released"


def _scripts(tmp_path: Path) -> tuple[str, str]:
    first, slow = tmp_path / "first.json", tmp_path / "slow.json"
    first.write_text('["first answer"]')
    slow.write_text(
        json.dumps([{"tool_calls": [{"name": "bash", "arguments": {"command": WAIT_FOR_RELEASE}}]}, "more"])
    )
    return f"scripted:{first}", f"scripted:{slow}"


def _wait_for(path: Path, proc: Any) -> None:
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        os.sched_yield()


@pytest.mark.slow
@pytest.mark.parametrize("first_ends", ["finishes", "is killed"])
def test_a_second_resume_of_a_task_is_refused_while_the_first_runs(tmp_path: Path, first_ends: str) -> None:
    from tests.helpers import spawn_cli

    first, slow = _scripts(tmp_path)
    assert cli("run", "scout", "hi", "-m", first, "-C", tmp_path, timeout=60).returncode == 0
    (run_id,) = [p.name for p in runs_dir().iterdir()]
    running = spawn_cli("resume", run_id, "follow-up one", "-m", slow)
    try:
        _wait_for(tmp_path / "started", running)
        second = cli("resume", run_id, "follow-up two", "-m", first, timeout=60)
        assert (second.returncode, second.stdout, second.stderr) == (
            2,
            "",
            f"error: task 'scout' of run {run_id} is being continued elsewhere (another resume or chat); "
            "wait until that ends, then resume it again\n",
        )
        if first_ends == "is killed":
            running.kill()
        (tmp_path / "release").touch()
        running.communicate(timeout=60)
    finally:
        running.kill()
        running.wait(timeout=60)
    third = cli("resume", run_id, "follow-up three", "-m", first, timeout=60)
    assert (third.returncode, third.stdout) == (0, "first answer\n"), third.stderr
    (transcript,) = (runs_dir() / run_id).glob("*.jsonl")
    records = [json.loads(line) for line in transcript.read_text().splitlines()]
    follow_ups = [(r["generation"], r["message"]) for r in records if r["type"] == "follow_up"]
    # Each generation once, none lost (a killed generation keeps its number: the next one follows it).
    assert follow_ups == [(2, "follow-up one"), (3, "follow-up three")]
