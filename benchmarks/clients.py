"""Clients: K processes that each start one scout task at the same moment, attached to one `subagent
serve` or each standalone (a model of its own), side by side in one run.

For K = 1, 2 and 4 (`--clients`), the two ways take turns, each round on a fresh state folder:

- attached: `subagent serve --no-http --prefix-cache off` is started and listening (its model not
  loaded: the first client's request loads it, inside the timing), then K `subagent run scout TASK`
  processes start at once and attach to it;
- standalone: K `subagent run scout TASK --standalone --prefix-cache off` processes start at once,
  each loading the model itself.

Every task is `--max-turns 1 --max-tokens N` (`--tokens`) in a workspace of its own, with its own
task text. The disk tier of the prefix cache is off in both, so that no process warm-starts from
another's prefix file: what is compared is one process against K.

Per K and way it reports:

- `copies`: resident model copies, the most entries the machine's resident-model registry
  (`host/mlx/resident.py`) held at once during the round;
- `summed_peak_rss`: the peak resident memory of every process of the round (the server's too),
  summed (Linux: `VmHWM` from /proc, read until each process ends; elsewhere the highest RSS seen),
  and its parts: `server_peak_rss` (attached; None standalone) and `client_peak_rss` per client;
- `most_decoding`: the most sessions decoding in one batch: the server's (`serve --status`) when
  attached; standalone, 1 (each process holds one session: no batch spans processes);
- `wall_s`: from starting the first client process to the end of the last;
- `generated`: tokens generated per client (its `usage` event), and the clients' exit codes.

`--json`: the last line is one object with a row per K and the ratios attached/standalone of
summed peak RSS and wall time. Targets (issue 39): attached holds 1 copy and `most_decoding` == K at
K = 4; attached summed peak RSS at K = 4 at most 0.4x standalone on SmolLM2; attached wall at most
1.1x standalone on this CPU (on a Mac, one batch on one GPU is expected to beat four processes
taking turns on it). Missing a target still exits 0 (a measurement); errors exit nonzero.

Run (from the repository root; `nice -n 10` on a shared machine):

    python benchmarks/clients.py                    # tiny random qwen3, built in a temporary folder
    python benchmarks/clients.py --model smollm2 --tokens 32 --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
TASKS = [
    "Where is the configuration parsed? Name the file.",
    "Which module writes the log files? Name it.",
    "Where are the command line options declared?",
    "Which file holds the version number?",
]
POLL_S = 0.02


class Peaks:
    """The peak resident memory of processes, watched from a thread until they end."""

    def __init__(self) -> None:
        self.peak: dict[int, int] = {}
        self.copies = 0
        self._pids: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def watch(self, pid: int) -> None:
        self._pids.append(pid)

    def start(self, home: Path) -> None:
        self.home = home
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        from mlx_subagents.host.mlx.resident import resident_dir

        while not self._stop.is_set():
            for pid in list(self._pids):
                rss = peak_rss(pid)
                if rss is not None:
                    self.peak[pid] = max(self.peak.get(pid, 0), rss)
            folder = resident_dir(self.home)
            self.copies = max(self.copies, len(list(folder.glob("*.json"))) if folder.is_dir() else 0)
            time.sleep(POLL_S)


def peak_rss(pid: int) -> int | None:
    """The process's peak resident set so far (Linux `VmHWM`), else its resident set now; None: it ended."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return psutil.Process(pid).memory_info().rss
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def env_for(home: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "MLX_SUBAGENTS_HOME": str(home), "COLUMNS": "200"}


