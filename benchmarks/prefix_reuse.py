"""Prefix reuse: how much prefill a session's own KV cache saves over an agent-like conversation.

One session plays N agent turns (default 8) twice, side by side in one process run:

- with reuse (`MlxModelHost(path)`): each turn prefills only what is new since the last one;
- without reuse (`MlxModelHost(path, reuse=False)`): the same prompts, the cache dropped each turn.

Each turn the model replies with a tool call (`grep` / `read`; the last reply is a final answer)
and the conversation then gets a tool result of a few hundred tokens: generated, numbered code
lines in the `read` / `grep` output layout, different per turn and deterministic. The system
prompt is the built-in scout agent's, as a real session renders it, and the tools are the real
schemas from `mlx_subagents.tools`. On the tiny model the replies are forced through the real
inference path (`ForcedScripts`), so both modes see exactly the same prompts; the script also
checks that every turn's generated token ids are identical between the two modes.

It reports prefilled / cached / prompt tokens per turn and in total, and each mode's wall time
(`time.perf_counter` around the whole conversation, after one untimed warm-up generate per
host). Target: with reuse, prefill at most 35% of the tokens prefilled without it
(`prefill_ratio <= 0.35`) with identical outputs. Missing the target still exits 0 (this is a
measurement); errors exit nonzero.

Run (from the repository root):

    python benchmarks/prefix_reuse.py                      # tiny random qwen3, 8 turns, a table
    python benchmarks/prefix_reuse.py --arch qwen3_5       # hybrid model (non-trimmable cache)
    python benchmarks/prefix_reuse.py --json               # the last line is one JSON object
    python benchmarks/prefix_reuse.py --thinking           # a Qwen3.5-style thinking template: each
                                                           # reply thinks first (reasoning_content back)
    python benchmarks/prefix_reuse.py --model ~/models/Qwen3-4B-Instruct-2507-4bit

On a Mac (Metal) `pip install -e .` (or `PYTHONPATH=.`) is all it needs; use `--model` with a
local mlx-lm folder to measure a real model (the two modes run one after the other, so only one
copy of the weights is resident). With a real model the replies are forced too when its
host parses the Hermes `<tool_call>` format (prompted mode, Qwen); otherwise (or with `--free`) it generates
greedily, up to 64 tokens a turn.

On Linux the `mlx[cpu]` wheel runs fp32 matmul through a slow reference BLAS. Optionally
preload Debian's OpenBLAS (`apt-get install libopenblas0-pthread`) for much faster fp32 prefill:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/prefix_reuse.py
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workload import (
    CallPlanner,
    PlannedCall,
    Report,
    can_force,
    make_parser,
    model_arch,
    run_report,
    scout_prompt,
    tool_message,
)

from mlx_subagents.host import GenerateArgs, MlxModelHost, Reply
from mlx_subagents.host.protocol import DEFAULT_CONTEXT_WINDOW, Message, ToolSchema
from mlx_subagents.testing import ForcedScripts, LogitsProcessor
from mlx_subagents.tools import TOOL_NAMES, Workspace

TARGET_PREFILL_RATIO = 0.35
SESSION = "scout"
FORCED_MAX_TOKENS = 256  # room for the longest forced script (the final answer)
FREE_MAX_TOKENS = 64
TINY_CONTEXT_WINDOW = DEFAULT_CONTEXT_WINDOW  # trained for the host's default window: served whole
TASK = "Task: where is the configuration loaded and validated, and which settings does it read?"
# A fixed (not necessarily existing) root: the system prompt names it, so token counts are stable.
WORKSPACE = Workspace(Path(tempfile.gettempdir()) / "prefix-reuse-project")

_FILES = (
    "mlx_subagents/config.py", "mlx_subagents/settings.py", "mlx_subagents/cli.py",
    "mlx_subagents/runner.py", "mlx_subagents/profiles.py", "mlx_subagents/env.py",
    "tests/test_config.py", "tests/test_settings.py",
)  # fmt: skip


@dataclass(frozen=True)
class Conversation:
    """Everything both modes replay: opening messages, tools, calls and the final answer."""

    opening: list[Message]
    tools: list[ToolSchema]
    calls: list[PlannedCall]
    final_answer: str
    thinking: bool = False

    @property
    def scripts(self) -> list[str]:
        """The reply forced at each turn: every call's text, then the final answer (each after a
        thought closing the one the thinking template's generation prompt opened)."""
        replies = [c.text for c in self.calls] + [self.final_answer]
        if not self.thinking:
            return replies
        return [
            f"Turn {i + 1}: what I know so far, and which file to look at next.\n</think>\n\n{r}"
            for i, r in enumerate(replies)
        ]


@dataclass(frozen=True)
class ModeRun:
    """One mode's conversation: its replies and timings."""

    replies: list[Reply]
    turn_seconds: list[float]
    seconds: float


# -- the conversation ------------------------------------------------------------------------


