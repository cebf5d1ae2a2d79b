"""`RunOptions`: what every command (and every other front end) shares, built once, read by the runner.

One frozen object instead of loose runner fields and an untyped host dict: the CLI builds it from
its flags, a Python caller from keywords, and the runner alone turns it into host settings. Each
limit has one name: `max_output_tokens` counts generated tokens over a whole task (the CLI flag is
`--max-tokens`); `max_reply_tokens` is one reply; `max_tokens` is only ever one `generate` call.

The readers of its values are the host's and the agents' (`parse_prefill_slice`, `check_kv_bits`,
`parse_thinking`), imported for a value that is set: a command attached to `subagent serve` builds
its options without loading a host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..caps import DEFAULT_CONCURRENCY, check_concurrency
from ..errors import RequestError

if TYPE_CHECKING:
    from ..agents.discovery import Scope
    from ..host import HostSettings, PrefillSlice, SharedKVBudget
    from ..host.protocol import ProcessorFactory

# Levels of sub-agents below the agent a person started; a session at this depth cannot delegate.
DEFAULT_MAX_DEPTH = 2


@dataclass(frozen=True)
class RunOptions:
    """The options of one run.

    Args:
        model: forces one model for every task (`--model`); otherwise a task's own model, the
            agent's `model`, then `default_model`, then `$MLX_SUBAGENTS_MODEL`, then the default.
        default_model: the model of the tasks nothing else names a model for (a client of `subagent
            serve` runs on its own `$MLX_SUBAGENTS_MODEL`, else the server's `--model`).
        scope: agent layers besides the built-ins (`user`, `project` or `both`).
        assume_yes: allow what comes with the project without asking (`--yes`): its agents and skills, and
            its hooks and MCP servers, which run unsandboxed (`consent.py`).
        yes_agents: allow the project's agents and skills without asking, not its hooks or MCP servers.
        max_turns, max_output_tokens, timeout: defaults for tasks that set none.
        max_depth: how many levels of sub-agents the `subagent` tool may start (0: none).
        batching: decode concurrent sessions in one batch.
        kv_budget: bytes of KV cache for all sessions (0: unbounded; None: the host's default).
        kv_bits: bits per KV value for every session (`--kv-bits`): 16 (not quantized), 8 or 4 (quantized
            per group: the same `kv_budget` holds more sessions; a model that cannot take it runs at 16);
            None: the host's default, 16.
        prefix_cache: bytes of disk for shared prefixes kept across processes, so a new process's first
            turn skips its agent's prompt (0: off; None: a small share of the free disk).
        context_window: override the model's context window (tokens).
        prefill_slice: how a prompt is prefilled while other sessions decode (`--prefill-slice`): `auto`
            (slices sized from what decode steps and prompt tokens cost, the time shared equally), a
            number of tokens per slice, or `off` (it joins the batch at once, a chunk per decode step);
            None: the host's default, `auto`.
        draft: how a session decoding on its own drafts tokens to verify in one forward (`--draft`):
            `lookup` (from its own prompt and reply), `off`, or `auto` (lookup on a GPU, off on a CPU);
            None: the host's default, `auto`. The tokens are the same either way.
        concurrency: agent loops running at once in the whole process, sub-agents included; a
            parent waiting on its children does not count.
        thinking: a thinking model's budget per reply (`--thinking on|off|TOKENS`, as tokens, 0 for
            off); wins over the agent's `thinking`.
        grammar: whether started tool calls are constrained by the call grammar (`--grammar on|off`);
            wins over the agent's `grammar`; None: the agent's, else on.
        engine: an OpenAI-compatible engine's base URL: every task's model calls go there, and
            `model` is the engine's model id. None: only agents whose files name an engine use one.
        api_key: the engines' API key (default: `$MLX_SUBAGENTS_API_KEY`).
        sandbox: every task's bash sandboxed (True) or not (False), whatever its file says; None: as
            its file says, else on for project agents.
        network: every sandboxed bash with the network (True) or without (False), whatever its file
            says; None: a built-in or user agent's `network: allow` gives it, a project agent's never
            does (a cloned repository must not choose its own rights).
        plan: every task in plan mode (read-only tools), children included.
        isolation: `worktree` or `none` for the tasks a person starts (`--isolation`), over their agents'
            `isolation:`; None: as their agent files say. Delegated children follow their own call.
        allow_models: models a delegated call may name for a child (`--allow-model`), besides its parent's
            `models:`, the imported models and the run's own (`runs/model_grants.py`).
    """

    model: str | None = None
    default_model: str | None = None
    scope: Scope = "both"
    assume_yes: bool = False
    yes_agents: bool = False
    max_turns: int | None = None
    max_output_tokens: int | None = None
    timeout: float | None = None
    max_depth: int = DEFAULT_MAX_DEPTH
    batching: bool = True
    kv_budget: int | None = None
    kv_bits: int | None = None
    prefix_cache: int | None = None
    context_window: int | None = None
    prefill_slice: PrefillSlice | None = None
    draft: str | None = None
    concurrency: int = DEFAULT_CONCURRENCY
    engine: str | None = None
    api_key: str | None = field(default=None, repr=False)
    isolation: str | None = None
    allow_models: tuple[str, ...] = ()

    thinking: int | str | None = None
    grammar: bool | None = None
    sandbox: bool | None = None
    network: bool | None = None
    plan: bool = False

    def __post_init__(self) -> None:
        check_concurrency(self.concurrency, engine=bool(self.engine))
        if self.thinking is not None:
            from ..agents.model_fields import parse_thinking

            try:
                object.__setattr__(self, "thinking", parse_thinking(self.thinking))
            except ValueError as exc:
                raise RequestError(f"thinking {exc}; use on, off or a number of tokens per reply") from None
        if self.kv_bits is not None:
            from ..host.settings import check_kv_bits

            try:
                check_kv_bits(self.kv_bits)
            except ValueError as exc:
                raise RequestError(f"{exc}; 16 keeps the KV cache unquantized") from None
        if self.prefix_cache is not None and (isinstance(self.prefix_cache, bool) or self.prefix_cache < 0):
            raise RequestError(f"prefix_cache must be bytes >= 0 (0: off), got {self.prefix_cache!r}")
        if self.prefill_slice is not None:
            from ..host import parse_prefill_slice

            object.__setattr__(self, "prefill_slice", parse_prefill_slice(self.prefill_slice))
        if self.draft is not None:
            from ..host import parse_draft

            object.__setattr__(self, "draft", parse_draft(self.draft))
        if isinstance(self.max_depth, bool) or not isinstance(self.max_depth, int) or self.max_depth < 0:
            raise RequestError(f"max_depth must be a whole number >= 0, got {self.max_depth!r}")

    def host_settings(
        self,
        engine: str | None = None,
        kv_budget: SharedKVBudget | None = None,
        processor_factory: ProcessorFactory | None = None,
    ) -> HostSettings:
        """What a host of the run is built from (each kind takes what it uses).

        Args:
            engine: the engine the model is on (the task's model's, which may be its agent's own).
            kv_budget: the budget the run's resident models share (None: this run's `kv_budget`).
            processor_factory: logits processors for every request (the test kit's forced scripts).
        """
        from ..host import DEFAULT_DRAFT, DEFAULT_KV_BITS, DEFAULT_PREFILL_SLICE, HostSettings

        return HostSettings(
            engine=engine,
            api_key=self.api_key,
            # --timeout bounds the start too: an engine's start-up probe waits no longer.
            start_timeout=self.timeout,
            context_window=self.context_window or None,
            batching=self.batching,
            kv_budget=self.kv_budget if kv_budget is None else kv_budget,
            prefix_cache=self.prefix_cache,
            prefill_slice=DEFAULT_PREFILL_SLICE if self.prefill_slice is None else self.prefill_slice,
            processor_factory=processor_factory,
            kv_bits=DEFAULT_KV_BITS if self.kv_bits is None else self.kv_bits,
            draft=DEFAULT_DRAFT if self.draft is None else self.draft,
        )
