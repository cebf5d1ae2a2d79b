"""Forks: what starting four children from their parent's KV cache saves over four fresh children.

For each context size C (2048 and 8192 tokens by default), a parent session (the built-in scout's
system prompt and tools) holds a conversation of about C tokens: alternating `grep` / `read` calls
with generated results, as the other benchmarks build them. Its last reply is a tool call (forced on
models that take the Hermes format). Then, side by side in one run, four children start at once:

- (a) four forks (`host.session(name, fork_of=parent)`): the parent's messages, the call closed with
  the placeholder result, then each fork's task, as `subagent` builds them (`fork_point`, `FORK_TASK`);
- (b) four fresh sessions of the same agent whose task carries the same context (the tool results'
  text pasted into it), which is what a parent does without forks.

Per mode it reports the children's first turns: tokens prefilled in all, the time until all four
have their first token (streamed text, else the end of the reply) and until all four end. With
`--json` the last line is one object with per-C rows and, at the largest C, `fork_prefill_ratio`
((a) over (b)), `fork_ttft_ratio`, `fork_wall_ratio` and `identical_outputs` (each fork's tokens
equal the same prompt prefilled cold on a host without reuse, greedy). Targets at C = 8192 on the tiny
model: prefill ratio <= 0.05, TTFT ratio <= 0.25, wall ratio <= 0.6. Missing a target still exits 0.

This measures the host (`MlxModelHost`) directly: the runner adds the same work to both modes.

Run (from the repository root):

    python benchmarks/fork.py                     # tiny random qwen3
    python benchmarks/fork.py --json --contexts 2048
    python benchmarks/fork.py --model ~/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workload import CallPlanner, Report, can_force, make_parser, run_report, scout_prompt

from mlx_subagents.agents.prompt import FORK_TASK
from mlx_subagents.host import GenerateArgs, MlxModelHost
from mlx_subagents.host.protocol import HostEvent, Message, Reply, TextDelta, ToolSchema
from mlx_subagents.testing import ForcedScripts, tool_call_text
from mlx_subagents.tools import Workspace
from mlx_subagents.tools.subagent import fork_point

N_CHILDREN = 4
MAX_TOKENS = 16
RESULT_LINES = 24
FILES = ("src/config.py", "src/settings.py", "src/session.py", "src/cache.py")
TASKS = tuple(f"Check part {i} of what we found and say what it does." for i in range(N_CHILDREN))
PARENT_CALL = tool_call_text("subagent", {"tasks": [{"fork": True, "task": t} for t in TASKS]})


def history(chars: int, system: Message) -> tuple[list[Message], str]:
    """A parent conversation of turns (call text, result) and the results' text (what a parent pastes)."""
    messages: list[Message] = [system, {"role": "user", "content": "Task: find how the configuration is loaded."}]
    planner = CallPlanner(FILES, "src", RESULT_LINES)
    pasted: list[str] = []
    turn = 0
    while sum(len(m.get("content") or "") for m in messages) < chars:
        call = planner.plan(0, turn)
        call_id = f"call_{turn}"
        part = {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [part]})
        messages.append({"role": "tool", "tool_call_id": call_id, "name": call.name, "content": call.result})
        pasted.append(call.result)
        turn += 1
    return messages, "\n\n".join(pasted)


async def fit_history(
    host: MlxModelHost, system: Message, tools: list[ToolSchema], target: int
) -> tuple[list[Message], str]:
    """The shortest generated history whose prompt holds at least `target` tokens of this model."""
    chars = target
    while True:
        messages, pasted = history(chars, system)
        if await host.count_tokens(messages, tools) >= target:
            return messages, pasted
        chars = int(chars * 1.25)


async def children(
    host: MlxModelHost, conversations: list[list[Message]], names: list[str], tools: list[ToolSchema], fork_of: str = ""
) -> dict[str, Any]:
    """Four first turns at once: prefilled tokens, time to all first tokens, time to all ends, token ids."""
    start = time.perf_counter()
    first: dict[int, float] = {}

    async def one(i: int) -> Reply:
        def seen(event: HostEvent) -> None:
            if isinstance(event, TextDelta):
                first.setdefault(i, time.perf_counter())

        session = host.session(names[i], fork_of=fork_of) if fork_of else host.session(names[i])
        reply = await session.generate(
            conversations[i], GenerateArgs(max_tokens=MAX_TOKENS, on_event=seen), tools=tools
        )
        first.setdefault(i, time.perf_counter())
        return reply

    replies = await asyncio.gather(*(one(i) for i in range(len(conversations))))
    wall = time.perf_counter() - start
    return {
        "prefilled_tokens": sum(r.usage.prefilled_tokens for r in replies),
        "cached_tokens": sum(r.usage.cached_tokens for r in replies),
        "ttft_s": max(first.values()) - start,
        "wall_s": wall,
        "token_ids": [list(r.token_ids) for r in replies],
    }


