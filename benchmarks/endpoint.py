"""Endpoint: K clients holding multi-turn conversations against `subagent serve`'s OpenAI endpoint and,
side by side in the same run, `mlx_lm.server` on the same model.

Each client holds one conversation: a system prompt of 1,600 words (the same for every client: about
3,500 tokens on the tiny model's byte-level tokenizer) and three tools, then `--turns` user messages of
80-240 words each, every reply (`--tokens` at most, temperature 0) sent
back with the next message, as a chat client does. For K = 1 and 4 (`--clients`) the clients run at
once, each server fresh (`subagent serve --port 0` with its own state folder; `python -m
mlx_lm.server`), through the official `openai` SDK, streamed with `include_usage`. Per server and K:

- `ttft_first_s`, `ttft_later_s`: the median time to the first token of turn 1 and of later turns
  (the first chunk carrying text, reasoning or a call, or the last one);
- `cached_later`: the share of later turns' prompt tokens the server says it had cached
  (`usage.prompt_tokens_details.cached_tokens`, which both report);
- `tok_s`: every client's generated tokens over the wall time of the whole round;
- `peak_rss`: the server process's peak resident memory (Linux `VmHWM`), and for subagent serve the
  model copies its resident-model registry held (`copies`);
- `by_turn`, the round turn by turn (the table's "by turn" lines): each turn's TTFTs (lowest, median,
  highest), its prompt tokens and how many of them the server prefilled, and how far apart its clients
  sent it: whether a shared system prompt was prefilled once or once per client, and whether a round's
  turns got their first tokens one after another or all after every prefill.

A server that answers its clients one after another also has their next turns sent one after another,
each while the others' prefills run; `--together` sends each later turn only once every client has its
reply to the turn before (a barrier), so both servers' later turns arrive together, as a round of
parallel sub-agents' or a benchmark's requests do: the case where oldest first gives first tokens after
one, two, three and four prefills and a padded batch gives all four after four.

Then the restart case, one client: two turns, the server stopped and started again on the same state
folder (its disk tier), the third turn: `ttft_restart_s` and `cached_restart` of that turn, and for
subagent serve the files its prefix folder holds after (`prefix_files`: the system prompt's and one of
the conversation's, each turn's file replacing the last).

Where a later turn's time goes, at one client: both servers cache the conversation, so both prefill
the same new tokens (the user message, and what of the reply the cache lacks) before its first token.
Right after each later turn (the server idle, the round's clock stopped) this process prefills that
turn's new tokens over its cached ones itself (mlx-lm's own model and `KVCache`, the last position's
logits evaluated; the median of three), so both are timed under the same load: `prefill_later_s` is
its median, `overhead_later_s` the median of TTFT minus it (request parsing, the template, tokenizing,
admission, the first token's way out), and `ttft_later_floor` what the ratio would be with no overhead
at all on subagent serve: its prefill over mlx_lm.server's TTFT. That rest is split again
(`rest_parts`): `unseen_later`, the tokens a reply decoded before its first streamed text (its completion
tokens less its text's: a leading newline a server strips, each a decode step the client waits for),
`step_later_s`, a decode step as the client sees it (the median gap between text chunks), and
`other_later_s`, the rest less those steps.

Targets (issue 64), on the tiny model and SmolLM2: later turns' cached share >= 0.9 on subagent serve;
its later turns' TTFT <= 0.3x mlx_lm.server's; its throughput at 4 clients >= 1.5x; one model copy.
mlx_lm.server keeps a prompt cache of its own (`LRUPromptCache`, by content), so its later turns are
cached too; what differs is how turns of several clients share the model. So a second line checks the
TTFT targets restated against such a server (docs/benchmarks.md says why): <= 1.0x at one client,
<= 0.7x at four, <= 0.3x for the restarted server's turn (`restated_targets` in `--json`). `--json` prints one object
as the last line. Missing a target still exits 0 (a measurement).

Run (from the repository root; `nice -n 10` on a shared machine):

    python benchmarks/endpoint.py                       # tiny random qwen3, built in a temporary folder
    python benchmarks/endpoint.py --model smollm2 --turns 3 --tokens 16 --json     # a Mac

On a Linux CPU a 4-bit model prefills a few tokens a second (mlx's quantized matmul there is a plain
loop, and its wheel's BLAS the reference one): serve a float32 copy (`--dequantize`, both servers load
it) through OpenBLAS (Debian's libopenblas0-pthread), and split the run in two if it is long:

    export LD_PRELOAD=/lib/x86_64-linux-gnu/libopenblas.so.0
    python benchmarks/endpoint.py --model smollm2 --dequantize --clients 1 --turns 3 --tokens 16 --json
    python benchmarks/endpoint.py --model smollm2 --dequantize --clients 4 --turns 3 --tokens 16 --no-restart --json

The table's second line names the BLAS libraries the servers mapped and `LD_PRELOAD`.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.clients import peak_rss  # noqa: E402
from benchmarks.workload import make_parser, run_report  # noqa: E402

WORDS = (
    "the a service request handler config module test file function returns value error cache user token "
    "session database query index route server client parse read write update delete list item name path "
    "line code review change commit branch build deploy log metric time memory budget batch model prompt"
).split()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')} in the project.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
    for name in ("read_file", "list_folder", "search_code")
]
START_S = 300.0


def text(rng: random.Random, n_words: int) -> str:
    """Sentences of the word list: as many tokens as words, about, on a byte-level BPE."""
    words = [rng.choice(WORDS) for _ in range(n_words)]
    return " ".join(" ".join(words[i : i + 12]).capitalize() + "." for i in range(0, len(words), 12))


def conversation(seed: int, turns: int, system_words: int = 1600) -> tuple[str, list[str]]:
    """A system prompt of `system_words` words and `turns` user messages of 80-240 words."""
    rng = random.Random(seed)
    system = "You are a code assistant for one project. " + text(random.Random(0), system_words)  # every client's
    return system, [f"Question {i + 1}: " + text(rng, rng.randint(80, 240)) for i in range(turns)]


class Server:
    """One server process on a free port: subagent serve (its state folder `home`) or mlx_lm.server."""

    def __init__(self, kind: str, model: str, home: Path) -> None:
        self.kind, self.model, self.home = kind, model, home
        env = {**os.environ, "PYTHONPATH": str(REPO), "MLX_SUBAGENTS_HOME": str(home)}
        if kind == "subagent":
            self.name = model
            cmd = [sys.executable, "-m", "mlx_subagents.cli", "serve", "--port", "0", "--model", model]
        else:
            self.name = model
            self.port = free_port()
            cmd = [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(self.port)]
        home.mkdir(parents=True, exist_ok=True)
        self.log = home / f"{kind}.log"  # a file, not a pipe: a full pipe nobody reads stops the server
        with self.log.open("a") as log:
            self.process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self.base, self.key = self._wait()
        self.blas = blas_libraries(self.process.pid)
        self.peak = 0
        self._watching = True
        self._watch = threading.Thread(target=self._watch_rss, daemon=True)
        self._watch.start()

    def _wait(self) -> tuple[str, str]:
        import openai

        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"{self.kind} exited: {self.log.read_text()[-2000:]}")
            try:
                base, key = self._address()
                if self.kind != "subagent":  # its /v1/models fails without a hub cache: /health says it is up
                    with urllib.request.urlopen(base.removesuffix("/v1") + "/health", timeout=5):
                        return base, key
                client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=5)
                if any(m.id == self.name for m in client.models.list()):
                    return base, key
            except Exception:
                pass
            time.sleep(0.2)
        raise SystemExit(f"{self.kind} did not start within {START_S:.0f} s")

    def _address(self) -> tuple[str, str]:
        if self.kind != "subagent":
            return f"http://127.0.0.1:{self.port}/v1", "none"
        from mlx_subagents.serve.state import read_info, serve_paths

        paths = serve_paths(self.home)
        info = read_info(paths)
        if info is None or info.url is None:
            raise RuntimeError("not yet")
        return info.url.removesuffix("/mcp") + "/v1", paths.token.read_text().strip()

    def _watch_rss(self) -> None:
        while self._watching:
            self.peak = max(self.peak, peak_rss(self.process.pid) or 0)
            time.sleep(0.05)

    def copies(self) -> int | None:
        """Model copies of the machine's resident-model registry under this state folder (subagent serve)."""
        if self.kind != "subagent":
            return None
        return len(list((self.home / "resident").glob("*.json")))

    def stop(self) -> None:
        self.peak = max(self.peak, peak_rss(self.process.pid) or 0)
        copies = self.copies()
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._watching = False
        self.stopped_copies = copies


