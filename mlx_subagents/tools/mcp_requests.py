"""What MCP servers ask of this client while an agent calls them: sampling, elicitation and roots.

A 2025 server's request names no tool call (on stdio nothing ties it to one), so it is answered for
the agent whose call to that server is in progress (`McpCaller`; the first of them when several agents
call the same server at once). A 2026-07-28 server asks through its call's own result (input required,
the client retries the call with the answers): that call's agent answers, with the same consent, bounds
and headless answers:

- `sampling/createMessage`: a completion on the local model, made by the calling agent's session
  (`McpCaller.sample`: its model, bounded by `maxTokens` and its limits, counted in its usage).
  Refused in one line when the agent's file says `sampling: off`, when the server comes with the
  project (`.mcp.json`, a project agent's file) and nobody consented (`--yes`, or the person of a chat,
  asked once per server), or when no agent is calling the server.
- `elicitation/create`: the person's (`Person.elicit`: a form on the terminal of `subagent chat`);
  declined, with the reason in the result's `_meta` and in the agent's events, where nobody can
  answer (a run without a terminal, `subagent mcp`, a background task), so the server's call ends
  instead of waiting for an answer that never comes.
- `roots/list`: the workspaces of the agents calling the server (at first, the workspace of the agent
  it started for). When an agent in another workspace calls it, the roots change, a 2025 server is told
  (`notifications/roots/list_changed`) and, if it listed roots before, the call waits a moment for it
  to list them again, so that a filesystem server confines itself to that workspace (a 2026-07-28
  server has no such notification: it asks within the call, and is answered the same roots).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..deadlines import within
from ..errors import McpRequestError
from ..events import ElicitationData, EventData, EventKind, SamplingData
from ..text import one_line
from ..userfiles import measure

# How deep what a server sends may nest (a tool's input schema, a result's structured content, an
# elicitation's schema): far past any real one, and far inside what a walk of it can take.
MAX_SCHEMA_DEPTH = 64


def too_deep(data: Any, what: str) -> str | None:
    """`what nests N levels deep, past the 64 accepted` (or `nests itself`) for data nested past
    `MAX_SCHEMA_DEPTH`; None for data that does not. A loop measures it, so any depth is safe."""
    depth, _ = measure(data)
    if depth <= MAX_SCHEMA_DEPTH:
        return None
    shown = "itself" if depth == float("inf") else f"{depth:g} levels deep"
    return f"{what} nested {shown}, past the {MAX_SCHEMA_DEPTH} accepted"


if TYPE_CHECKING:  # the SDK's types load with the first server (a CLI start does not pay for them)
    import mcp_types as types

# How long a call waits for its server to list the roots again after they changed; how long a server
# just started is given to ask for them (servers that use roots ask as soon as they are initialized);
# and how long after answering the server is given to take the answer in before a call goes out.
ROOTS_WAIT_S = 5.0
FIRST_ROOTS_WAIT_S = 0.3
ROOTS_SETTLE_S = 0.05
# The JSON-RPC error code a refused request gets: the spec's "the user rejected" code.
REFUSED = -1
NOBODY_CALLING = "no agent is calling this server now; it is answered only during an agent's tool call"
# The call in progress in this task: a 2026-07-28 server's requests come back to it, in its own task.
_calling: contextvars.ContextVar[McpCaller | None] = contextvars.ContextVar("mcp_calling", default=None)

Sample = Callable[[str, "types.CreateMessageRequestParams"], Awaitable["types.CreateMessageResult"]]
Report = Callable[[EventKind, EventData], None]


class Person(Protocol):
    """Who answers a server's questions during a run: the person at a chat's terminal."""

    async def elicit(self, server: str, params: types.ElicitRequestParams) -> types.ElicitResult:
        """The person's answer to a form or a URL to open: accept (with the content), decline or cancel."""
        ...

    async def confirm(self, question: str) -> bool:
        """A yes or no from the person."""
        ...


@dataclass(frozen=True)
class McpCaller:
    """The agent whose tool call is in progress on a server: what its requests are answered with.

    Args:
        path: its agent file (a server defined inline in a project agent's file is the project's).
        project: the agent comes with the project.
        sampling: its file allows sampling (`sampling: off` refuses it).
        sample: makes a completion on its model, counted in its usage (None: nothing can).
        person: who answers its servers' questions; None where nobody can, `no_person` saying why.
        report: records an event of the agent (its transcript, `--events`, the views).
    """

    label: str
    agent: str
    path: Path
    workspace: Path
    project: bool = False
    sampling: bool = True
    sample: Sample | None = None
    person: Person | None = None
    no_person: str = "nobody can answer here"
    report: Report = lambda _kind, _data: None


@dataclass
class ClientPolicy:
    """What this client lets the servers of one run do: the consent given for their sampling."""

    assume_yes: bool = False  # `--yes`: project servers may sample too
    sampling_allowed: set[str] = field(default_factory=set)  # project servers the person allowed
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one question at a time