async def one_context(model: Path, target: int, round_id: int, cold_checks: int = N_CHILDREN) -> dict[str, Any]:
    workspace = Workspace(Path.cwd())
    system, tools = scout_prompt(workspace)
    probe = MlxModelHost(str(model))
    async with probe:
        force = can_force(probe)
        messages, pasted = await fit_history(probe, system, tools, target)
        tokenizer = probe.tokenizer
    parent_name = f"parent-{round_id}"
    scripts = ForcedScripts(tokenizer, {parent_name: [PARENT_CALL]}) if force else None
    async with MlxModelHost(str(model), processor_factory=scripts) as host:
        reply = await host.session(parent_name).generate(messages, GenerateArgs(max_tokens=256), tools=tools)
        point = list(fork_point([*messages, reply.to_message()]))
        forks = [[*point, {"role": "user", "content": FORK_TASK.format(task=t)}] for t in TASKS]
        fresh = [[system, {"role": "user", "content": f"Task: {t}\n\nWhat we found so far:\n{pasted}"}] for t in TASKS]
        # Interleaved: fresh, forks, fresh again (the mean of the two fresh rounds is the baseline).
        fresh_1 = await children(host, fresh, [f"fresh-a{i}" for i in range(N_CHILDREN)], tools)
        forked = await children(
            host, forks, [f"{parent_name} > fork#{i + 1}" for i in range(N_CHILDREN)], tools, parent_name
        )
        fresh_2 = await children(host, fresh, [f"fresh-b{i}" for i in range(N_CHILDREN)], tools)
    async with MlxModelHost(str(model), reuse=False) as cold:
        cold_ids = [
            list(
                (await cold.session(f"cold{i}").generate(m, GenerateArgs(max_tokens=MAX_TOKENS), tools=tools)).token_ids
            )
            for i, m in enumerate(forks[:cold_checks])
        ]
    baseline = {k: (fresh_1[k] + fresh_2[k]) / 2 for k in ("prefilled_tokens", "ttft_s", "wall_s")}
    return {
        "context_tokens": reply.usage.prompt_tokens + reply.usage.generated_tokens,
        "forced": force,
        "fork_prefilled_tokens": forked["prefilled_tokens"],
        "fresh_prefilled_tokens": baseline["prefilled_tokens"],
        "fork_ttft_s": forked["ttft_s"],
        "fresh_ttft_s": baseline["ttft_s"],
        "fork_wall_s": forked["wall_s"],
        "fresh_wall_s": baseline["wall_s"],
        "fork_prefill_ratio": forked["prefilled_tokens"] / max(baseline["prefilled_tokens"], 1),
        "fork_ttft_ratio": forked["ttft_s"] / baseline["ttft_s"],
        "fork_wall_ratio": forked["wall_s"] / baseline["wall_s"],
        "identical_outputs": forked["token_ids"][:cold_checks] == cold_ids,
        "cold_checks": cold_checks,
    }


def print_table(report: Report) -> None:
    print(f"forks vs fresh children with the context pasted, {N_CHILDREN} at once, on {report['model']}")
    print(f"{'C':>6} {'prefill fork/fresh':>22} {'ttft s fork/fresh':>20} {'wall s fork/fresh':>20} {'identical':>10}")
    for row in report["rows"]:
        print(
            f"{row['context_tokens']:>6} {row['fork_prefilled_tokens']:>9}/{row['fresh_prefilled_tokens']:<9.0f}"
            f"({row['fork_prefill_ratio']:.3f}) {row['fork_ttft_s']:>6.2f}/{row['fresh_ttft_s']:<6.2f}"
            f"({row['fork_ttft_ratio']:.2f}) {row['fork_wall_s']:>6.2f}/{row['fresh_wall_s']:<6.2f}"
            f"({row['fork_wall_ratio']:.2f}) {row['identical_outputs']!s:>10}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__ or "")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192], help="parent context sizes (tokens)")
    parser.add_argument(
        "--cold-checks",
        type=int,
        default=N_CHILDREN,
        help="forks whose tokens are compared with a cold prefill of the same prompt (fewer: a slow CPU's time)",
    )
    args = parser.parse_args(argv)

    def measure(model: Path, label: str) -> Report:
        rows = [asyncio.run(one_context(model, c, i, args.cold_checks)) for i, c in enumerate(args.contexts)]
        last = rows[-1]
        keys = ("fork_prefill_ratio", "fork_ttft_ratio", "fork_wall_ratio")
        return {
            "model": label,
            "rows": rows,
            **{k: last[k] for k in keys},
            "identical_outputs": all(r["identical_outputs"] for r in rows),
        }

    return run_report(args, measure, print_table, context_window=max(args.contexts) + 4096)


if __name__ == "__main__":
    sys.exit(main())
