"""A process whose mlx thread ran mlx work exits cleanly.

mlx tears a thread's streams down in thread-local destructors that, left to the thread's exit, race
the interpreter's finalisation and abort the process ("terminate called without an active
exception", exit 134) after the work is done. The mlx thread clears its streams before it ends.
The race needs load to show: the processes run at once, on a machine with far fewer cores. Each loads
the mlx thread's module by its path (it imports only the standard library), which keeps a process
at a fraction of a second instead of importing the whole host.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import mlx_subagents

pytestmark = [pytest.mark.slow, pytest.mark.process]

MLX_THREAD_FILE = Path(mlx_subagents.__file__).parent / "host" / "mlx" / "mlx_thread.py"
EXIT_RIGHT_AFTER_STOP = """
import asyncio
import importlib.util
import sys

import mlx.core as mx

spec = importlib.util.spec_from_file_location("mlx_thread", sys.argv[1])
mlx_thread = sys.modules["mlx_thread"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mlx_thread)
generation_stream = mx.new_thread_local_stream(mx.default_device())  # as mlx-lm makes its own


def work() -> None:
    with mx.stream(generation_stream):
        a = mx.random.normal((128, 128))
        for _ in range(10):
            a = (a @ a) / 16
        mx.async_eval(a)  # a step left in flight, as decoding leaves one


thread = mlx_thread.MlxThread()
thread.start()
asyncio.run(thread.run(work))
thread.stop()
print("done")
"""
N_PROCESSES = 12


def test_processes_that_stop_the_mlx_thread_and_exit_at_once_never_abort() -> None:
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", EXIT_RIGHT_AFTER_STOP, str(MLX_THREAD_FILE)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(N_PROCESSES)
    ]
    outcomes = [(run.wait(timeout=120), *run.communicate()) for run in runs]
    assert outcomes == [(0, "done\n", "")] * N_PROCESSES