def client(model: str, home: Path, workspace: Path, task: str, tokens: int, standalone: bool) -> subprocess.Popen[str]:
    args = ["run", "scout", task, "--model", model, "-C", str(workspace), "--events"]
    args += ["--max-turns", "1", "--max-tokens", str(tokens)]
    if standalone:
        args += ["--standalone", "--prefix-cache", "off"]
    return subprocess.Popen(
        [sys.executable, "-m", "mlx_subagents.cli", *args],
        env=env_for(home),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def generated(out: str) -> int:
    """The tokens a client's task generated: its last `usage` event's count."""
    counts = [json.loads(line)["data"]["output_tokens"] for line in out.splitlines() if '"kind": "usage"' in line]
    return counts[-1] if counts else 0


def start_server(home: Path, peaks: Peaks) -> tuple[subprocess.Popen[str], Any]:
    from mlx_subagents.serve.state import running_server, serve_paths

    server = subprocess.Popen(
        [sys.executable, "-m", "mlx_subagents.cli", "serve", "--no-http", "--prefix-cache", "off"],
        env=env_for(home),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while (info := running_server(serve_paths(home), wait=0)) is None:
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start: {server.stderr.read() if server.stderr else ''}")
        time.sleep(0.05)
    peaks.watch(server.pid)
    return server, info


def round_of(k: int, model: str, work: Path, tokens: int, standalone: bool) -> dict[str, Any]:
    """K clients at once, attached to a new server or standalone: what they held and how long they took."""
    from mlx_subagents.serve.client import make_hello, quick

    home = work / f"{'standalone' if standalone else 'attached'}-{k}"
    peaks = Peaks()
    peaks.start(home)
    server = info = None
    if not standalone:
        server, info = start_server(home, peaks)
    workspaces = []
    for i in range(k):
        workspaces.append(home.parent / f"{home.name}-ws{i}")
        workspaces[-1].mkdir()
        (workspaces[-1] / "README.md").write_text(f"# project {i}\n")
    tic = time.perf_counter()
    clients = [client(model, home, workspaces[i], TASKS[i % len(TASKS)], tokens, standalone) for i in range(k)]
    for process in clients:
        peaks.watch(process.pid)
    outputs = [process.communicate() for process in clients]
    wall = time.perf_counter() - tic
    most = 1
    if server is not None:
        status = quick(info, make_hello("status"))["status"]
        # One session alone decodes outside mlx-lm's batch (the host's single path): a batch of one.
        most = max(max((m["most_decoding"] for m in status["models"]), default=0), 1)
        peak_server = peak_rss(server.pid)
        quick(info, make_hello("stop"))
        server.wait(60)
        if peak_server is not None:
            peaks.peak[server.pid] = max(peaks.peak.get(server.pid, 0), peak_server)
    peaks.stop()
    failed = [err.strip().splitlines()[-1:] for (_, err), p in zip(outputs, clients) if p.returncode not in (0, 1)]
    if failed:
        raise SystemExit(f"a client failed: {failed}")
    return {
        "copies": peaks.copies,
        "summed_peak_rss": sum(peaks.peak.values()),
        "server_peak_rss": peaks.peak.get(server.pid) if server is not None else None,
        "client_peak_rss": [peaks.peak.get(p.pid) for p in clients],
        "most_decoding": most,
        "wall_s": round(wall, 2),
        "generated": [generated(out) for out, _ in outputs],
        "exit_codes": [p.returncode for p in clients],
    }


def measure(model: str, work: Path, counts: Sequence[int], tokens: int) -> dict[str, Any]:
    rows = []
    for k in counts:
        attached = round_of(k, model, work, tokens, standalone=False)
        standalone = round_of(k, model, work, tokens, standalone=True)
        rows.append(
            {
                "k": k,
                "attached": attached,
                "standalone": standalone,
                "rss_ratio": round(attached["summed_peak_rss"] / standalone["summed_peak_rss"], 3),
                "wall_ratio": round(attached["wall_s"] / standalone["wall_s"], 3),
            }
        )
    return {"model": model, "tokens": tokens, "rows": rows}


def table(report: dict[str, Any]) -> str:
    lines = [
        f"model {report['model']}, {report['tokens']} tokens per client",
        f"{'K':>2}  {'way':<10} {'copies':>6} {'peak RSS (sum)':>15} {'most decoding':>13} {'wall s':>7}  generated",
    ]
    for row in report["rows"]:
        for way in ("attached", "standalone"):
            r = row[way]
            lines.append(
                f"{row['k']:>2}  {way:<10} {r['copies']:>6} {r['summed_peak_rss'] / 2**20:>11.0f} MiB "
                f"{r['most_decoding']:>13} {r['wall_s']:>7.2f}  {r['generated']}"
            )
        lines.append(f"    attached/standalone: peak RSS {row['rss_ratio']}x, wall {row['wall_ratio']}x")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local model folder or imported name (default: a tiny random qwen3)")
    parser.add_argument("--clients", default="1,2,4", help="the numbers of clients, comma-separated")
    parser.add_argument("--tokens", type=int, default=256, help="tokens each task may generate (--max-tokens)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    counts = [int(k) for k in args.clients.split(",")]
    with tempfile.TemporaryDirectory(prefix="clients-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            from mlx_subagents.testing import make_tiny_model

            model = str(make_tiny_model(work / "tiny", context_window=8192))
        elif not Path(model).expanduser().is_dir():
            from mlx_subagents.host.mlx.loading import resolve_model_path

            model = str(resolve_model_path(model))  # an imported name: its folder, the same in every home
        report = measure(model, work, counts, args.tokens)
    at_most = max(report["rows"], key=lambda r: r["k"])
    report["targets"] = {
        "one_copy_attached": all(r["attached"]["copies"] == 1 for r in report["rows"]),
        "most_decoding_is_k": at_most["attached"]["most_decoding"] == at_most["k"],
        "rss_ratio_at_most_0.4": at_most["rss_ratio"] <= 0.4,
        "wall_ratio_at_most_1.1": at_most["wall_ratio"] <= 1.1,
    }
    print(json.dumps(report) if args.json else table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
