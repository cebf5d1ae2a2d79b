"""Small helpers the test modules share (fixtures live in conftest.py)."""

from __future__ import annotations

import asyncio
import io
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.agents.prompt import task_message
from mlx_subagents.agents.session import workspace_for
from mlx_subagents.events import Event, EventSink, ignore_event
from mlx_subagents.host.protocol import HostEvent, ModelHost, OnHostEvent, ReasoningDelta, TextDelta
from mlx_subagents.host.scripted import Script, ScriptedHost
from mlx_subagents.runs.options import RunOptions
from mlx_subagents.runs.runner import Runner
from mlx_subagents.runs.tasks import TaskSpec

REPO = Path(__file__).resolve().parents[1]
# A bash command that runs until killed, leaving the pids of bash and of its child in the workspace.
SLOW = "echo $$ > bash.pid; sleep 30 & echo $! > sleep.pid; wait"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


# A test that runs a sandboxed `bash` (a project agent's, say) needs bubblewrap on Linux: skipped naming it
# where it is missing, failed under CI, which installs it (`needs` in tests/conftest.py).
needs_sandbox = pytest.mark.needs("bubblewrap")


def needs_bwrap(test: Any) -> Any:
    """The sandbox's walls as bubblewrap builds them: a Linux test that needs bubblewrap."""
    linux = pytest.mark.skipif(sys.platform != "linux", reason="bubblewrap's walls (macOS has sandbox-exec)")
    return linux(needs_sandbox(test))


def texts(receive: Callable[[str], Any], reasoning: Callable[[str], Any] | None = None) -> OnHostEvent:
    """A `GenerateArgs.on_event` that passes on the reply's visible text as it streams (each `TextDelta`),
    and its reasoning to `reasoning` (each `ReasoningDelta`)."""

    def on_event(event: HostEvent) -> None:
        if isinstance(event, TextDelta):
            receive(event.text)
        elif isinstance(event, ReasoningDelta) and reasoning is not None:
            reasoning(event.text)

    return on_event


def call(name: str, **arguments: Any) -> dict[str, Any]:
    """A scripted-model reply that makes one tool call."""
    return {"tool_calls": [{"name": name, "arguments": arguments}]}


# --- runners: an in-memory scripted host, a runner on it or on a model id, a run to its end ----------------


def task_text(task: str, cwd: Path) -> str:
    """The first user message of a new session on `task` in the workspace `cwd` (`task_message`)."""
    return task_message(task, workspace_for(cwd))


def scripted_host(script: Any) -> ScriptedHost:
    """An in-memory host replaying `script`, in a script file's shapes: a list of replies, or a mapping
    of `replies`, `agents` (`{name: {"replies": [...]}}`) and `context_window`. Its model name is
    `host.model_id` (`scripted:memory`)."""
    return ScriptedHost(Script.model_validate(script))


def make_runner(
    cwd: Path,
    model: str | ModelHost,
    events: list[Event] | EventSink | None = None,
    *,
    save_transcripts: bool = True,
    home: Path | None = None,
    processor_factory: Any = None,
    **options: Any,
) -> Runner:
    """A runner in `cwd` on `model`: a model id (a folder, `scripted:PATH`), or a host made by the test,
    given to the runner under its `model_id`. `events` is a list that collects every event, or a sink;
    `options` go to `RunOptions`."""
    hosts = {}
    if not isinstance(model, str):
        hosts, model = {model.model_id: model}, model.model_id
    sink = events.append if isinstance(events, list) else events or ignore_event
    return Runner(
        cwd=cwd,
        options=RunOptions(model=model, **options),
        on_event=sink,
        save_transcripts=save_transcripts,
        home=home,
        processor_factory=processor_factory,
        hosts=hosts,
    )


def go(runner: Runner, method: str, *args: Any, **kwargs: Any) -> Any:
    """`runner.METHOD(*args, **kwargs)` run to its end in a new event loop, the runner closed after."""

    async def main() -> Any:
        async with runner:
            return await getattr(runner, method)(*args, **kwargs)

    return asyncio.run(main())


def run_parent(runner: Runner, task: str = "help me", agent: str = "orchestrator") -> Any:
    """The result of one task of `agent` (the orchestrator by default): a parent that may delegate."""
    return go(runner, "run", TaskSpec(agent, task))