def final_answer(calls: Sequence[PlannedCall]) -> str:
    """A scout-format answer naming the files that were read."""
    read = [c.arguments for c in calls if c.name == "read"] or [{"path": _FILES[0], "offset": 1, "limit": 40}]
    findings = [
        f"- {a['path']}:{a['offset']}-{a['offset'] + a['limit'] - 1} — where the settings are read" for a in read[:3]
    ]
    summary = "Summary: the configuration is loaded by load_config and validated by validate_settings."
    return "Findings:\n" + "\n".join(findings) + "\n\n" + summary


def build_conversation(turns: int, result_lines: int, thinking: bool = False) -> Conversation:
    """The scout agent's real system prompt and tool schemas, `turns - 1` calls, then an answer."""
    system, tools = scout_prompt(WORKSPACE, TOOL_NAMES)
    opening = [system, {"role": "user", "content": TASK}]
    calls = CallPlanner(_FILES, "mlx_subagents", result_lines, detailed=True).plan_session(0, turns - 1)
    return Conversation(opening, tools, calls, final_answer(calls), thinking)


# -- running one mode ------------------------------------------------------------------------


class ScriptedReplies:
    """Processor factory that forces the conversation's replies once bound to a tokenizer.

    The host loads its tokenizer in `start`, after the factory is handed over: `bind` then
    decides whether the host parses the scripts (the Hermes `<tool_call>` format).
    """

    def __init__(self, scripts: list[str], allow: bool) -> None:
        self._scripts = scripts
        self._allow = allow
        self._forced: ForcedScripts | None = None

    def bind(self, host: MlxModelHost) -> bool:
        """Whether the replies will be forced on this host."""
        ok = self._allow and can_force(host)
        self._forced = ForcedScripts(host.tokenizer, {SESSION: self._scripts}) if ok else None
        return ok

    def __call__(self, session: str, prompt_ids: list[int]) -> list[LogitsProcessor]:
        return self._forced(session, prompt_ids) if self._forced else []


async def warm_up(host: MlxModelHost, conv: Conversation) -> None:
    """One untimed generate of a first-turn-sized prompt on a throwaway session (loads kernels,
    allocates buffers). It has no system message, so the host stores no shared system-prompt
    prefix from it: the timed session starts cold and measures its own reuse only."""
    session = host.session("warm-up")
    await session.generate(conv.opening[1:], GenerateArgs(max_tokens=8), tools=conv.tools)
    await session.close()


async def run_mode(model: Path, reuse: bool, conv: Conversation, force: bool) -> tuple[ModeRun, bool]:
    """Play the conversation on a fresh host; returns the run and whether replies were forced."""
    forcing = ScriptedReplies(conv.scripts, allow=force)
    # No disk tier: a previous run's prefix file would make the first turn warm.
    async with MlxModelHost(str(model), reuse=reuse, processor_factory=forcing, prefix_cache=0) as host:
        forced = forcing.bind(host)
        max_tokens = FORCED_MAX_TOKENS if forced else FREE_MAX_TOKENS
        await warm_up(host, conv)
        session = host.session(SESSION)
        messages = list(conv.opening)
        replies, turn_seconds = [], []
        start = time.perf_counter()
        for turn in range(len(conv.calls) + 1):
            tic = time.perf_counter()
            reply = await session.generate(messages, GenerateArgs(max_tokens=max_tokens), tools=conv.tools)
            turn_seconds.append(time.perf_counter() - tic)
            replies.append(reply)
            if turn < len(conv.calls):
                messages += [
                    reply.to_message(),
                    tool_message(reply, conv.calls[turn].name, conv.calls[turn].result),
                ]
        seconds = time.perf_counter() - start
    return ModeRun(replies, turn_seconds, seconds), forced


# -- reporting -------------------------------------------------------------------------------


def reply_kind(reply: Reply) -> str:
    """`grep` / `read` for a tool call, `answer` for plain text, `malformed`, `length`."""
    if reply.tool_calls:
        return ",".join(c.name for c in reply.tool_calls)
    if reply.malformed_tool_calls:
        return "malformed"
    return "answer" if reply.finish_reason == "stop" else reply.finish_reason


