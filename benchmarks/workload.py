"""What the benchmark scripts share: the model they run on (a tiny random one or `--model`), their
common arguments and error exit, the generated code their tool results show, the calls they plan and
the agent prompt they open with. Imported by sibling scripts run as `python benchmarks/NAME.py`
(their folder is on `sys.path`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_subagents.agents.discovery import builtin_agents_dir
from mlx_subagents.agents.prompt import system_prompt
from mlx_subagents.agents.spec import parse_agent_file
from mlx_subagents.errors import SubagentError
from mlx_subagents.host import MlxModelHost, Reply
from mlx_subagents.host.mlx.loading import read_config, resolve_model_path
from mlx_subagents.host.protocol import Message, ToolSchema
from mlx_subagents.testing import make_tiny_model, tool_call_text
from mlx_subagents.testing.tiny_model import resize_tiny_model
from mlx_subagents.tools import Workspace, make_tools

VERBS = ("load", "parse", "read", "build", "check", "resolve", "merge", "save", "apply", "validate")
NOUNS = ("config", "settings", "profile", "session", "cache", "token", "model", "path", "limits", "env")
TYPES = ("str", "int", "Path", "dict[str, Any]", "list[str]", "bool", "Settings", "Config")
TINY_ARCHS = ("qwen3", "qwen3_5")

Report = dict[str, Any]


# -- the model and the arguments every benchmark takes -------------------------------------------


def make_parser(doc: str) -> argparse.ArgumentParser:
    """A parser with the shared `--arch`, `--model` and `--json`; the script adds its own."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--arch", choices=TINY_ARCHS, default="qwen3", help="tiny model architecture (without --model)")
    parser.add_argument(
        "--model",
        help="a model instead of a tiny random one: a local mlx-lm folder, an imported name "
        "(`subagent models import`) or a cached hub id",
    )
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="with --model: run a float32 copy of the quantized model, made in a temporary folder (on a CPU "
        "mlx's quantized matmul has no fast kernel)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return parser


@contextmanager
def open_model(
    args: argparse.Namespace,
    *,
    context_window: int,
    hidden_size: int | None = None,
    num_layers: int | None = None,
    template: str = "tools",
    head_dim: int = 16,
) -> Iterator[tuple[Path, str]]:
    """(model folder, label): `--model` resolved like the CLI does, or a tiny random model in a
    temporary folder that lives as long as the block (shaped by `hidden_size` / `num_layers` and
    `head_dim`, with the test kit's chat `template`)."""
    if args.model is not None:
        path = resolve_model_path(args.model)
        if not getattr(args, "dequantize", False):
            yield path, str(args.model)
            return
        with tempfile.TemporaryDirectory(prefix="benchmark-") as tmp:
            yield float32_copy(path, Path(tmp) / path.name), f"{args.model} dequantized to float32"
        return
    if getattr(args, "dequantize", False):
        raise SubagentError("--dequantize: the tiny model is float32 already; give --model a quantized model")
    with tempfile.TemporaryDirectory(prefix="benchmark-") as tmp:
        path = make_tiny_model(
            Path(tmp) / "model",
            args.arch,
            context_window=context_window,
            template=template,  # type: ignore[arg-type]
            head_dim=head_dim,
        )
        if hidden_size is not None or num_layers is not None:
            try:
                resize_tiny_model(path, hidden_size=hidden_size, num_layers=num_layers)
            except ValueError as exc:  # a size the architecture cannot take
                raise SubagentError(str(exc)) from None
        label = (
            f"tiny-{args.arch}"
            + (f"-h{hidden_size}" if hidden_size else "")
            + (f"-l{num_layers}" if num_layers else "")
            + (f"-d{head_dim}" if head_dim != 16 else "")
            + (f"-{template}" if template != "tools" else "")
        )
        yield path, label


def float32_copy(source: Path, target: Path) -> Path:
    """Write a float32 copy of the quantized model at `source` to `target` and return it: every
    quantized layer dequantized (`mlx_lm.utils.dequantize_model`), every other file (tokenizer, chat
    template, import record) copied as is, so that servers loading the copy see the same vocabulary and
    template. On a CPU mlx's quantized matmul is a plain loop; float32 goes through the BLAS."""
    import shutil

    import mlx.core as mx
    from mlx_lm.utils import dequantize_model, load_model, save_model

    if "quantization" not in read_config(source):
        raise SubagentError(f"{source}: not quantized; leave out --dequantize")
    model, config = load_model(source)
    model = dequantize_model(model)
    model.set_dtype(mx.float32)
    target.mkdir(parents=True)
    for file in source.iterdir():
        if (
            file.is_file()
            and file.name != "config.json"
            and not (file.name.startswith("model") and ".safetensors" in file.name)
        ):
            shutil.copy2(file, target / file.name)
    save_model(target, model)
    for key in ("quantization", "quantization_config"):
        config.pop(key, None)
    (target / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}, indent=4))
    return target


def run_report(
    args: argparse.Namespace,
    measure: Callable[[Path, str], Report],
    print_table: Callable[[Report], None],
    **model_options: Any,
) -> int:
    """Measure on the model, print the table (and the JSON line with `--json`); exit status 0, or
    2 with one `error:` line when the model or an option is unusable."""
    try:
        with open_model(args, **model_options) as (model, label):
            report = measure(model, label)
    except SubagentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_table(report)
    if args.json:
        print(json.dumps(report))
    return 0


