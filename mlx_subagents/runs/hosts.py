"""`HostPool`: the resident hosts of a process, one per model, within one KV budget.

A runner makes its own pool (the hosts live as long as it does); `subagent serve` makes one pool
and gives it to every client's runner, so that every client of the machine shares one copy of each
model, one KV pool per model and one batch (`Runner(host_pool=...)`). The pool's options are the
host settings (batching, window, KV budget, prefix cache): a runner that shares a pool does not
choose them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from ..host import SharedKVBudget, make_host
from ..host.protocol import ModelHost, ProcessorFactory
from .options import RunOptions
from .tasks import ModelRef


class SessionNames:
    """The host session names the agent sessions on a pool's hosts use now: each its own.

    A host returns the existing session for a known name, so two tasks sharing a label (the same
    agent in two calls of one reply, two MCP calls, two clients of one server) would otherwise share
    one KV cache and each re-prefill its conversation at every turn. A name given back is reused: its
    host session's cache then starts the next conversation, as the shared prefix would.
    """

    def __init__(self) -> None:
        self._taken: set[str] = set()

    def claim(self, base: str) -> str:
        """`base`, else `base (2)`, `base (3)`, ...: a name no running session has."""
        name, n = base, 1
        while name in self._taken:
            n += 1
            name = f"{base} ({n})"
        self._taken.add(name)
        return name

    def release(self, name: str) -> None:
        self._taken.discard(name)


class HostPool:
    """One resident host per model, loaded (or, on an engine, reached) on first use.

    Args:
        options: what each host is built from (`RunOptions.host_settings`).
        processor_factory: logits processors for every real host (the test kit's forced scripts).
        hosts: hosts the caller made itself, by model: started at their first use like ours
            (`start` is idempotent), never stopped here.
    """

    def __init__(
        self,
        options: RunOptions,
        processor_factory: ProcessorFactory | None = None,
        hosts: Mapping[ModelRef, ModelHost] | None = None,
    ) -> None:
        self.options = options
        self.processor_factory = processor_factory
        self.hosts: dict[ModelRef, ModelHost] = dict(hosts or {})
        self._given = set(self.hosts)
        self._unstarted = set(self.hosts)
        self._lock = asyncio.Lock()
        self.kv_budget = SharedKVBudget(options.kv_budget)  # one budget across the resident models
        self.session_names = SessionNames()  # one namespace per host: every runner on the pool claims here

    def __contains__(self, model: ModelRef) -> bool:
        return model in self.hosts

    async def get(self, model: ModelRef) -> ModelHost:
        """The resident host of `model`, started now if it is not yet."""
        async with self._lock:
            if model in self._unstarted:
                self._unstarted.discard(model)
                await self.hosts[model].start()
            elif model not in self.hosts:
                settings = self.options.host_settings(model.engine, self.kv_budget, self.processor_factory)
                host = make_host(model.model, settings)
                await host.start()
                self.hosts[model] = host
            return self.hosts[model]

    async def close(self) -> None:
        """Stop the hosts this pool started (the caller's own stay as they are)."""
        hosts = [host for model, host in self.hosts.items() if model not in self._given]
        self.hosts = {model: host for model, host in self.hosts.items() if model in self._given}
        for host in hosts:
            await host.stop()
