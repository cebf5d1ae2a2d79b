"""Which models a delegated call may name, whether one fits beside the resident ones, and the catalog a
parent reads (`{"models": true}`).

A parent's `subagent` call (and an MCP client's) may give a child a `model` only from its grants:

    its file's `models:`       the models its agent file lists
    the operator's             `--allow-model NAME` (repeatable)
    imported                   every model `subagent models import` made (`$MLX_SUBAGENTS_HOME/models`)
    configured                 the run's own: `--model`, else `$MLX_SUBAGENTS_MODEL` or the default, and
                               the parent's model

The grants are offered by name in the tool's schema (an enum), so a grammar-held call names one of
them; any other is refused in one line before anything loads. A local model that is not resident yet is
refused too, in one line and before it loads, when its weights do not fit the memory the resident models
leave (`check_fits`). `describe_models` is what the `models` form answers: each granted model's context
window, tool mode, size and whether it is resident, and the model each agent the parent may start will
actually run on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from ..agents.spec import AgentSpec
from ..errors import RequestError, SubagentError
from ..host.kv import budget
from ..host.mlx.loading import imported_models_dir, resolve_model_path, strip_provider
from ..host.protocol import ModelHost
from ..models.catalog import describe
from .options import RunOptions
from .tasks import SCRIPTED, ModelRef, default_model

GIB = 2**30
NO_MODELS = "No model may be named here: this run's models are its engine's; leave model out."


def imported_names() -> list[str]:
    """The names of the imported models (`subagent models import`), sorted."""
    home = imported_models_dir()
    if not home.is_dir():
        return []
    return sorted(
        p.name for p in home.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / "config.json").is_file()
    )


def granted_models(options: RunOptions, spec: AgentSpec | None, model: ModelRef | None) -> tuple[str, ...]:
    """The models a call of `spec` (None: an MCP client) may name for a child, in the order the schema
    offers them: its file's, the operator's, the run's configured ones, the imported ones. None on an
    engine run, where a task's own model cannot be checked (`ModelChoice.check_local` refuses it)."""
    if options.engine:
        return ()
    configured = [options.model or default_model(), *([model.model] if model is not None and not model.engine else [])]
    names = [*(spec.models if spec else ()), *options.allow_models, *configured, *imported_names()]
    return tuple(dict.fromkeys(n.strip() for n in names if n.strip()))


def on_this_machine(name: str, resident: Mapping[ModelRef, ModelHost]) -> bool:
    """Whether `name` can run without a download: resident, a replay, or a local folder, imported model
    or hub id already in the cache (a call may not download one)."""
    if ModelRef(name) in resident or name.startswith(SCRIPTED):
        return True
    try:
        resolve_model_path(name, local_only=True)
    except SubagentError:
        return False
    return True


def _same(name: str, granted: str) -> bool:
    """Whether a call's `name` is the granted one: the same name, or the same local folder."""
    if strip_provider(name) == strip_provider(granted):
        return True
    a, b = Path(strip_provider(name)).expanduser(), Path(strip_provider(granted)).expanduser()
    return a.is_dir() and b.is_dir() and a.resolve() == b.resolve()


def check_granted(name: str, granted: Sequence[str], spec: AgentSpec | None) -> None:
    """Refuse a model the call may not name, in one line: who may not, what it may, and how to grant more."""
    if any(_same(name, g) for g in granted):
        return
    who = f"'{spec.name}'" if spec else "a call here"
    how = (f"models: in {spec.path}, " if spec else "") + "--allow-model NAME, or `subagent models import`"
    raise RequestError(
        f"model '{name}' is not granted to {who}: it may name {', '.join(granted) or 'none'}; grant more with "
        f"{how}, or leave model out"
    )


def weights_bytes(host: ModelHost) -> int:
    """A resident host's weights (an engine's and a script's hold none here)."""
    size = getattr(host, "weights_bytes", None)
    return int(size()) if callable(size) else 0


def check_fits(model: ModelRef, resident: Mapping[ModelRef, ModelHost]) -> None:
    """Refuse, before it loads, a local model whose weights do not fit the memory the resident models
    leave; a model that is not on this machine is left to the load (which downloads or refuses it)."""
    if model.engine or model in resident or model.model.startswith(SCRIPTED):
        return
    ram = budget.total_memory()
    try:
        folder = resolve_model_path(model.model, local_only=True)
    except SubagentError:
        return
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    held = {str(m): weights_bytes(h) for m, h in resident.items() if weights_bytes(h)}
    left = ram - sum(held.values())
    if not ram or weights <= left:
        return
    holding = f", of which the resident models hold {_gib(sum(held.values()))} ({', '.join(held)})" if held else ""
    raise RequestError(
        f"model '{model.model}' needs {_gib(weights)} for its weights, more than the {_gib(max(left, 0))} of memory "
        f"left ({_gib(ram)} in all{holding}); name a smaller model, or leave model out"
    )


def _gib(n_bytes: int) -> str:
    return f"{n_bytes / GIB:.1f} GiB" if n_bytes >= GIB / 10 else f"{n_bytes / 2**20:.1f} MiB"


def describe_models(
    granted: Sequence[str],
    resident: Mapping[ModelRef, ModelHost],
    runs_on: Iterable[tuple[str, str, str]],
) -> str:
    """What the `models` form answers: a line per granted model (context window, tool mode, size,
    resident or not) and a line per agent saying what it will run on and why.

    Args:
        runs_on: (agent, model, why) for each agent the caller may start.
    """
    ram = budget.total_memory()
    lines = ['Models you may name (the "model" field):'] if granted else [NO_MODELS]  # none: an engine run
    for name in granted:
        lines.append(f"- {name}: {_model_line(name, resident, ram)}")
    lines.append("What each agent runs on when you name no model:")
    lines += [f"- {agent}: {model} ({why})" for agent, model, why in runs_on]
    return "\n".join(lines)


def _model_line(name: str, resident: Mapping[ModelRef, ModelHost], ram: int) -> str:
    host = resident.get(ModelRef(name))
    if host is not None:
        size = f", {_gib(weights_bytes(host))}" if weights_bytes(host) else ""
        return f"resident; context {host.context_window:,} tokens, {host.tool_mode} tools{size}"
    if name.startswith(SCRIPTED):
        return "scripted replies (no weights)"
    try:
        folder = resolve_model_path(name, local_only=True)
    except SubagentError as exc:
        return f"not on this machine ({str(exc).split(';')[0]})"
    try:
        info = describe(name, "imported", folder, ram)
    except SubagentError as exc:  # a damaged folder: this line says so, the others stand
        return str(exc)
    if info is None:
        return f"not a model mlx-lm can run ({folder})"
    window = f"context {info.context_window:,} tokens" if info.context_window else "context unknown"
    fits = {True: "fits this machine", False: "may not fit this machine", None: "fit unknown"}[info.fits_memory]
    return f"not loaded; {window}, {info.tool_mode or 'unknown'} tools, {_gib(info.size_bytes)}; {fits}"