class ServerRequests:
    """One connection's answers to its server's requests, for the agents calling it now.

    Args:
        server: the server's name; `where` its file, `project` whether that file is the project's.
        roots: the roots it is told at first (the workspace of the agent it started for).
    """

    def __init__(
        self, server: str, where: str, project: bool, policy: ClientPolicy, roots: list[Path] | None = None
    ) -> None:
        self.server, self.where, self.project = server, where, project
        self.policy = policy
        self.roots: list[Path] = list(roots or [])
        self.callers: list[McpCaller] = []
        self.session: Any = None  # the SDK's ClientSession, once initialized
        self._listed = asyncio.Event()
        self._ever_listed = False

    # -- calls -----------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def calling(self, caller: McpCaller | None) -> AsyncIterator[None]:
        """The block is `caller`'s tool call: the server's requests meanwhile are answered for it."""
        if caller is None:
            yield
            return
        self.callers.append(caller)
        reset = _calling.set(caller)
        try:
            await self._share_roots(caller.workspace)
            yield
        finally:
            _calling.reset(reset)
            self.callers.remove(caller)

    def caller(self) -> McpCaller | None:
        """Whom a request is answered for: the call it came back with (a 2026-07-28 input-required
        result is answered in its call's own task), else the first call in progress."""
        if (own := _calling.get()) is not None and own in self.callers:
            return own
        return self.callers[0] if self.callers else None

    # -- roots -----------------------------------------------------------------------------------------

    async def list_roots(self, _ctx: Any) -> types.ListRootsResult:
        import mcp_types as types

        self._ever_listed = True
        asyncio.get_running_loop().call_later(ROOTS_SETTLE_S, self._listed.set)  # once the answer is out
        return types.ListRootsResult(roots=[types.Root(uri=p.as_uri(), name=p.name or str(p)) for p in self.roots])

    async def started(self, session: Any) -> None:
        """The server is initialized: give it a moment to ask for its roots before the first call. A
        2026-07-28 server asks within a call, if at all: nothing to wait for, and no roots notification."""
        if session.initialize_result is None:
            return
        self.session = session
        with contextlib.suppress(asyncio.TimeoutError):
            await within(self._listed.wait(), FIRST_ROOTS_WAIT_S)

    async def _share_roots(self, workspace: Path) -> None:
        """Make the roots the calling agents' workspaces when `workspace` is not among them, tell the
        server, and wait (a moment) for it to list them again if it ever did."""
        if workspace in self.roots:
            return
        self.roots = sorted({c.workspace for c in self.callers} | {workspace})
        if self.session is None:
            return
        self._listed.clear()
        with warnings.catch_warnings():  # roots are deprecated in the 2026-07-28 revision, part of 2025's
            warnings.simplefilter("ignore")
            notify = self.session.send_roots_list_changed()
        try:
            await notify
        except Exception:  # a server gone: the call itself says so
            return
        if self._ever_listed:
            with contextlib.suppress(asyncio.TimeoutError):
                await within(self._listed.wait(), ROOTS_WAIT_S)

    # -- sampling ----------------------------------------------------------------------------------------

    async def sampling(
        self, _ctx: Any, params: types.CreateMessageRequestParams
    ) -> types.CreateMessageResult | types.ErrorData:
        import mcp_types as types

        caller = self.caller()
        refusal = NOBODY_CALLING if caller is None else await self._sampling_refusal(caller)
        if refusal is None and caller is not None and caller.sample is not None:
            try:
                return await caller.sample(self.server, params)
            except McpRequestError as exc:
                refusal = str(exc)
        refusal = refusal or "sampling refused: no model can answer here"
        if caller is not None:
            caller.report("sampling", _refused_sample(self.server, refusal))
        return types.ErrorData(code=REFUSED, message=refusal)

    async def _sampling_refusal(self, caller: McpCaller) -> str | None:
        """Why this caller's server may not sample, or None: its agent's `sampling: off`, or a project
        server nobody consented to (the person is asked once per server)."""
        if not caller.sampling:
            return f"sampling refused: agent '{caller.agent}' says sampling: off ({caller.path})"
        theirs = self.project or (caller.project and self.where == str(caller.path))
        policy = self.policy
        if not theirs or policy.assume_yes or self.server in policy.sampling_allowed:
            return None
        async with policy.lock:
            if self.server not in policy.sampling_allowed and caller.person is not None:
                question = (
                    f"MCP server '{self.server}' comes with the project ({self.where}) and asks the local model "
                    "for a completion (sampling). Allow it for this run?"
                )
                if await caller.person.confirm(question):
                    policy.sampling_allowed.add(self.server)
        if self.server in policy.sampling_allowed:
            return None
        return (
            f"sampling refused: MCP server '{self.server}' comes with the project ({self.where}) and may use the "
            "local model only with consent; re-run with --yes to allow it"
        )

    # -- elicitation -------------------------------------------------------------------------------------

    async def elicitation(self, _ctx: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        import mcp_types as types

        caller = self.caller()
        person = caller.person if caller is not None else None
        deep = too_deep(params.model_dump(by_alias=True).get("requestedSchema"), "its requested schema is")
        if person is None or deep is not None:
            reason = deep or (caller.no_person if caller is not None else NOBODY_CALLING)
            if caller is not None:
                caller.report("elicitation", _asked(self.server, params, "decline", reason))
            return types.ElicitResult(action="decline", _meta={"reason": reason})
        result = await person.elicit(self.server, params)
        assert caller is not None
        caller.report("elicitation", _asked(self.server, params, result.action, None))
        return result


def _asked(server: str, params: types.ElicitRequestParams, action: str, reason: str | None) -> ElicitationData:
    return ElicitationData(
        server=server, message=one_line(params.message, 500), mode=params.mode, action=action, reason=reason
    )


def _refused_sample(server: str, reason: str) -> SamplingData:
    return SamplingData(
        server=server, model="", input_tokens=0, cached_tokens=0, output_tokens=0, stop_reason="", error=reason
    )


__all__ = ["ClientPolicy", "McpCaller", "Person", "ServerRequests"]
