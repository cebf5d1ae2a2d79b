"""The server's unix-socket protocol: JSON lines, the first of which (`Hello`) says what the client is.

Every message is one JSON object on one line (`wire.py`). The client's first line is a `Hello`; the
server answers `{"ok": SERVER}` (what `server.json` says) or `{"error": TEXT}` and closes. Then,
by the hello's kind:

- `mcp` (`subagent mcp`, relaying its client): MCP's JSON-RPC messages both ways, one per line, as
  on stdio; the client's roots requests and cancellations pass through unchanged.
- `job` (`run`, `parallel`, `chain`, `workflow`, `resume`): after `ok`, the server sends `{"warnings": [...]}`,
  then `{"event": EVENT}` per event (`Event.to_json()`), `{"ask": QUESTION, "id": N}` when a
  project file needs the client's consent, and last `{"result": RESULT}` (`RunResult` or
  `MultiRunResult` as `--json` dumps them), `{"error": TEXT}` (refused before anything ran) or
  `{"interrupted": REASON}` (stopped before anything ran). The client sends `{"answer": BOOL,
  "id": N}` and `{"cancel": REASON}` (Ctrl-C, SIGTERM). Closing the connection cancels the job.
- `chat`: a conversation with a parent agent (`ChatRequest`), `{"started": {"label", "workspace",
  "key"}}` once its model is loaded (or `{"error": TEXT}`); then `{"op": NAME, "id": N, ...}` runs a
  turn, a workflow, a compaction or the end, answered `{"done": N, "value": ...}` or
  `{"done": N, "error": TEXT, "type": CLASS}`; the reply streams as `{"text": PIECE}`, the events
  and consent questions as for a job. A chat whose request names an `editor` has its tools' requests
  to that editor sent as `{"editor": OP, "id": N, "call": [LABEL, TURN, ID], ...}` (`approve`, `read`,
  `write`, `run`: `serve/remote_editor.py`), answered `{"edited": N, "value": ...}` or `{"edited": N,
  "error": TEXT, "missing": BOOL}`. With the `key` it was given, a second connection whose
  hello is `control` with that key asks the quick questions (`{"call": NAME, "args": [...]}`),
  each answered at once, so that the terminal's synchronous reads (the tasks, the usage) get exact
  answers without waiting on the event stream.
- `status`: one answer, `{"status": ...}` (`subagent serve --status --json`).
- `stop`: `{"stopping": PID}`; the server cancels what runs, saves it and exits.

Why JSON lines: the CLI's renderers already take `Event`s and results, which `to_json()` and
pydantic dump and load exactly; a line is easy to frame, bound and log, and needs no dependency.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from ..runs.jobs import Job

HelloKind = Literal["mcp", "job", "chat", "control", "status", "stop"]
# The server's last line to a relay before it stops on purpose (a JSON-RPC notification the relay keeps).
STOPPING_NOTICE = "mlx-subagents/stopping"


class EditorOffer(BaseModel):
    """What a client's editor does for the chat's tools (`subagent acp` attached; `tools/editor.py`)."""

    reads_files: bool = False
    writes_files: bool = False
    runs_commands: bool = False


class ChatRequest(BaseModel):
    """`subagent chat`'s request: the parent agent, or a saved chat to continue (plan mode is in the
    options); an editor's (`subagent acp`): what its editor offers the tools, and its MCP servers
    (`{name: definition}`, as in `.mcp.json`), offered after consent."""

    agent: str
    resume: str | None = None
    editor: EditorOffer | None = None
    mcp_servers: dict[str, dict[str, Any]] = Field(default_factory=dict)


class Hello(BaseModel):
    """A client's first line.

    Args:
        cwd: the client's working directory: an MCP client without roots works there.
        workspace: the workspace it names (`subagent mcp --cwd`, a command's workspace).
        options: its `RunOptions` fields (the server's host settings replace its own).
        env_model: its `$MLX_SUBAGENTS_MODEL`, the model of tasks nothing else names one for.
        interactive: a person at its terminal can answer consent questions.
        key: a chat's key (`control`).
        call_budget: a relayed `subagent mcp`'s `--call-budget` in seconds, or "off"; None for the default.
    """

    hello: HelloKind
    version: str = ""
    pid: int | None = None
    cwd: str | None = None
    workspace: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    env_model: str | None = None
    interactive: bool = False
    job: Job | None = None
    chat: ChatRequest | None = None
    key: str | None = None
    call_budget: float | Literal["off"] | None = None

    def folder(self) -> Path | None:
        """The workspace it names, else its working directory; None for neither."""
        where = self.workspace or self.cwd
        return Path(where) if where else None
