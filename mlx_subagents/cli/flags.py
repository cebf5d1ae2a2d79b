"""The command line's options: one `Annotated` alias per flag, and the flags every running command shares.

`shared_options()` gives a command the shared flags (model, workspace, limits, host settings) as
one `Shared` argument, and `display_options()` the running commands' --json, --events and --quiet
as one `Display`, so that each flag is declared once; `Shared.options()` is the `RunOptions`
the core sees, and `Shared.runner()` the command's runner.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from ..caps import MAX_CONCURRENCY, MAX_ENGINE_CONCURRENCY, MAX_WARNINGS
from ..events import EventSink, Fanout
from ..runs.options import DEFAULT_MAX_DEPTH, RunOptions
from ..runs.published import Publisher
from ..runs.tasks import absolute_model
from .config import defaults_for, load_config, read_draft, read_kv_budget, read_prefill_slice, read_prefix_cache
from .live import paused
from .output import print_warnings

if TYPE_CHECKING:
    from ..runs.runner import Runner

# The command a process's published snapshot names (`subagent watch`).
MAX_COMMAND_CHARS = 200


class Scope(str, Enum):
    user = "user"
    project = "project"
    both = "both"


ModelOpt = Annotated[
    Optional[str],
    typer.Option(
        "--model", "-m", help="Local folder, hub id or scripted:FILE (default: $MLX_SUBAGENTS_MODEL or a Qwen3 4B)."
    ),
]
CwdOpt = Annotated[
    Path, typer.Option("--cwd", "-C", help="Workspace folder the agent works in.", exists=True, file_okay=False)
]
ScopeOpt = Annotated[Scope, typer.Option("--scope", help="Agent layers besides the built-ins.")]
YesOpt = Annotated[
    bool,
    typer.Option(
        "--yes",
        "-y",
        help="Allow what comes with the project without asking: its agents (their bash sandboxed) and skills, and "
        "the commands that run unsandboxed, as you: the hooks of .mlx-subagents/settings.json and "
        ".claude/settings.json, and the MCP servers of .mcp.json and its agents' mcpServers: (each named in a "
        "warning). --yes-agents allows the agents and skills only.",
    ),
]
YesAgentsOpt = Annotated[
    bool,
    typer.Option(
        "--yes-agents",
        help="Allow the project's agents (their bash sandboxed) and skills without asking, but not its hooks or MCP "
        "servers, which run unsandboxed (asked at a terminal, else left out or refused).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]
JsonListOpt = Annotated[bool, typer.Option("--json", help="Print one JSON list instead of text.")]
WindowOpt = Annotated[
    Optional[int], typer.Option("--context-window", help="Override the model's context window (tokens).", min=256)
]


class Batching(str, Enum):
    on = "on"
    off = "off"


class Network(str, Enum):
    allow = "allow"
    deny = "deny"


class Isolation(str, Enum):
    worktree = "worktree"
    none = "none"


BatchingOpt = Annotated[
    Batching, typer.Option("--batching", help="Decode concurrent sessions in one batch (off: one turn at a time).")
]
# The same on/off choice as --batching.
SandboxOpt = Annotated[
    Optional[Batching],
    typer.Option(
        "--sandbox",
        help="Run every agent's bash sandboxed (writes only in the workspace and a private /tmp, no network) or not. "
        "Default: the agent's `sandbox:`, else on for project agents.",
    ),
]
NetworkOpt = Annotated[
    Optional[Network],
    typer.Option(
        "--network",
        help="Give every sandboxed bash the network (allow) or not (deny). Default: a built-in or user agent's "
        "`network:`; a project agent's `network: allow` needs this flag.",
    ),
]
KvBudgetOpt = Annotated[
    Optional[str],
    typer.Option(
        "--kv-budget",
        help="KV cache budget for all sessions: 4GB, 512MiB, 0.25 (of RAM) or 0 (unbounded). Default: half of RAM minus the weights.",
    ),
]


class KvBits(str, Enum):
    b16 = "16"
    b8 = "8"
    b4 = "4"


KvBitsOpt = Annotated[
    Optional[KvBits],
    typer.Option(
        "--kv-bits",
        help="Bits per KV cache value for every session: 16 (not quantized), 8 or 4 (quantized per group: about "
        "1.9x or 3.6x less than 16-bit, so the same --kv-budget holds more sessions). A model that cannot take it "
        "runs at 16, with a warning. Default: 16.",
    ),
]
PrefixCacheOpt = Annotated[
    Optional[str],
    typer.Option(
        "--prefix-cache",
        help="Disk for agents' prompt prefixes kept across runs (warm starts): 2GB, 512MiB or off. Default: 5% of free disk, at most 4GiB.",
    ),
]
PrefillSliceOpt = Annotated[
    Optional[str],
    typer.Option(
        "--prefill-slice",
        help="How a prompt is prefilled while other sessions decode: auto (slices sized from what each costs, "
        "the time shared equally), a number of tokens per slice, or off (a chunk per decode step). Default: auto.",
    ),
]
DraftOpt = Annotated[
    Optional[str],
    typer.Option(
        "--draft",
        help="How each decoding session, alone or batched, drafts tokens to check in one forward: lookup (copied "
        "from its prompt and reply), off, or auto (lookup on a GPU, off on a CPU). The tokens are the same. Default: auto.",
    ),
]
MaxTurnsOpt = Annotated[
    Optional[int], typer.Option("--max-turns", min=1, help="Stop a task after this many model turns.")
]
MaxTokensOpt = Annotated[
    Optional[int], typer.Option("--max-tokens", min=1, help="Stop a task after this many generated tokens.")
]
ThinkingOpt = Annotated[
    Optional[str],
    typer.Option(
        "--thinking",
        help="A thinking model's budget per reply: on, off or a number of tokens (then the thought is closed). "
        "Default: the agent's `thinking`, else on.",
    ),
]
GrammarOpt = Annotated[
    Optional[Batching],
    typer.Option(
        "--grammar",
        help="Constrain each tool call the model starts to a known tool and arguments its schema accepts, or not. "
        "Default: the agent's `grammar:`, else on.",
    ),
]
TimeoutOpt = Annotated[
    Optional[float],
    typer.Option(
        "--timeout",
        min=0.001,
        help="Stop a task after this many seconds (wall clock); an engine's start-up probe waits no longer.",
    ),
]
SchemaOpt = Annotated[
    Optional[Path], typer.Option("--schema", help="JSON schema file the final answer must satisfy.", dir_okay=False)
]
EventsOpt = Annotated[
    bool, typer.Option("--events", help="Print one JSON object per event on stdout, as things happen.")
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress display.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Also say the model and its tool mode first.")]
ConcurrencyOpt = Annotated[
    int,
    typer.Option(
        "--concurrency",
        "-j",
        min=1,
        max=MAX_ENGINE_CONCURRENCY,
        help=(
            "Agent loops running at once in the whole run, sub-agents included (a parent waiting on them does not "
            f"count); up to {MAX_CONCURRENCY}, or {MAX_ENGINE_CONCURRENCY} with --engine."
        ),
    ),
]
# A multi-task command's tasks: `-t AGENT TEXT` (parallel) or `-s AGENT TEXT` (chain), repeated.
TASK_HELP = 'An agent, then its task text: -t scout "map the auth code". Repeat (8 at most).'
STEP_HELP = "An agent, then its task text; {previous} is the previous step's answer. Repeat (8 at most)."
TaskAgents = Annotated[Optional[list[str]], typer.Option("--task", "-t", metavar="AGENT", help=TASK_HELP)]
StepAgents = Annotated[Optional[list[str]], typer.Option("--step", "-s", metavar="AGENT", help=STEP_HELP)]
TaskTexts = Annotated[Optional[list[str]], typer.Argument(metavar="TEXT", help="The task text after each -t AGENT.")]
StepTexts = Annotated[Optional[list[str]], typer.Argument(metavar="TEXT", help="The task text after each -s AGENT.")]
EngineOpt = Annotated[
    Optional[str],
    typer.Option(
        "--engine",
        help="Run the model calls on this OpenAI-compatible engine (e.g. http://gpu-box:8000/v1); --model is its model id.",
    ),
]
ApiKeyOpt = Annotated[
    Optional[str], typer.Option("--api-key", help="The engine's API key (default: $MLX_SUBAGENTS_API_KEY).")
]
TaskKeyOpt = Annotated[
    Optional[str], typer.Option("--task", "-t", help="Which task of the run: label, step id or position.")
]
MaxDepthOpt = Annotated[
    int,
    typer.Option(
        "--max-depth", min=0, help="Levels of sub-agents an agent with the subagent tool may start (0: no delegation)."
    ),
]
IsolationOpt = Annotated[
    Optional[Isolation],
    typer.Option(
        "--isolation",
        help="worktree: each task in a git worktree and branch of its own (writers run at once); none: the shared tree.",
    ),
]
AllowModelOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--allow-model",
        metavar="NAME",
        help="A model a delegating agent may name for a sub-agent (repeatable); besides its file's models:.",
    ),
]
StandaloneOpt = Annotated[
    bool,
    typer.Option(
        "--standalone",
        help="Run in this process even when `subagent serve` runs for the state folder (default: attach to it).",
    ),
]
# The flags every running command shares: name -> (its `Annotated` alias, its default).
SHARED_FLAGS: dict[str, tuple[Any, Any]] = {
    "model": (ModelOpt, None),
    "cwd": (CwdOpt, Path(".")),
    "scope": (ScopeOpt, Scope.both),
    "yes": (YesOpt, False),
    "yes_agents": (YesAgentsOpt, False),
    "max_turns": (MaxTurnsOpt, None),
    "max_tokens": (MaxTokensOpt, None),
    "timeout": (TimeoutOpt, None),
    "context_window": (WindowOpt, None),
    "batching": (BatchingOpt, Batching.on),
    "kv_budget": (KvBudgetOpt, None),
    "kv_bits": (KvBitsOpt, None),
    "prefix_cache": (PrefixCacheOpt, None),
    "prefill_slice": (PrefillSliceOpt, None),
    "draft": (DraftOpt, None),
    "max_depth": (MaxDepthOpt, DEFAULT_MAX_DEPTH),
    "concurrency": (ConcurrencyOpt, MAX_CONCURRENCY),
    "thinking": (ThinkingOpt, None),
    "grammar": (GrammarOpt, None),
    "engine": (EngineOpt, None),
    "api_key": (ApiKeyOpt, None),
    "sandbox": (SandboxOpt, None),
    "network": (NetworkOpt, None),
    "isolation": (IsolationOpt, None),
    "allow_model": (AllowModelOpt, None),
    "standalone": (StandaloneOpt, False),
}


# How a running command shows its work: name -> (its `Annotated` alias, its default).
DISPLAY_FLAGS: dict[str, tuple[Any, Any]] = {
    "as_json": (JsonOpt, False),
    "events": (EventsOpt, False),
    "quiet": (QuietOpt, False),
}


@dataclass(frozen=True)
class Display:
    """How a running command shows its work: its result as one JSON object (`--json`), each event as a
    JSON line as it happens (`--events`), no progress display (`--quiet`)."""

    as_json: bool = False
    events: bool = False
    quiet: bool = False


@dataclass(frozen=True)
class Shared:
    """The shared flags of one command, as typed; `options()` is what the core sees."""

    model: str | None
    cwd: Path
    scope: Scope
    yes: bool
    yes_agents: bool
    max_turns: int | None
    max_tokens: int | None
    timeout: float | None
    context_window: int | None
    batching: Batching
    kv_budget: str | None
    kv_bits: KvBits | str | None  # the flag's choice, config.toml's text ("8"), or None: the default
    prefix_cache: str | None
    prefill_slice: str | None
    draft: str | None
    max_depth: int
    concurrency: int
    thinking: str | None
    grammar: Batching | None
    engine: str | None
    api_key: str | None
    sandbox: Batching | None
    network: Network | None
    isolation: Isolation | None
    allow_model: list[str] | None
    standalone: bool
    # The flags config.toml set (none given on the command line): a server reads the same file.
    configured: frozenset[str] = frozenset()

    def options(self) -> RunOptions:
        # A path names the same model later, from another folder: the run's record keeps it (resume).
        model = absolute_model(self.model, Path.cwd()) if self.model and not self.engine else self.model
        return RunOptions(
            model=model,
            scope=self.scope.value,
            assume_yes=self.yes,
            yes_agents=self.yes_agents,
            max_turns=self.max_turns,
            max_output_tokens=self.max_tokens,
            timeout=self.timeout,
            max_depth=self.max_depth,
            batching=self.batching == Batching.on,
            kv_budget=read_kv_budget(self.kv_budget),
            kv_bits=None if self.kv_bits is None else int(self.kv_bits),
            prefix_cache=read_prefix_cache(self.prefix_cache),
            prefill_slice=read_prefill_slice(self.prefill_slice),
            draft=read_draft(self.draft),
            context_window=self.context_window,
            concurrency=self.concurrency,
            thinking=self.thinking,
            grammar=None if self.grammar is None else self.grammar == Batching.on,
            engine=self.engine,
            api_key=self.api_key,
            sandbox=None if self.sandbox is None else self.sandbox == Batching.on,
            network=None if self.network is None else self.network == Network.allow,
            isolation=self.isolation.value if self.isolation else None,
            allow_models=tuple(self.allow_model or ()),
        )

    def own_hosts(self) -> str | None:
        """The flag that makes this command's hosts its own (a server's are made once, with the server's
        settings), or None: `--engine`, `--kv-budget`, `--kv-bits`, `--context-window`, `--prefix-cache`,
        `--prefill-slice`, `--draft`, `--batching off`.
        A size config.toml sets is not one: `subagent serve` read it from the same file."""
        given = {
            "--engine": self.engine is not None,
            "--kv-budget": self.kv_budget is not None and "kv_budget" not in self.configured,
            "--kv-bits": self.kv_bits is not None and "kv_bits" not in self.configured,
            "--context-window": self.context_window is not None,
            "--prefix-cache": self.prefix_cache is not None and "prefix_cache" not in self.configured,
            "--prefill-slice": self.prefill_slice is not None and "prefill_slice" not in self.configured,
            "--draft": self.draft is not None and "draft" not in self.configured,
            "--batching off": self.batching == Batching.off,
        }
        return next((flag for flag, set_ in given.items() if set_), None)

    def runner(self, on_event: EventSink, cwd: Path | None = None, *, plan: bool = False) -> Runner:
        """The command's runner, asking on the terminal before a project agent runs; the agent files'
        warnings are shown first (the first few). `plan`: every task in plan mode (`chat --plan`)."""
        from ..runs.runner import Runner  # here: an attached command runs none

        publisher = make_publisher()
        runner = Runner(
            cwd=cwd or self.cwd,
            options=dataclasses.replace(self.options(), plan=plan),
            interactive=sys.stdin.isatty(),
            confirm=_confirm,
            on_event=Fanout([on_event, publisher.handle]),
        )
        publisher.runner = runner
        print_warnings(runner.catalog, limit=MAX_WARNINGS)
        return runner


def make_publisher(cwd: Path | None = None) -> Publisher:
    """What this process publishes for `subagent watch`, named by its command line."""
    return Publisher(" ".join(sys.argv[1:])[:MAX_COMMAND_CHARS], cwd=cwd)


def _confirm(question: str) -> bool:
    """Ask on the terminal, the live status off it meanwhile (a project agent's consent)."""
    with paused():
        return typer.confirm(question, default=False, err=True)


def shared_options(**overrides: Any) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command the shared flags; it receives them as one keyword argument, `shared: Shared`.

    Args:
        overrides: a flag's own `Annotated` alias for this command (other help), or None to leave
            the flag out (its default is used).
    """
    return _bundle(SHARED_FLAGS, "shared", _shared, overrides)


def display_options() -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a running command --json, --events and --quiet; it receives them as one keyword argument,
    `display: Display` (under `shared_options`, which then lists them before the shared flags)."""
    return _bundle(DISPLAY_FLAGS, "display", lambda values: Display(**values), {})


def _shared(values: dict[str, Any]) -> Shared:
    """The shared flags as given, config.toml's values below them."""
    config = load_config()
    configured = frozenset(k for k, v in values.items() if v is None and k in config.values and k != "model")
    return Shared(**defaults_for(values, config), configured=configured)


def _bundle(
    flags: dict[str, tuple[Any, Any]], keyword: str, make: Callable[[dict[str, Any]], Any], overrides: dict[str, Any]
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Adds `flags` to a command's own options and hands them to it as one keyword argument, `make(values)`."""

    def wrap(command: Callable[..., None]) -> Callable[..., None]:
        own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != keyword]
        aliases = {name: overrides.get(name, alias) for name, (alias, _default) in flags.items()}
        added = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=flags[name][1], annotation=alias)
            for name, alias in aliases.items()
            if alias is not None
        ]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> None:
            values = {name: kwargs.pop(name, default) for name, (_alias, default) in flags.items()}
            command(**kwargs, **{keyword: make(values)})

        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + added
        wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return wrap