def blas_libraries(pid: int) -> list[str]:
    """The BLAS libraries process `pid` has mapped (Linux; none elsewhere): on a CPU a float32 model's
    speed is the BLAS's, and mlx's Linux wheel bundles the reference one (`LD_PRELOAD` an optimized
    one to have its symbols win)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    return sorted({Path(line.split()[-1]).name for line in maps.splitlines() if "blas" in line.rsplit("/", 1)[-1]})


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def turn(client: Any, model: str, messages: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """One streamed turn: time to the first token, usage, and the reply as the next request sends it."""
    tic = time.perf_counter()
    first = None
    content, calls, usage, finish, shown = "", [], None, None, []
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            said = delta.content or getattr(delta, "reasoning_content", None) or getattr(delta, "reasoning", None)
            if first is None and (said or delta.tool_calls or choice.finish_reason):
                first = time.perf_counter() - tic
            if delta.content:
                shown.append(time.perf_counter() - tic)
            finish = choice.finish_reason or finish
            content += delta.content or ""
            calls += delta.tool_calls or []
    assert usage is not None, "no usage in the stream"
    reply: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        reply["tool_calls"] = [{"id": c.id or f"call_{i}", "type": "function", "function": {"name": c.function.name,
                               "arguments": c.function.arguments or "{}"}} for i, c in enumerate(calls)]  # fmt: skip
    cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
    gaps = [b - a for a, b in zip(shown, shown[1:])]
    return {"ttft": first or 0.0, "prompt": usage.prompt_tokens, "cached": cached,
            "generated": usage.completion_tokens, "reply": reply, "finish": finish,
            "step": statistics.median(gaps) if gaps else None}  # fmt: skip


def follow(messages: list[dict[str, Any]], reply: dict[str, Any], user: str) -> None:
    """The reply and, after any calls' results, the next user message."""
    messages.append(reply)
    for call in reply.get("tool_calls", []):
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": "done"})
    messages.append({"role": "user", "content": user})