def summarize(arch: str, model: str, forced: bool, with_reuse: ModeRun, without: ModeRun) -> dict[str, Any]:
    """The JSON report: totals, ratios, target and per-turn lists."""
    on, off = with_reuse.replies, without.replies
    prefill_on = sum(g.usage.prefilled_tokens for g in on)
    prefill_off = sum(g.usage.prefilled_tokens for g in off)
    identical = len(on) == len(off) and all(a.token_ids == b.token_ids for a, b in zip(on, off))
    ratio = prefill_on / prefill_off if prefill_off else 0.0
    return {
        "arch": arch,
        "model": model,
        "turns": len(on),
        "forced": forced,
        "prompt_tokens_total": sum(g.usage.prompt_tokens for g in on),
        "prefill_tokens_with_reuse": prefill_on,
        "prefill_tokens_without_reuse": prefill_off,
        "cached_tokens_with_reuse": sum(g.usage.cached_tokens for g in on),
        "generated_tokens_total": sum(g.usage.generated_tokens for g in on),
        "prefill_ratio": round(ratio, 4),
        "seconds_with_reuse": round(with_reuse.seconds, 4),
        "seconds_without_reuse": round(without.seconds, 4),
        "speedup": round(without.seconds / with_reuse.seconds, 3) if with_reuse.seconds else 0.0,
        "identical_outputs": identical,
        "target_prefill_ratio": TARGET_PREFILL_RATIO,
        "target_met": identical and ratio <= TARGET_PREFILL_RATIO,
        "per_turn": {
            "reply": [reply_kind(g) for g in on],
            "prompt_tokens": [g.usage.prompt_tokens for g in on],
            "prompt_tokens_without_reuse": [g.usage.prompt_tokens for g in off],
            "cached_tokens_with_reuse": [g.usage.cached_tokens for g in on],
            "prefill_tokens_with_reuse": [g.usage.prefilled_tokens for g in on],
            "prefill_tokens_without_reuse": [g.usage.prefilled_tokens for g in off],
            "generated_tokens": [g.usage.generated_tokens for g in on],
            "seconds_with_reuse": [round(s, 4) for s in with_reuse.turn_seconds],
            "seconds_without_reuse": [round(s, 4) for s in without.turn_seconds],
            "identical_output": [a.token_ids == b.token_ids for a, b in zip(on, off)],
        },
    }


def print_table(report: dict[str, Any]) -> None:
    """A side-by-side table per turn, a totals line, and the PASS/FAIL verdict."""
    t = report["per_turn"]
    print(
        f"prefix reuse: {report['model']} ({report['arch']}), {report['turns']} turns, "
        f"replies {'forced' if report['forced'] else 'free (greedy)'}"
    )
    print()
    print(f"{'':>4} {'':<8} {'':>7} | {'with reuse':^27} | {'without reuse':^19} |")
    print(
        f"{'turn':>4} {'reply':<8} {'prompt':>7} | {'cached':>7} {'prefill':>8} {'seconds':>9} | "
        f"{'prefill':>8} {'seconds':>9} | {'same':>4}"
    )
    for i in range(report["turns"]):
        print(
            f"{i + 1:>4} {t['reply'][i]:<8} {t['prompt_tokens'][i]:>7} | "
            f"{t['cached_tokens_with_reuse'][i]:>7} {t['prefill_tokens_with_reuse'][i]:>8} "
            f"{t['seconds_with_reuse'][i]:>9.3f} | {t['prefill_tokens_without_reuse'][i]:>8} "
            f"{t['seconds_without_reuse'][i]:>9.3f} | {'yes' if t['identical_output'][i] else 'NO':>4}"
        )
    print(
        f"{'all':>4} {'':<8} {report['prompt_tokens_total']:>7} | "
        f"{report['cached_tokens_with_reuse']:>7} {report['prefill_tokens_with_reuse']:>8} "
        f"{report['seconds_with_reuse']:>9.3f} | {report['prefill_tokens_without_reuse']:>8} "
        f"{report['seconds_without_reuse']:>9.3f} |"
    )
    print()
    print(f"prefill ratio (with / without reuse): {report['prefill_ratio']:.3f}")
    print(f"speedup (seconds without / with reuse): {report['speedup']:.2f}x")
    print(f"identical outputs: {report['identical_outputs']}")
    verdict = "PASS" if report["target_met"] else "FAIL"
    print(
        f"{verdict}: target prefill_ratio <= {TARGET_PREFILL_RATIO} and identical outputs "
        f"(ratio {report['prefill_ratio']:.3f}, identical {report['identical_outputs']})"
    )


# -- entry point -----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = make_parser(__doc__)
    parser.add_argument("--turns", type=int, default=8, help="model replies; the last one is the answer")
    parser.add_argument(
        "--result-lines", type=int, default=24, help="lines per tool result (default 24: a few hundred tokens)"
    )
    parser.add_argument("--free", action="store_true", help="never force replies; generate greedily")
    parser.add_argument(
        "--thinking",
        action="store_true",
        help="tiny model with a Qwen3.5-style thinking template; every forced reply thinks first",
    )
    args = parser.parse_args(argv)
    if args.turns < 1 or args.result_lines < 1:
        parser.error("--turns and --result-lines must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    conv = build_conversation(args.turns, args.result_lines, args.thinking)

    async def measure(model: Path, label: str) -> Report:
        with_reuse, forced = await run_mode(model, True, conv, not args.free)
        without, _ = await run_mode(model, False, conv, not args.free)
        return summarize(model_arch(model), label, forced, with_reuse, without)

    return run_report(
        args,
        lambda model, label: asyncio.run(measure(model, label)),
        print_table,
        context_window=TINY_CONTEXT_WINDOW,
        template="thinking" if args.thinking else "tools",
    )


if __name__ == "__main__":
    sys.exit(main())
