"""`subagent doctor`: what mlx sees, and whether a model loads and answers."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from importlib.metadata import version
from typing import TYPE_CHECKING, Any

from ..errors import SubagentError
from ..host import DEFAULT_KV_BITS, GenerateArgs, MlxModelHost, drafts_said, host_kind, parse_draft
from ..host.calls.grammar import Grammars
from ..host.kv.budget import total_memory
from ..host.kv.kv_pool import KVShape, TurnSize, admission_bytes
from ..host.kv.prefix_files import list_prefixes, prefix_cache_dir
from ..host.mlx.prefill import describe
from ..host.mlx.resident import free_memory, residents
from ..host.scripted import ScriptedHost

if TYPE_CHECKING:
    from ..host.mlx.mlx_host import MemoryStats
    from ..host.protocol import Reply

Print = Callable[[str], None]
PROBE = [{"role": "user", "content": "Reply with one short sentence: are you ready?"}]
TOOL_MODES = {
    "native": "the chat template presents the tools; calls are read in the model's own format",
    "prompted": "the template drops tools; their list and a <tool_call> format go in the system prompt",
}


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def environment_lines() -> list[str]:
    import mlx.core as mx
    from mlx_lm import __version__ as mlx_lm_version

    return [
        f"python    {platform.python_version()} on {platform.system()} {platform.machine()}",
        f"mlx       {mx.__version__}  (mlx-lm {mlx_lm_version})",
        f"device    {mx.default_device()}",
        f"memory    {_gib(total_memory())} RAM",
    ]


# The tool the doctor's call grammar is compiled for: its first token can only open the call.
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "read",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}


def grammar_line(tokenizer: Any, kind: str | None, start: str, end: str) -> str:
    """Whether the grammar path works here, through the host's own `Grammars`: llguidance reads
    this model's vocabulary, compiles a call grammar in the model's format and masks its first
    token. Any failure is reported in the line, since calls then decode freely rather than fail."""
    if kind is None:
        return "grammar   none for this model's call format; tool calls and answers decode freely"
    try:
        prototype = Grammars(tokenizer, kind, start, end).calls([PROBE_TOOL])
        if prototype is None:
            raise RuntimeError("the probe's call grammar does not compile")
        allowed = int(prototype.first(prototype.vocab_size).sum().item())
        if not 0 < allowed < prototype.vocab_size:
            raise RuntimeError(f"the first token's mask allows {allowed} of {prototype.vocab_size} tokens")
    except Exception as exc:  # a broken grammar path is a finding, not a crash
        fix = ": `pip install 'llguidance>=1.9,<1.10'`" if isinstance(exc, ImportError) else ""
        return f"grammar   unavailable ({type(exc).__name__}: {exc}); tool calls and answers decode freely{fix}"
    return (
        f"grammar   llguidance {version('llguidance')}: a {kind} call grammar compiles for this vocabulary "
        f"({prototype.vocab_size} tokens) and masks its first token to {allowed} of them"
    )


def prefix_cache_line(bound: int) -> str:
    """Where the warm-start prefixes are, how much they hold and their bound (0: the tier is off)."""
    found = list_prefixes()
    held = f"{len(found)} prefixes, {sum(p.nbytes for p in found) / 2**20:.1f} MiB"
    limit = f"of at most {_gib(bound)}" if bound else "(off)"
    return f"prefixes  {prefix_cache_dir()}: {held} {limit}; `subagent cache` lists them"


def resident_lines() -> list[str]:
    """The server of the state folder, and the models other processes hold (their weights and KV
    budgets come off the RAM a new process sizes its budget from)."""
    from ..serve.state import running_server, serve_paths, status_line

    paths = serve_paths()
    server = running_server(paths, wait=0)
    lines = [status_line(paths)]
    for r in residents():
        who = "the server" if server is not None and r.pid == server.pid else f"pid {r.pid}"
        budget = _gib(r.kv_budget) if r.kv_budget else "unbounded"
        lines.append(f"resident  {who}: {r.model}, weights {_gib(r.weights_bytes)}, KV budget {budget}")
    ram = total_memory()
    lines.append(f"free      {_gib(free_memory(ram))} of {_gib(ram)} RAM once they are taken out")
    return lines


def kv_bits_lines(
    shapes: dict[int, KVShape | str], budget: int | None, window: int, trimmable: bool, running: int
) -> list[str]:
    """Per `--kv-bits` setting: bytes per token and how many sessions of the whole window the budget
    holds (as admission control counts one), or why the model cannot take it."""
    lines = []
    for bits, shape in shapes.items():
        head = f"kv bits   {bits:>2}: "
        if isinstance(shape, str):
            lines.append(f"{head}unavailable: {shape}")
            continue
        one = admission_bytes(shape, [TurnSize(window, window)], batched=False, trimmable=trimmable)
        fit = "unbounded budget" if budget is None else f"{budget // one} sessions of {window} tokens fit the budget"
        kind = f" (unquantized {shape.dtype}, the model's)" if shape.dtype else ""
        lines.append(f"{head}{shape.per_token} bytes/token{kind}, {fit}" + (" (this host)" if bits == running else ""))
    return lines


def check_script(model: str, context_window: int | None, say: Print) -> bool:
    """A `scripted:FILE` model: the file read and checked as a run reads it, and what it replays; there are
    no weights to load and no speed to time."""
    try:
        host = ScriptedHost.from_model_id(model, context_window=context_window)
    except SubagentError as exc:
        say(f"FAILED    {exc}")
        return False
    script = host.script
    counts = [f"{len(script.replies)} for any session"] if script.replies else []
    counts += [f"{len(s.replies)} for {name}" for name, s in (*script.agents.items(), *script.sessions.items())]
    say(f"loaded    {host.path}: scripted replies, {', '.join(counts)}; context window {host.context_window} tokens")
    say("reply     replayed, not generated: no weights, no device, nothing to time")
    say("ok")
    return True


async def run_doctor(
    model: str,
    context_window: int | None,
    say: Print,
    kv_budget: str | None = None,
    prefill_slice: str | None = None,
    kv_bits: int = DEFAULT_KV_BITS,
    draft: str | None = None,
) -> bool:
    """Print the checks; True when the model loaded and answered (a script: was read as a run reads it)."""
    for line in environment_lines() + resident_lines():
        say(line)
    say(f"model     {model}")
    if host_kind(model) == "scripted":
        return check_script(model, context_window, say)
    host = MlxModelHost(
        model,
        context_window=context_window,
        kv_budget=kv_budget,
        prefill_slice=prefill_slice or "auto",
        kv_bits=kv_bits,
        draft=parse_draft(draft),
    )
    tic = time.perf_counter()
    try:
        async with host:
            say(
                f"loaded    {host.model_path} in {time.perf_counter() - tic:.1f}s; context window {host.context_window} tokens"
            )
            say(f"tools     {host.tool_mode}: {TOOL_MODES[host.tool_mode]}")
            chat = host.chat
            say(grammar_line(host.tokenizer, chat.grammar_kind, chat.calls.start, chat.calls.end))
            reply = await host.session("doctor").generate(PROBE, GenerateArgs(max_tokens=32))
            stats = await host.memory_stats()
            shapes = await host.kv_shapes()
    except SubagentError as exc:
        say(f"FAILED    {exc}")
        return False
    say_measured(host, reply, stats, shapes, say)
    say("ok")
    return True


def say_measured(
    host: MlxModelHost, reply: Reply, stats: MemoryStats, shapes: dict[int, KVShape | str], say: Print
) -> None:
    """The probe's reply and what answering it measured: speed, drafts, the KV cache a session costs
    against its budget (at each `--kv-bits`), memory, the prefill slice and the prefix cache."""
    u = reply.usage
    say(f"reply     {reply.text.strip()[:120]!r}")
    say(
        f"speed     prompt {u.prompt_tokens} tokens in {u.prompt_seconds:.2f}s; {u.generated_tokens} tokens at {u.generation_tps:.1f} tok/s"
    )
    said = drafts_said(host.draft, host.drafting, u.drafted_tokens, u.accepted_tokens)
    say(f"drafts    {said}{' in the reply' if host.drafting else ''}")
    budget = "unbounded" if stats.kv_budget is None else _gib(stats.kv_budget)
    shape = host.kv_shape
    say(
        f"kv cache  {shape.per_token} bytes/token (+{shape.fixed} fixed) per session at {host.kv_bits} bits; budget "
        f"{budget} for {host.max_sessions} sessions; held now {stats.kv_bytes_total / 2**20:.2f} MiB"
    )
    for line in kv_bits_lines(shapes, stats.kv_budget, host.context_window, host.kv_trimmable, host.kv_bits):
        say(line)
    say(f"memory    mlx active {_gib(stats.active_memory)}, peak {_gib(stats.peak_memory)}")
    say(f"prefill   {describe(host.prefill_slice, host.prefill_step)}")
    say(prefix_cache_line(host.prefix_store.max_bytes if host.prefix_store else 0))