def write_agent(root: Path, name: str, tools: str | None = None, front: str = "", body: str = "Do the task.") -> Path:
    """A project agent file `root/.mlx-subagents/agents/NAME.md`: `tools` (a list as written after `tools:`),
    then `front` (more front-matter lines, each ending in a newline), then `body`."""
    folder = root / ".mlx-subagents" / "agents"
    folder.mkdir(parents=True, exist_ok=True)
    granted = f"tools: {tools}\n" if tools is not None else ""
    path = folder / f"{name}.md"
    path.write_text(f"---\nname: {name}\ndescription: {name} agent\n{granted}{front}---\n{body}\n")
    return path


# --- processes -------------------------------------------------------------------------------------


def alive(pid: int) -> bool:
    """Whether `pid` still runs; a zombie (killed, not yet reaped by init) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except ProcessLookupError:  # it ended between kill(pid, 0) and the read
        return False
    except FileNotFoundError:
        return not Path("/proc/self").exists()  # no procfs: trust kill(pid, 0)
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def all_dead(pids: list[int], within: float = 10.0) -> bool:
    """Whether every pid is gone, waiting up to `within` seconds for the kills to land: a bound for a
    loaded machine, well under the 30 s and more that the tests' sleepers run when nothing kills them."""
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_for_pids(folder: Path, deadline: float) -> list[int]:
    while not ((folder / "sleep.pid").is_file() and (folder / "sleep.pid").read_text().strip()):
        assert time.monotonic() < deadline, "the bash command never started"
        time.sleep(0.05)
    return [int((folder / name).read_text()) for name in ("bash.pid", "sleep.pid")]


def unevaluated(*arrays: Any) -> bool:
    """Whether every mlx array given is still a pending graph: in a DOT export an unevaluated array is
    the output of an operation (`... -> "name"`), an evaluated one a node with none (mlx exports every
    unevaluated input of the arrays, and nothing else). One export for several arrays of one graph: each
    export walks the whole pending graph, which grows with every step a decode test takes."""
    import mlx.core as mx

    names = {f"x{i}": array for i, array in enumerate(arrays)}
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays, **names)
    text = dot.getvalue()
    return all(f'-> "{name}"' in text for name in names)


def cli_env() -> dict[str, str]:
    """The environment of a `subagent` process: this checkout on its path, a wide terminal."""
    return {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}


class Terminal:
    """`subagent chat` on a pseudo-terminal: Ctrl-C is a byte the terminal turns into SIGINT."""

    def __init__(self, args: list[str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: only exec
            os.execve(sys.executable, [sys.executable, "-m", "mlx_subagents.cli", *args], cli_env())
        self.seen = ""

    def send(self, data: str) -> None:
        os.write(self.fd, data.encode())

    def expect(self, text: str, timeout: float = 60) -> str:
        """What the terminal showed up to and with `text`, waiting for it up to `timeout` seconds: a bound for
        a failing test, not a measure (a chat's start alone took over 10 s on a loaded 2-core CI)."""
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"{text!r} never appeared; the terminal shows:\n{self.seen}"
            try:
                chunk = os.read(self.fd, 4096).decode(errors="replace")
            except OSError:  # the child closed the terminal
                chunk = ""
            assert chunk, f"the chat ended before {text!r}; the terminal shows:\n{self.seen}"
            self.seen += ANSI.sub("", chunk).replace("\r\n", "\n")
        before, _, self.seen = self.seen.partition(text)
        return before + text

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:  # keep draining, so the child never blocks on a full terminal
                if select.select([self.fd], [], [], 0.05)[0]:
                    os.read(self.fd, 4096)
            except OSError:
                pass
        raise AssertionError("the chat did not exit")

    def close(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


def spawn_cli(*args: str, env: dict[str, str] | None = None, python: list[str] | None = None) -> subprocess.Popen[str]:
    """`subagent ARGS` as a real process (this checkout on its path), stdout and stderr piped. `python`: what
    stands for `python`, a preloaded process's (`preloaded_python`, whose fork runs the command without 1 s of
    CPU of imports), for a command the test does not signal itself (its client would get the signal)."""
    return subprocess.Popen(
        [*(python or [sys.executable]), "-m", "mlx_subagents.cli", *args],
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **(env or {})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_listening(process: subprocess.Popen[Any], port: int, what: str, timeout: float = 60) -> None:
    """Waits until `process` listens on `port` of the loopback, failing the test in one line if it exits or
    does not listen within `timeout` seconds (a server's start takes many seconds on a loaded 2-core CI)."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        if process.poll() is not None:
            pytest.fail(f"{what} exited with {process.returncode} before listening on port {port}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not listen on port {port} within {timeout:g} s")
        time.sleep(0.1)
