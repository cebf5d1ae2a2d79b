"""The preloaded process of the tests (tests/preloaded.py): a script run through it sees what `python
SCRIPT` would (its arguments, environment, folder, streams), with the modules already imported, and
its exit code comes back; a child whose client is killed ends too."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from tests.preloaded import preloaded

SCRIPT = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "env": os.environ.get("PRELOADED_TEST"), "cwd": os.getcwd(),
                  "stdin": sys.stdin.read(), "name": __name__, "preloaded": "colorsys" in sys.modules,
                  "pid": os.getpid()}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_a_script_runs_as_python_would_run_it_and_its_exit_code_comes_back(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    with preloaded(["colorsys"]) as python:
        runs = [
            subprocess.run(
                [*python, str(script), str(code)],
                input=f"in {code}",
                capture_output=True,
                text=True,
                cwd=tmp_path,
                env={**os.environ, "PRELOADED_TEST": f"env {code}"},
            )
            for code in (0, 3)
        ]
    for code, run in zip((0, 3), runs, strict=True):
        seen = json.loads(run.stdout)
        assert (run.returncode, run.stderr) == (code, "to stderr\n")
        assert seen["argv"] == [str(script), str(code)]
        assert (seen["env"], seen["cwd"], seen["stdin"]) == (f"env {code}", str(tmp_path), f"in {code}")
        assert (seen["name"], seen["preloaded"]) == ("__main__", True)
    assert json.loads(runs[0].stdout)["pid"] != json.loads(runs[1].stdout)["pid"]


def test_code_runs_as_python_c_would_run_it(tmp_path: Path) -> None:
    with preloaded(["colorsys"]) as python:
        run = subprocess.run([*python, "-c", SCRIPT, "4"], input="in", capture_output=True, text=True, cwd=tmp_path)
    seen = json.loads(run.stdout)
    assert (run.returncode, run.stderr) == (4, "to stderr\n")
    assert (seen["argv"], seen["cwd"], seen["stdin"]) == (["-c", "4"], str(tmp_path), "in")
    assert (seen["name"], seen["preloaded"]) == ("__main__", True)


def test_a_child_ends_when_its_client_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text("import os, sys, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)\n")
    with preloaded([]) as python:
        client = subprocess.Popen([*python, str(script)], stdout=subprocess.PIPE, text=True)
        assert client.stdout is not None
        child = int(client.stdout.readline())
        client.kill()
        client.wait()
        deadline = time.monotonic() + 30
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)


def _alive(pid: int) -> bool:
    """Whether `pid` is there (the preloaded process waits for its children as they end)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