def chat(
    server: Server,
    seed: int,
    turns: int,
    tokens: int,
    words: int,
    out: list[dict[str, Any]],
    prefill: Prefill | None,
    start: float,
    together: threading.Barrier | None = None,
) -> None:
    """One client's whole conversation; with `prefill`, each later turn's prefill timed here right after it
    (`paused`: the round's clock stops meanwhile); with `together`, each later turn sent once every client
    has its reply to the turn before. Each row says when its request was sent (`sent`, seconds after the
    round's `start`, a `perf_counter`), for the rounds' breakdown."""
    import openai

    client = openai.OpenAI(base_url=server.base, api_key=server.key, max_retries=0, timeout=3600)
    system, users = conversation(seed, turns, words)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": users[0]}]
    for i in range(turns):
        if together is not None and i > 0:
            together.wait()
        sent = time.perf_counter() - start
        done = turn(client, server.name, messages, tokens)
        row = {"client": seed, "turn": i, "sent": sent, **{k: v for k, v in done.items() if k != "reply"}}
        if prefill is not None and i > 0:
            tic = time.perf_counter()
            row["prefill"] = prefill.seconds(done["cached"], done["prompt"] - done["cached"])
            row["unseen"] = prefill.unseen(done)
            row["paused"] = time.perf_counter() - tic
        out.append(row)
        if i + 1 < turns:
            follow(messages, done["reply"], users[i + 1])


class Prefill:
    """The model in this process, to time a later turn's prefill as any server must do it: `seconds(cached,
    new)`, the median of three. The tokens' values do not change the work, so one cache is filled once,
    then cut back or filled further (untimed) to each start."""

    def __init__(self, model: str) -> None:
        from mlx_lm import load
        from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

        self.model, self.tokenizer = load(model)[:2]
        self.cache = make_prompt_cache(self.model)
        self._forward(64)  # the first forward also allocates: not timed
        trim_prompt_cache(self.cache, 64)

    def _forward(self, n: int, logits: bool = False) -> None:
        """`n` tokens into the cache (varied ids: a random model fed one id over and over may compute on
        denormals); `logits`: the last one's logits too, as a first token needs."""
        import mlx.core as mx

        start = self.cache[0].offset
        out = self.model(mx.array([[(start + i) * 7919 % 1000 + 10 for i in range(n)]]), cache=self.cache)
        mx.eval(out[:, -1] if logits else [c.state for c in self.cache])

    def unseen(self, done: dict[str, Any]) -> int | None:
        """The tokens of a reply cut at its length that its streamed text does not show (whitespace a server
        strips, such as SmolLM2's "\\n" before its answer when tools are described in its prompt): each is a
        decode step before the first text. None where it cannot be told (a call, or an end token counted)."""
        reply = done["reply"]
        if done["finish"] != "length" or reply.get("tool_calls") or not reply["content"]:
            return None
        return max(0, done["generated"] - len(self.tokenizer.encode(reply["content"], add_special_tokens=False)))

    def seconds(self, cached: int, new: int) -> float:
        from mlx_lm.models.cache import trim_prompt_cache

        held = self.cache[0].offset
        if held > cached:
            trim_prompt_cache(self.cache, held - cached)
        for start in range(held, cached, 512):
            self._forward(min(512, cached - start))
        times = []
        for _ in range(3):
            tic = time.perf_counter()
            if new > 1:  # as a server does: all but the last token into the cache, then the last one's logits
                self._forward(new - 1)
            self._forward(1, logits=True)
            times.append(time.perf_counter() - tic)
            trim_prompt_cache(self.cache, new)
        return statistics.median(times)


