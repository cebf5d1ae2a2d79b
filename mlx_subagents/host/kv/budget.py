"""The KV budget's arithmetic, apart from the model it bounds: the machine's memory, the budget a host
derives from it, sizes as people write them (`--kv-budget 4GB`) and `SharedKVBudget`, one budget split
between resident models. Here, not in `mlx_host.py`, so that a process that only parses a budget or
runs a scripted or engine model (the CLI, the tests' processes) never imports mlx-lm and transformers."""

from __future__ import annotations

import math
import os
from typing import Protocol

from pydantic import ByteSize, TypeAdapter, ValidationError

from ...errors import SubagentError

# The window must fit this many sessions at once: four children and their parent.
DEFAULT_MAX_SESSIONS = 5
# Share of (RAM - weights) the KV pool may use when no budget is given, and never less than
# MIN_KV_BUDGET bytes.
DEFAULT_BUDGET_FRACTION = 0.5
MIN_KV_BUDGET = 256 * 2**20
BINARY_SUFFIXES = {"k": "KiB", "m": "MiB", "g": "GiB"}
_BYTE_SIZE = TypeAdapter(ByteSize)


class BudgetedHost(Protocol):
    """What a shared budget asks of a resident host (`MlxModelHost`): its weights and a new share."""

    def weights_bytes(self) -> int: ...

    async def set_kv_budget(self, budget: int | None) -> None: ...


def total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def default_kv_budget(ram: int, weights: int) -> int:
    """The KV budget the host derives when none is given, for `ram` bytes of memory and `weights` bytes of model."""
    return max(MIN_KV_BUDGET, int((ram - weights) * DEFAULT_BUDGET_FRACTION))


class SharedKVBudget:
    """One KV budget for every resident model of a runner, split evenly between them.

    Each host alone would size its budget from RAM minus its own weights, so two resident models could
    together promise the KV caches more memory than the machine has. Here the total is the request
    (`--kv-budget`), or half of the free RAM minus the weights of every resident model; a model
    loading takes its share and the others shrink to theirs (their idle caches over it are evicted;
    admission control keeps their new turns within it).
    """

    def __init__(self, kv_budget: int | str | None = None) -> None:
        self.request = parse_bytes(kv_budget)
        self.hosts: list[BudgetedHost] = []

    def share_for(self, host: BudgetedHost, free: int | None = None) -> tuple[int | None, int | None]:
        """(`host`'s share, the total) if it joins the hosts already resident; None: unbounded.

        Args:
            free: the RAM other processes' models leave (`resident.free_memory`; default: all of it).
        """
        hosts = [*self.hosts, host]
        if self.request == 0:
            return None, None
        ram = total_memory()
        if self.request is not None:
            total = self.request
        elif ram:
            total = default_kv_budget(ram if free is None else free, sum(h.weights_bytes() for h in hosts))
        else:
            return None, None
        return total // len(hosts), total

    async def join(self, host: BudgetedHost, share: int | None) -> None:
        """`host` has started on `share`: the others shrink to the same."""
        for other in self.hosts:
            await other.set_kv_budget(share)
        self.hosts.append(host)


def parse_bytes(text: str | int | None) -> int | None:
    """`4GB`, `512MiB`, `512m` (MiB), `1e9`, `0` (unbounded), `0.25` (a fraction of RAM) or None (default)."""
    if text is None or isinstance(text, int):
        return text
    size = text.strip()
    try:
        value = float(size)
    except ValueError:
        pass
    else:
        if not math.isfinite(value) or value < 0:
            raise _not_a_size(text)
        return int(value * total_memory()) if 0 < value < 1 else int(value)
    # A bare k, m or g means KiB, MiB, GiB, as in `docker -m 512m`; pydantic's ByteSize reads them as 10^3, 10^6, 10^9.
    if size[-1:].lower() in BINARY_SUFFIXES:
        size = size[:-1] + BINARY_SUFFIXES[size[-1].lower()]
    try:
        return int(_BYTE_SIZE.validate_python(size))
    except ValidationError:
        raise _not_a_size(text) from None


def _not_a_size(text: str) -> SubagentError:
    return SubagentError(f"KV budget {text!r} is not a size; use e.g. 4GB, 512MiB, 0 (unbounded) or 0.25 (of RAM)")
