"""Tool calls: how many of a model's calls are well-formed and schema-valid, with the call grammar off and on.

A fixed set of tool-use requests (`REQUESTS`, 24 of them: read a file, search, list a folder, run a
command) goes to an agent with four tools, `read`, `grep`, `ls` and `bash`, whose schemas are the real
ones from `mlx_subagents.tools`. The system prompt is the built-in scout's (as a real session renders
it) and, unless `--no-ask`, one line asking for exactly one tool call per request: a small model often
answers in prose otherwise, and only started calls can be measured. Each request runs once with the
grammar off and once with it on (`GenerateArgs(grammar=...)`), greedily, interleaved (off then on for
even requests, on then off for odd ones) so that load from other processes hits both alike, each in a
fresh host session on one `MlxModelHost` (the agent's prefix is shared, as between sub-agents), after
one untimed warm-up request each way (it builds the grammar's view of the tokenizer).

Per mode it reports:

- started: the share of replies that start a call (a parsed call, a malformed one, or the call-start
  marker left in the text);
- parsed: of the started replies, the share whose every call parsed (`reply.tool_calls`, no
  `reply.malformed_tool_calls`);
- valid: of the started replies, the share whose every call names one of the four tools with arguments
  its JSON schema accepts (`jsonschema`);
- decode tokens/s: the generated tokens of all replies over their generation time (the host's `Usage`).

`--json`: the last line is one object with `started_call_rate_off` / `_on`, `valid_call_rate_off` /
`_on`, `parsed_call_rate_off` / `_on`, `decode_ratio_on_vs_off` (tokens/s on over off), the counts and a
row per request. Target (issue 29): with the grammar on, 100% of started calls valid. Missing it still
exits 0 (a measurement); errors exit nonzero.

On the tiny random model (the default) nothing would ever start a call, so each reply is forced to
open with the call-start marker (`<tool_call>`) and the random model writes the rest: noise, which the
grammar turns into valid calls. Its tools' string arguments are bounded to 8 characters there (a random
model never closes a string by itself, so every constrained call would run into the token limit). With
`--model` nothing is forced and the schemas are the tools' own; `--force-start` forces the call start
there too (SmolLM2 starts no call by itself, asked or not), and measures what the model writes after it.

Run (from the repository root):

    python benchmarks/tool_calls.py                     # tiny random qwen3, forced call starts
    python benchmarks/tool_calls.py --json
    python benchmarks/tool_calls.py --model smollm2      # an imported model (`subagent models import`)
    python benchmarks/tool_calls.py --model ~/models/Qwen3-4B-Instruct-2507-4bit
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
from workload import Report, make_parser, model_arch, run_report, scout_prompt

from mlx_subagents.host import GenerateArgs, MlxModelHost, Reply
from mlx_subagents.host.protocol import Message, ToolSchema
from mlx_subagents.testing import ForcedPrefix
from mlx_subagents.tools import Workspace

TOOLS = ("read", "grep", "ls", "bash")
MODES = ("off", "on")
DEFAULT_MAX_TOKENS = 64  # a call to one of the four tools takes 25-40 tokens
CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
TINY_MAX_LENGTH = 8
ASK = (
    "Answer every request with exactly one tool call, in the format given above, and nothing else: "
    "no explanation before or after the call."
)
REQUESTS = (
    "Show me the contents of src/config.py.",
    "Read README.md.",
    "Open pyproject.toml and show it to me.",
    "Read lines 40 to 80 of src/app/server.py.",
    "What is in docs/architecture.md?",
    "Print the first 20 lines of setup.cfg.",
    "Find where load_settings is defined.",
    "Search the src folder for the word TODO.",
    "Which files mention DATABASE_URL?",
    "Look for calls to retry_request in the tests folder.",
    "Search for 'class Session' in the code.",
    "Find every import of the logging module under src/core.",
    "List the files in the tests folder.",
    "What is in the current directory?",
    "List src/app.",
    "Show me what the docs folder contains.",
    "What files are in .github/workflows?",
    "List the benchmarks directory.",
    "Run the test suite with pytest -q.",
    "Show the git log of the last five commits.",
    "Count the lines of Python code in src with wc.",
    "Run `python --version`.",
    "Check the disk usage of the build folder, with a timeout of 30 seconds.",
    "Install the package in editable mode with pip.",
)


def bounded(tool: ToolSchema) -> ToolSchema:
    """`tool` with its string arguments at most `TINY_MAX_LENGTH` characters: a random model never
    closes a string by itself, so under the grammar its calls would all be cut by the token limit."""
    function = tool["function"]
    properties = {
        name: {**prop, "maxLength": TINY_MAX_LENGTH} if prop.get("type") == "string" else prop
        for name, prop in function["parameters"].get("properties", {}).items()
    }
    parameters = {**function["parameters"], "properties": properties}
    return {**tool, "function": {**function, "parameters": parameters}}


class CallStarts:
    """The host's processor factory: every request starts with a forced call start once `ids` is set
    (the tokenizer is only known once the host has loaded)."""

    def __init__(self) -> None:
        self.ids: list[int] = []

    def __call__(self, session: str, prompt_ids: list[int]) -> list[Any]:
        return [ForcedPrefix(self.ids)] if self.ids else []


@dataclass(frozen=True)
class Outcome:
    """What one reply did with its call: started one, parsed every call, every call schema-valid."""

    started: bool
    parsed: bool
    valid: bool
    cut: bool  # a started call the reply limit cut before it closed (no format could save it)
    calls: list[str]
    generated: int
    seconds: float


def judge(reply: Reply, schemas: dict[str, dict[str, Any]]) -> Outcome:
    """A reply's call, checked against the tools' JSON schemas."""
    started = bool(reply.tool_calls or reply.malformed_tool_calls or CALL_START in reply.text)
    parsed = started and not reply.malformed_tool_calls and bool(reply.tool_calls)
    valid = parsed and all(
        call.name in schemas and jsonschema.Draft202012Validator(schemas[call.name]).is_valid(call.arguments)
        for call in reply.tool_calls
    )
    calls = [f"{c.name}({c.arguments})" for c in reply.tool_calls] + [
        f"malformed: {bad.raw[:60]!r}" for bad in reply.malformed_tool_calls
    ]
    calls = calls or [f"no call: {reply.text.strip()[:60]!r}"]  # what the model said instead
    cut = started and not parsed and reply.finish_reason == "length" and CALL_END not in reply.raw_text
    if cut:
        calls = [f"cut by the limit: {reply.raw_text[:60]!r}"]
    return Outcome(started, parsed, valid, cut, calls, reply.usage.generated_tokens, reply.usage.generation_seconds)


async def measure(model: Path, ask: bool, force: bool, max_tokens: int, bound: bool) -> dict[str, list[Outcome]]:
    """Every request once per mode, interleaved, each in a fresh session of one host. `bound`: the
    string arguments bounded (for a random model)."""
    system, tools = scout_prompt(Workspace(Path.cwd()), TOOLS)
    if bound:
        tools = [bounded(tool) for tool in tools]
    if ask:
        system = {**system, "content": f"{system['content']}\n\n{ASK}"}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    starts = CallStarts()
    host = MlxModelHost(str(model), processor_factory=starts, kv_budget=0, prefix_cache=0)
    outcomes: dict[str, list[Outcome]] = {mode: [] for mode in MODES}
    async with host:
        if force:
            starts.ids = host.tokenizer.encode(CALL_START, add_special_tokens=False)

        async def ask_one(name: str, request: str, mode: str) -> Reply:
            messages: list[Message] = [system, {"role": "user", "content": request}]
            args = GenerateArgs(max_tokens=max_tokens, grammar=mode == "on")
            session = host.session(name)
            try:
                return await session.generate(messages, args, tools=tools)
            finally:
                await session.close()

        for mode in MODES:  # untimed: the grammar's tokenizer view and the shared prefix
            await ask_one(f"warm-{mode}", REQUESTS[0], mode)
        for i, request in enumerate(REQUESTS):
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                reply = await ask_one(f"{mode}-{i}", request, mode)
                outcomes[mode].append(judge(reply, schemas))
                u = reply.usage
                print(
                    f"  {i + 1}/{len(REQUESTS)} grammar {mode}: {u.generated_tokens} tokens at {u.generation_tps:.1f} "
                    f"tok/s, prompt {u.prompt_tokens} ({u.cached_tokens} cached) in {u.prompt_seconds:.1f}s",
                    file=sys.stderr,
                )
    return outcomes


def rate(part: int, whole: int) -> float:
    return round(part / whole, 3) if whole else 0.0


def summarize(outcomes: dict[str, list[Outcome]], *, model: str, arch: str, ask: bool, forced: bool) -> Report:
    """The rates per mode, their ratio, and a row per request."""
    report: Report = {"model": model, "arch": arch, "requests": len(REQUESTS), "asked": ask, "forced": forced}
    tps = {}
    for mode in MODES:
        rows = outcomes[mode]
        started = [o for o in rows if o.started]
        seconds = sum(o.seconds for o in rows)
        tps[mode] = sum(o.generated for o in rows) / seconds if seconds else 0.0
        report[f"started_calls_{mode}"] = len(started)
        report[f"started_call_rate_{mode}"] = rate(len(started), len(rows))
        report[f"parsed_call_rate_{mode}"] = rate(sum(o.parsed for o in started), len(started))
        report[f"valid_call_rate_{mode}"] = rate(sum(o.valid for o in started), len(started))
        closed = [o for o in started if not o.cut]
        report[f"cut_calls_{mode}"] = len(started) - len(closed)
        report[f"valid_closed_call_rate_{mode}"] = rate(sum(o.valid for o in closed), len(closed))
        report[f"decode_tok_s_{mode}"] = round(tps[mode], 1)
        report[f"generated_tokens_{mode}"] = sum(o.generated for o in rows)
    report["decode_ratio_on_vs_off"] = round(tps["on"] / tps["off"], 3) if tps["off"] else 0.0
    report["target_valid_call_rate_on"] = 1.0
    report["target_met"] = report["started_calls_on"] > 0 and report["valid_call_rate_on"] == 1.0
    report["per_request"] = [
        {"request": request, **{mode: outcomes[mode][i].calls for mode in MODES}}
        | {f"valid_{mode}": outcomes[mode][i].valid for mode in MODES}
        for i, request in enumerate(REQUESTS)
    ]
    return report


def print_table(report: Report) -> None:
    how = "call starts forced" if report["forced"] else "greedy, nothing forced"
    asked = "asked for one call per request" if report["asked"] else "not asked for a call"
    print(f"tool calls: {report['model']} ({report['arch']}), {report['requests']} requests, {how}, {asked}")
    print()
    header = (
        f"{'grammar':<8} {'started':>9} {'parsed':>8} {'valid':>8} {'cut':>5} {'valid of closed':>16} "
        f"{'decode tok/s':>13} {'tokens':>7}"
    )
    print(header)
    print("-" * len(header))
    for mode in MODES:
        print(
            f"{mode:<8} {report[f'started_call_rate_{mode}']:>9.0%} {report[f'parsed_call_rate_{mode}']:>8.0%} "
            f"{report[f'valid_call_rate_{mode}']:>8.0%} {report[f'cut_calls_{mode}']:>5} "
            f"{report[f'valid_closed_call_rate_{mode}']:>16.0%} {report[f'decode_tok_s_{mode}']:>13.1f} "
            f"{report[f'generated_tokens_{mode}']:>7}"
        )
    print("(parsed and valid: shares of the started replies; cut: started calls the reply limit cut before")
    print(" they closed; valid of closed: the share of the others)")
    print()
    for row in report["per_request"]:
        print(f"- {row['request']}")
        for mode in MODES:
            print(f"    {mode:<3} {'valid' if row[f'valid_{mode}'] else '     '} {'; '.join(row[mode])}")
    print()
    print(f"decode tokens/s, grammar on / off: {report['decode_ratio_on_vs_off']:.3f}")
    verdict = "PASS" if report["target_met"] else "FAIL"
    print(f"{verdict}: valid_call_rate_on = {report['valid_call_rate_on']:.3f} (target 1.0 of the started calls)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument(
        "--no-ask", dest="ask", action="store_false", help="leave out the system prompt's line asking for a call"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help=f"tokens per reply (default {DEFAULT_MAX_TOKENS})"
    )
    parser.add_argument(
        "--force-start",
        action="store_true",
        help="with --model: force each reply to open with the call-start marker (a small model that starts "
        "no call by itself still has its calls measured; the schemas stay the tools' own)",
    )
    args = parser.parse_args(argv)
    force = args.model is None or args.force_start  # a random model never starts a call by itself

    def measure_model(model: Path, label: str) -> Report:
        outcomes = asyncio.run(measure(model, args.ask, force, args.max_tokens, bound=args.model is None))
        return summarize(outcomes, model=label, arch=model_arch(model), ask=args.ask, forced=force)

    return run_report(args, measure_model, print_table, context_window=4096)


if __name__ == "__main__":
    sys.exit(main())