def round_of(
    kind: str,
    model: str,
    work: Path,
    k: int,
    turns: int,
    tokens: int,
    words: int,
    prefill: Prefill | None = None,
    together: bool = False,
) -> dict[str, Any]:
    server = Server(kind, model, work / f"{kind}-{k}")
    rows: list[dict[str, Any]] = []
    barrier = threading.Barrier(k) if together and k > 1 else None
    tic = time.perf_counter()
    threads = [
        threading.Thread(target=chat, args=(server, i, turns, tokens, words, rows, prefill, tic, barrier))
        for i in range(k)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - tic - sum(r.get("paused", 0.0) for r in rows)
    server.stop()
    later = [r for r in rows if r["turn"] > 0]
    timed = [r for r in later if "prefill" in r]
    return {
        "ttft_first_s": round(statistics.median(r["ttft"] for r in rows if r["turn"] == 0), 3),
        "ttft_later_s": round(statistics.median(r["ttft"] for r in later), 3) if later else None,
        "cached_later": round(sum(r["cached"] for r in later) / max(1, sum(r["prompt"] for r in later)), 3),
        "tok_s": round(sum(r["generated"] for r in rows) / wall, 2),
        "wall_s": round(wall, 2),
        "peak_rss": server.peak,
        "copies": server.stopped_copies,
        "blas": server.blas,
        "prompt_tokens": [r["prompt"] for r in rows],
        "by_turn": by_turn(rows, turns),
        **(
            {
                "new_later": statistics.median(r["prompt"] - r["cached"] for r in timed),
                "prefill_later_s": round(statistics.median(r["prefill"] for r in timed), 3),
                "overhead_later_s": round(statistics.median(r["ttft"] - r["prefill"] for r in timed), 3),
                **rest_parts(timed),
            }
            if timed
            else {}
        ),
    }


def rest_parts(timed: list[dict[str, Any]]) -> dict[str, Any]:
    """The rest of later turns' TTFT (TTFT less the prefill timed here) in parts: `unseen_later`, the tokens
    decoded before the first streamed text (`Prefill.unseen`, median); `step_later_s`, a decode step (the
    median gap between streamed text chunks, one token each at one client); `other_later_s`, the rest less
    those steps (parsing, the template, admission, the way out, and what a step costs the first token more
    than the prefill's last forward)."""
    known = [r for r in timed if r.get("unseen") is not None and r.get("step") is not None]
    if not known:
        return {}
    return {
        "unseen_later": statistics.median(r["unseen"] for r in known),
        "step_later_s": round(statistics.median(r["step"] for r in known), 3),
        "other_later_s": round(statistics.median(r["ttft"] - r["prefill"] - r["unseen"] * r["step"] for r in known), 3),
    }


def by_turn(rows: list[dict[str, Any]], turns: int) -> list[dict[str, Any]]:
    """Each turn of the conversations (turn 1: every client's first, ...): its TTFTs (lowest, median,
    highest), the prompt tokens its requests sent and how many of them the server prefilled (not cached),
    and the spread of their arrivals (seconds from the first request sent of that turn to the last)."""
    out = []
    for i in range(turns):
        mine = [r for r in rows if r["turn"] == i]
        ttfts = sorted(r["ttft"] for r in mine)
        out.append({
            "turn": i + 1,
            "ttft_s": [round(ttfts[0], 3), round(statistics.median(ttfts), 3), round(ttfts[-1], 3)],
            "prompt": sum(r["prompt"] for r in mine),
            "prefilled": sum(r["prompt"] - r["cached"] for r in mine),
            "arrivals_s": round(max(r["sent"] for r in mine) - min(r["sent"] for r in mine), 3),
        })  # fmt: skip
    return out


def restart_case(kind: str, model: str, work: Path, tokens: int, words: int) -> dict[str, Any]:
    """Two turns, a restart on the same state folder, the third turn."""
    import openai

    home = work / f"{kind}-restart"
    system, users = conversation(99, 3, words)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": users[0]}]
    server = Server(kind, model, home)
    client = openai.OpenAI(base_url=server.base, api_key=server.key, max_retries=0, timeout=3600)
    for i in range(2):
        follow(messages, turn(client, server.name, messages, tokens)["reply"], users[i + 1])
    server.stop()
    server = Server(kind, model, home)
    client = openai.OpenAI(base_url=server.base, api_key=server.key, max_retries=0, timeout=3600)
    after = turn(client, server.name, messages, tokens)
    server.stop()
    files = len(list((home / "cache" / "prefixes").glob("*.safetensors"))) if kind == "subagent" else None
    return {
        "ttft_restart_s": round(after["ttft"], 3),
        "cached_restart": round(after["cached"] / after["prompt"], 3),
        "prefix_files": files,
    }


def measure(
    model: str,
    work: Path,
    counts: Sequence[int],
    turns: int,
    tokens: int,
    words: int,
    restart: bool = True,
    together: bool = False,
) -> dict[str, Any]:
    report: dict[str, Any] = {"model": model, "turns": turns, "tokens": tokens, "system_words": words, "rows": []}
    report["together"] = together
    report["ld_preload"] = os.environ.get("LD_PRELOAD")
    prefill = Prefill(model) if 1 in counts else None  # one client: a later turn's TTFT is its own work
    for k in counts:
        row: dict[str, Any] = {"k": k}
        for kind in ("subagent", "mlx_lm"):
            row[kind] = round_of(kind, model, work, k, turns, tokens, words, prefill if k == 1 else None, together)
        ours, theirs = row["subagent"], row["mlx_lm"]
        row["ttft_later_ratio"] = (
            round(ours["ttft_later_s"] / theirs["ttft_later_s"], 3) if theirs["ttft_later_s"] else None
        )
        if "prefill_later_s" in ours and theirs["ttft_later_s"]:
            row["ttft_later_floor"] = round(ours["prefill_later_s"] / theirs["ttft_later_s"], 3)
        row["tok_s_ratio"] = round(ours["tok_s"] / theirs["tok_s"], 3) if theirs["tok_s"] else None
        report["rows"].append(row)
    kinds = ("subagent", "mlx_lm") if restart else ()
    report["restart"] = {kind: restart_case(kind, model, work, tokens, words) for kind in kinds}
    at_most = max(report["rows"], key=lambda r: r["k"])
    report["targets"] = {
        "cached_later_at_least_0.9": all(r["subagent"]["cached_later"] >= 0.9 for r in report["rows"]),
        "ttft_later_at_most_0.3x": all((r["ttft_later_ratio"] or 9) <= 0.3 for r in report["rows"]),
        "tok_s_at_4_at_least_1.5x": (at_most["tok_s_ratio"] or 0) >= 1.5 if at_most["k"] >= 4 else None,
        "one_copy": all(r["subagent"]["copies"] == 1 for r in report["rows"]),
    }
    report["restated_targets"] = restated_targets(report)
    return report


def restated_targets(report: dict[str, Any]) -> dict[str, bool | None]:
    """The later turns' TTFT targets against a server that caches by content too (docs/benchmarks.md):
    parity at one client, 0.7x at four whose turns arrive together, 0.3x for a restarted server's turn;
    printed beside the issue's 0.3x, which stays as filed. None: that case was not run."""
    ratio = {r["k"]: r["ttft_later_ratio"] for r in report["rows"]}
    restart = report["restart"]
    return {
        "ttft_later_at_1_at_most_1.0x": (ratio[1] or 9) <= 1.0 if 1 in ratio else None,
        "ttft_later_at_4_at_most_0.7x": (ratio[4] or 9) <= 0.7 if 4 in ratio else None,
        "ttft_restart_at_most_0.3x": (
            restart["subagent"]["ttft_restart_s"] <= 0.3 * restart["mlx_lm"]["ttft_restart_s"] if restart else None
        ),
    }


def table(report: dict[str, Any]) -> str:
    blas = sorted({name for row in report["rows"] for kind in ("subagent", "mlx_lm") for name in row[kind]["blas"]})
    lines = [
        f"model {report['label']}, a system prompt of {report['system_words']} words, {report['turns']} turns of at most "
        f"{report['tokens']} tokens per client"
        + (", each later turn sent once every client had its reply (--together)" if report.get("together") else ""),
        f"BLAS mapped by the servers: {', '.join(blas) or '?'}; LD_PRELOAD={report['ld_preload'] or '(none)'}",
        f"{'K':>2}  {'server':<9} {'TTFT 1st':>9} {'TTFT later':>10} {'cached later':>12} {'tok/s':>7} "
        f"{'peak RSS':>9} copies",
    ]
    for row in report["rows"]:
        for kind in ("subagent", "mlx_lm"):
            r = row[kind]
            lines.append(
                f"{row['k']:>2}  {kind:<9} {r['ttft_first_s']:>8.2f}s {r['ttft_later_s']:>9.2f}s {r['cached_later']:>12.3f} "
                f"{r['tok_s']:>7.1f} {r['peak_rss'] / 2**20:>5.0f} MiB {r['copies'] if r['copies'] is not None else '-'}"
            )
        lines.append(f"    subagent/mlx_lm: TTFT later {row['ttft_later_ratio']}x, tok/s {row['tok_s_ratio']}x")
        for kind in ("subagent", "mlx_lm"):
            turns = "; ".join(
                f"{t['turn']}: TTFT {t['ttft_s'][0]:.2f}/{t['ttft_s'][1]:.2f}/{t['ttft_s'][2]:.2f}s, prefilled "
                f"{t['prefilled']} of {t['prompt']}, sent within {t['arrivals_s']:.2f}s"
                for t in row[kind]["by_turn"]
            )
            lines.append(f"    {kind} by turn (TTFT lowest/median/highest): {turns}")
        ours, theirs = row["subagent"], row["mlx_lm"]
        if "prefill_later_s" in ours and "prefill_later_s" in theirs:
            each = ", ".join(
                f"{kind} {row[kind]['prefill_later_s'] * 1e3:.0f} ms + {row[kind]['overhead_later_s'] * 1e3:.0f} ms"
                for kind in ("subagent", "mlx_lm")
            )
            lines.append(
                f"    later turns: {ours['new_later']:.0f} new tokens (median); prefill (timed here after each turn) "
                f"+ the rest of TTFT: {each}; with no rest at all on subagent: {row['ttft_later_floor']}x"
            )
            if "unseen_later" in ours and "unseen_later" in theirs:
                parts = ", ".join(
                    f"{kind} {row[kind]['unseen_later']:.0f} x {row[kind]['step_later_s'] * 1e3:.0f} ms + "
                    f"{row[kind]['other_later_s'] * 1e3:.0f} ms"
                    for kind in ("subagent", "mlx_lm")
                )
                lines.append(f"    the rest: tokens before the first text x a decode step + the other: {parts}")
    for kind, r in report["restart"].items():
        files = f", {r['prefix_files']} prefix files after" if r.get("prefix_files") is not None else ""
        lines.append(
            f"restart {kind:<9} third turn: TTFT {r['ttft_restart_s']:.2f}s, cached {r['cached_restart']:.3f}{files}"
        )
    for title, key in (("targets", "targets"), ("restated (docs/benchmarks.md)", "restated_targets")):
        lines.append(
            f"{title}: "
            + ", ".join(
                f"{name} {'not run' if ok is None else 'met' if ok else 'MISSED'}" for name, ok in report[key].items()
            )
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__ or "")
    parser.add_argument("--clients", default="1,4", help="the numbers of clients, comma-separated")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--tokens", type=int, default=32, help="tokens a reply may have")
    parser.add_argument("--system-words", type=int, default=1600, help="words of the system prompt every client sends")
    parser.add_argument(
        "--restart",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the restart case after the rounds (--no-restart: the rounds only, to split a slow run in two)",
    )
    parser.add_argument(
        "--together",
        action="store_true",
        help="send each later turn once every client has its reply to the turn before (turns that arrive together)",
    )
    args = parser.parse_args(argv)
    counts = [int(k) for k in args.clients.split(",")]

    def run(model: Path, label: str) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="endpoint-") as tmp:
            return {
                "label": label,
                **measure(
                    str(model),
                    Path(tmp),
                    counts,
                    args.turns,
                    args.tokens,
                    args.system_words,
                    args.restart,
                    args.together,
                ),
            }

    return run_report(args, run, lambda report: print(table(report)), context_window=8192)


if __name__ == "__main__":
    sys.exit(main())