def model_arch(model: Path) -> str:
    """`model_type` from the config, looking inside `text_config` for multimodal layouts."""
    config = read_config(model)
    return str(config.get("model_type") or (config.get("text_config") or {}).get("model_type", "?"))


def can_force(host: MlxModelHost) -> bool:
    """Whether scripted tool calls can be forced: the host parses the Hermes `<tool_call>` format, as
    every prompted model is taught it and Qwen-style templates use it natively."""
    return host.tool_mode == "prompted" or getattr(host.tokenizer, "tool_call_start", None) == "<tool_call>"


# -- the agent's conversation --------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedCall:
    """One scripted tool call and the result the conversation gets for it."""

    name: str
    arguments: dict[str, Any]
    result: str

    @property
    def text(self) -> str:
        """The call as the model says it (forced on the tiny model)."""
        return tool_call_text(self.name, self.arguments)


def scout_prompt(workspace: Workspace, tool_names: Sequence[str] | None = None) -> tuple[Message, list[ToolSchema]]:
    """The built-in scout agent's system message and tool schemas (its own tools, or `tool_names`),
    as a real session renders them."""
    spec = parse_agent_file(builtin_agents_dir() / "scout.md", "builtin")
    tools = [tool.schema() for tool in make_tools(tool_names or spec.tools, workspace).values()]
    return {"role": "system", "content": system_prompt(spec)}, tools


def tool_message(reply: Reply, name: str, result: str) -> Message:
    """A planned call's result, answering the model's call id when it made one."""
    call_id = reply.tool_calls[0].id if reply.tool_calls else "call_0"
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": result}


def code_line(rng: random.Random, *, constants: bool = False) -> str:
    """One plausible line of Python; `constants` adds numbered assignments to the choices."""
    verb, noun, other = rng.choice(VERBS), rng.choice(NOUNS), rng.choice(NOUNS)
    templates = [
        f"def {verb}_{noun}({other}: {rng.choice(TYPES)}) -> {rng.choice(TYPES)}:",
        f"    {noun} = {other}.{verb}({rng.choice(NOUNS)}_{rng.randint(1, 9)})",
        f"    if {noun} is None:",
        f'        raise ValueError(f"missing {noun}: {{{other}!r}}")',
        f"    return {verb}_{noun}({other}, strict={rng.choice(('True', 'False'))})",
        f"class {noun.capitalize()}{rng.choice(('Loader', 'Error', 'Spec', 'Store'))}:",
        f"    # {verb} the {noun} before the {other} is used",
    ]
    if constants:
        templates.append(f"    {noun}_{other} = {rng.randint(0, 4096)}")
    templates.append(f"from .{other} import {verb}_{noun}")
    return rng.choice(templates)


@dataclass(frozen=True)
class CallPlanner:
    """Alternating `grep` / `read` calls with generated, deterministic results.

    A turn's results depend only on (session, turn), so every mode or budget of a benchmark
    replays the same conversation. `files` are the paths the results name, `search_path` the
    folder grep searches; `detailed` is the layout with the file's total length in the read note,
    hits ending in `pattern()` and constants among the code lines (prefix_reuse.py's), the plain one
    is kv_pressure.py's. The two layouts are kept so that each benchmark's figures stay comparable
    with those measured before the scripts shared this code.
    """

    files: tuple[str, ...]
    search_path: str
    lines: int
    detailed: bool = False

    def plan(self, session: int, turn: int) -> PlannedCall:
        """Turn `turn` of session `session`: grep on even turns, read on odd ones, with its result."""
        rng = random.Random(session * 1000 + turn)
        if turn % 2 == 0:
            pattern = f"{VERBS[(session + turn) % len(VERBS)]}_{NOUNS[(3 * session + turn) % len(NOUNS)]}"
            return PlannedCall("grep", {"pattern": pattern, "path": self.search_path}, self._grep(rng, pattern))
        path = self.files[(session + turn) % len(self.files)]
        offset = 1 + self.lines * (turn // 2)
        return PlannedCall("read", {"path": path, "offset": offset, "limit": self.lines}, self._read(rng, offset))

    def plan_session(self, session: int, turns: int) -> list[PlannedCall]:
        return [self.plan(session, turn) for turn in range(turns)]

    def _grep(self, rng: random.Random, pattern: str) -> str:
        hits = []
        for _ in range(self.lines):
            if self.detailed:
                line = code_line(rng, constants=True)
                hits.append(f"{rng.choice(self.files)}:{rng.randint(1, 400)}:{line} {pattern}()")
            else:
                hits.append(f"{rng.choice(self.files)}:{rng.randint(1, 400)}:{code_line(rng)}  # {pattern}")
        return "\n".join(sorted(hits))

    def _read(self, rng: random.Random, offset: int) -> str:
        last = offset + self.lines - 1
        body = [f"{n:>6}\t{code_line(rng, constants=self.detailed)}" for n in range(offset, last + 1)]
        of_total = f" of {last + 1 + rng.randint(20, 200)}" if self.detailed else ""
        body.append(f"[... truncated: showing lines {offset}-{last}{of_total}; use offset={last + 1} to read more]")
        return "\n".join(body)
