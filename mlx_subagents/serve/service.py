"""`subagent serve`: one process per state folder that holds the models and runs every client's agents.

It keeps one `HostPool` (one copy of each model, one KV budget) and gives each client a runner of
its own over it (`clients.py`): every client's sessions decode in one batch and share the agents'
prefixes, while its workspace, consent, board, ids and sandbox stay its own. It listens on:

- streamable HTTP at `http://127.0.0.1:PORT/mcp` (`http_app.py`), the same tools as `subagent mcp`, for
  clients configured with a URL, behind a bearer token and Host/Origin checks;
- a unix socket (0600) for the project's own front ends (`protocol.py`): `subagent mcp` relays its
  client there, the CLI's commands attach there, `--status` and `--stop` ask there.

A client that goes away has its foreground tasks cancelled and saved; its background tasks run on
until they end or the server stops. A stop (`--stop`, SIGINT, SIGTERM, SIGHUP) cancels every task,
lets each say what it had done to its client, saves, and exits. Nothing a client sends stops it: a
malformed or oversized message is answered and logged. The log is `$MLX_SUBAGENTS_HOME/logs/serve.log`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .. import __version__
from ..errors import SubagentError
from ..events import EventSink, Fanout
from ..host.protocol import ProcessorFactory
from ..mcp_server.budget import DEFAULT_CALL_BUDGET
from ..mcp_server.call_tasks import CallTasks
from ..mcp_server.server import AgentsServer
from ..mcp_server.server_log import setup_logging
from ..mcp_server.stdio import stop_signals
from ..results import stop_reason
from ..runs.hosts import HostPool
from ..runs.options import RunOptions
from ..runs.published import Publisher
from ..runs.runner import Runner
from ..runs.tasks import ModelRef
from ..tools.sandbox import sandbox_problem
from . import attached
from .clients import DISCONNECTED, Client, ClientKind, Clients
from .protocol import STOPPING_NOTICE, Hello
from .socket_mcp import serve_mcp
from .state import ServePaths, ServerInfo, claim, new_token, serve_paths, write_info
from .wire import Oversized, load, read_lines, send

DEFAULT_PORT = 8421
# The run options a client never chooses on a server: the hosts are the server's, made once for all.
HOST_FIELDS = ("batching", "kv_budget", "prefix_cache", "context_window", "engine", "api_key", "default_model")
# How long a stop waits for the tasks it cancelled to answer their clients and save.
STOP_WAIT_S = 15.0
STOPPED = "the server stopped (subagent serve --stop)"

log = logging.getLogger("mlx_subagents.serve")


@dataclass(frozen=True)
class ServeConfig:
    """What a server is started with.

    Args:
        options: its host settings; `model` is loaded at start and is the model of the clients'
            tasks that name none (a client's own `$MLX_SUBAGENTS_MODEL` first).
        cwd: the workspace of an HTTP client that gives none (no roots, no `?cwd=`).
        port: the HTTP port on 127.0.0.1 (0: any free one); None: no HTTP, the socket only.
        processor_factory: logits processors for every real host (the test kit's forced scripts).
    """

    options: RunOptions
    cwd: Path
    port: int | None = DEFAULT_PORT
    processor_factory: ProcessorFactory | None = None


class Service:
    """The running server: the pool, the clients, and what each connection asks."""

    def __init__(self, config: ServeConfig, paths: ServePaths, token: str) -> None:
        self.config = config
        self.paths = paths
        self.token = token
        self.pool = HostPool(replace(config.options, model=None), config.processor_factory)
        self.clients = Clients()
        self.started = time.time()
        # `--model` as it loads at start (`_preload`): since when, and why it did not load.
        self.loading: tuple[str, float] | None = None
        self.load_error: dict[str, str] | None = None
        self.url: str | None = None
        self.info: ServerInfo | None = None
        self.stopping = asyncio.Event()
        self.stop_reason = STOPPED
        self._lingering: set[asyncio.Task[None]] = set()
        self.chats: dict[str, Any] = {}  # attached chats by the key their control connection gives
        # The MCP calls answered with a task, for every client: a client that reconnects reads its tasks.
        self.calls = CallTasks()
        self.api: Any = None  # the chat endpoints (`endpoints.ApiFront`), made with the HTTP app
        # `subagent watch` shows the MCP clients' tasks under the server (an attached command's
        # tasks are published by the command itself, under its own pid).
        self.publisher = Publisher("serve: the tasks of its MCP clients", cwd=config.cwd, pool=self.pool)

    # -- clients -----------------------------------------------------------------------------------

    def client_options(self, given: dict[str, Any], env_model: str | None = None) -> RunOptions:
        """A client's run options: its own choices, the server's host settings (`HOST_FIELDS`)."""
        server = self.config.options
        own = {f.name for f in dataclasses.fields(RunOptions)} - set(HOST_FIELDS)
        chosen = {name: value for name, value in given.items() if name in own}
        default = env_model or server.model or server.default_model
        return replace(server, **{"model": None, **chosen, "default_model": default})

    def add_client(self, kind: ClientKind, options: RunOptions, *, pid: int | None = None, name: str = "") -> Client:
        client = self.clients.add(Client(kind, options, pid=pid, name=name))
        log.info("client %s connected: %s%s", client.id, name or kind, f" (pid {pid})" if pid else "")
        return client

    def make_runner(
        self, client: Client, root: Path, on_event: EventSink, *, interactive: bool = False, ask: Any = None
    ) -> Runner:
        """A runner of `client`'s own, in `root`, over the server's hosts."""
        if not root.is_dir():
            raise SubagentError(f"the workspace {root} is not a folder on this machine; name an existing one")
        runner = Runner(
            cwd=root,
            options=client.options,
            on_event=Fanout([client.tally.handle, on_event]),
            host_pool=self.pool,
            interactive=interactive,
            ask=ask,
        )
        client.workspace = runner.cwd
        client.runners.append(runner)
        return runner

    def mcp_client(
        self,
        kind: ClientKind,
        options: RunOptions,
        *,
        cwd: Path | None,
        here: Path | None,
        pid: int | None = None,
        call_budget: float | None = DEFAULT_CALL_BUDGET,
    ) -> Client:
        """A client of the MCP tools: `AgentsServer`'s handlers over a runner of its own."""
        client = self.add_client(kind, options, pid=pid, name="subagent mcp" if kind == "relay" else "HTTP")
        published = lambda event: self.publisher.handle(replace(event, label=f"{client.id}/{event.label}"))  # noqa: E731
        make = lambda root, sink: self.make_runner(client, root, Fanout([sink, published]))  # noqa: E731
        client.agents = AgentsServer(make, cwd, call_budget, here=here, calls=self.calls)
        return client

    async def disconnect(self, client: Client) -> None:
        """`client` went away: its foreground tasks are cancelled (and saved); its background ones run on,
        and its runners close once they end."""
        if not client.connected:
            return
        client.connected = False
        client.cancel(DISCONNECTED, background=False)
        log.info("client %s disconnected", client.id)
        task = asyncio.ensure_future(self._linger(client))
        self._lingering.add(task)
        task.add_done_callback(self._lingering.discard)

    async def _linger(self, client: Client) -> None:
        try:
            while client.background_alive():
                board = client.agents.tasks.board  # type: ignore[union-attr]
                await asyncio.wait([asyncio.ensure_future(h.join()) for h in board.alive()])
            await self._close_client(client)
        except Exception:
            log.exception("client %s did not close cleanly", client.id)

    async def _close_client(self, client: Client) -> None:
        if client.agents is not None:
            await client.agents.close()
        for runner in client.runners:
            await runner.close()
        self.clients.remove(client)

    # -- connections on the unix socket -----------------------------------------------------------------

    async def on_socket(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: its hello, then what that kind of client does (`protocol.py`)."""
        lines = read_lines(reader)
        try:
            first = await anext(lines, None)
            hello = self._hello(first, writer)
            if hello is not None and not self.stopping.is_set():
                await self._serve(hello, lines, writer)
            elif hello is not None:
                send(writer, {"error": f"the server is stopping ({self.stop_reason})"})
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except SubagentError as exc:  # the client's options or workspace: what is wrong, in one line
            send(writer, {"error": str(exc)})
        except Exception:  # never let one connection stop the server
            log.exception("a connection failed")
        finally:
            writer.close()

    def _hello(self, line: str | Oversized | None, writer: asyncio.StreamWriter) -> Hello | None:
        """The connection's hello, or None (a malformed one answered with what is wrong, and logged)."""
        if line is None:
            return None
        data = load(line) if isinstance(line, str) else None
        if isinstance(line, Oversized):
            problem = f"it is {line.n_bytes:,} bytes, over the limit"
        elif data is None:
            problem = "it is not a JSON object"
        else:
            try:
                return Hello.model_validate(data)
            except ValidationError as exc:
                err = exc.errors()[0]
                problem = f"{'.'.join(map(str, err['loc'])) or 'hello'}: {err['msg']}"
        log.warning("a malformed hello on the socket: %s", problem)
        send(
            writer, {"error": f"malformed hello ({problem}); the first line names what the client is (see protocol.py)"}
        )
        return None

    async def _serve(self, hello: Hello, lines: Any, writer: asyncio.StreamWriter) -> None:
        if hello.hello == "status":
            send(writer, {"status": await self.status()})
        elif hello.hello == "stop":
            send(writer, {"stopping": os.getpid()})
            self.request_stop(STOPPED)
        elif hello.hello == "mcp":
            options = self.client_options(hello.options, hello.env_model)
            workspace = Path(hello.workspace) if hello.workspace else None
            here = Path(hello.cwd) if hello.cwd else None
            budget = None if hello.call_budget == "off" else hello.call_budget or DEFAULT_CALL_BUDGET
            client = self.mcp_client("relay", options, cwd=workspace, here=here, pid=hello.pid, call_budget=budget)
            client.notify = lambda message: send(writer, message)
            send(writer, {"ok": self.info.model_dump() if self.info else {}})
            try:
                ended = lambda: client.cancel(DISCONNECTED, background=False)  # noqa: E731
                await serve_mcp(client.agents, lines, writer, ended)  # type: ignore[arg-type]
            finally:
                await self.disconnect(client)
        else:
            await attached.serve(self, hello, lines, writer)

    # -- status and stop ----------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        """What `subagent serve --status --json` prints."""
        models = [await model_summary(ref, host) for ref, host in list(self.pool.hosts.items())]
        loading = self.loading and {"model": self.loading[0], "since_s": round(time.time() - self.loading[1], 1)}
        return {
            "server": {
                **(self.info.model_dump() if self.info else {}),
                "uptime_s": round(time.time() - self.started, 1),
            },
            "models": models,
            "loading": loading or None,
            "load_error": self.load_error,
            "kv": {
                # 0: unbounded; None: the default, sized when a model loads (half the RAM its weights leave)
                "budget": sum(m["kv_budget"] or 0 for m in models) or self.pool.kv_budget.request,
                "used": sum(m["kv_bytes"] for m in models),
            },
            "clients": [c.summary() for c in self.clients],
            "tasks": self.clients.tasks(),
            "sessions": self.api.summaries() if self.api is not None else [],
        }

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason
        self.stopping.set()

    async def shutdown(self) -> None:
        """Cancel every task of every client, wait (a while) until they have answered and saved, close."""
        reason = self.stop_reason
        log.info("stopping: %s", reason)
        waits: list[asyncio.Future[Any]] = []
        for client in self.clients:
            if client.notify is not None:  # the relay exits once its calls are answered (`relay.py`)
                client.notify({"jsonrpc": "2.0", "method": STOPPING_NOTICE, "params": {"reason": reason}})
            if client.agents is not None:
                waits.append(asyncio.ensure_future(client.agents.stop(reason, STOP_WAIT_S)))
            client.cancel(reason)
            if client.work is not None:
                waits.append(client.work)
        if waits:
            await asyncio.wait(waits, timeout=STOP_WAIT_S)
        for client in self.clients:
            client.connected = False
            await self._close_client(client)
        for task in list(self._lingering):
            task.cancel()

    # -- the process -------------------------------------------------------------------------------

    async def run(self) -> int:
        """Listen until a stop; the exit code (0, or 128 + the signal that stopped it)."""
        unix = await listen_unix(self.on_socket, self.paths.socket)
        http = None
        if self.config.port is not None:
            from .http_app import start_http

            http, self.url = await start_http(self, self.config.port)
        self.info = ServerInfo(
            pid=os.getpid(),
            version=__version__,
            home=str(self.paths.home),
            socket=str(self.paths.socket),
            url=self.url,
            log=str(self.paths.log),
            started=self.started,
        )
        write_info(self.paths, self.info)
        log.info("mlx-subagents %s serving %s; log %s", __version__, self.info.where(), self.paths.log)
        if notice := await asyncio.to_thread(sandbox_notice):
            log.warning("%s", notice)
        preload = asyncio.ensure_future(self._preload())
        stopped: list[signal.Signals] = []

        def on_signal(signum: signal.Signals) -> None:
            stopped.append(signum)
            self.request_stop(stop_reason(signum))

        try:
            with stop_signals(on_signal):  # a second signal exits at once
                await self.stopping.wait()
                preload.cancel()
                await self.shutdown()
        finally:
            unix.close()
            if http is not None:
                await http.stop()
            await self.pool.close()
            self.publisher.close()
            log.info("stopped")
        return 128 + stopped[0] if stopped else 0

    async def _preload(self) -> None:
        """Load `--model` now, so that the first client does not wait for it."""
        model = self.config.options.model
        if model is None:
            return
        self.loading = (model, time.time())
        try:
            host = await self.pool.get(ModelRef(model))
            log.info("loaded %s (context window %d tokens)", host.model_id, host.context_window)
        except SubagentError as exc:
            log.warning("the model %s did not load: %s", model, exc)
            self.load_error = {"model": model, "error": str(exc)}
        finally:
            self.loading = None


async def model_summary(ref: ModelRef, host: Any) -> dict[str, Any]:
    """One resident model's line in `--status`: its weights, KV budget and use, sessions, biggest batch."""
    weights = getattr(host, "weights_bytes", None)
    return {
        "model": str(ref),
        "weights_bytes": weights() if callable(weights) else 0,
        "kv_budget": getattr(host, "kv_budget", None),
        "kv_bytes": getattr(host, "kv_bytes_total", 0),
        "sessions": getattr(host, "n_sessions", 0),
        "most_decoding": getattr(host, "most_decoding", 0),
        "drafts": _drafts(host),
        "context_window": host.context_window,
    }


def _drafts(host: Any) -> dict[str, Any] | None:
    """A model's drafting for `--status`: its `--draft`, whether it drafts, its replies' drafted and
    accepted tokens summed; None for a host that does not draft (an engine, a script)."""
    counts = getattr(host, "drafts", None)
    if counts is None:
        return None
    return {"mode": host.draft, "on": host.drafting, "drafted": counts.drafted, "accepted": counts.accepted}


async def listen_unix(handler: Any, path: Path) -> asyncio.base_events.Server:
    """The unix socket at `path`, made 0600 before anyone can connect (the umask is set around the bind)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a stale socket of a server that died: `claim` holds the lock now
    old = os.umask(0o177)
    try:
        server = await asyncio.start_unix_server(handler, path=str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return server


def sandbox_notice() -> str:
    """The line a server says at its start where no sandboxed bash can run on this machine, "" where one
    can: its clients' project agents (and any run with --sandbox on) would otherwise learn it only from
    a refused tool call, which their person may never read."""
    problem = sandbox_problem()
    return (
        f"project agents' bash (and any run with --sandbox on) is refused on this machine: {problem}" if problem else ""
    )


async def serve(config: ServeConfig, home: Path | None = None) -> int:
    """Run the server of the state folder until it is stopped; refused when one already runs."""
    paths = serve_paths(home)
    with claim(paths):
        setup_logging(paths.log)
        service = Service(config, paths, new_token(paths))
        return await service.run()


__all__ = ["DEFAULT_PORT", "ServeConfig", "Service", "serve"]
