"""One exception hierarchy for the whole package.

Every `SubagentError` carries a one-line message a user can act on; the CLI's
single error boundary prints it without a traceback.
"""


class SubagentError(Exception):
    """Base class: bad input or an environment problem, explained in one line."""


class ModelNotFoundError(SubagentError):
    """The model path or hub id cannot be resolved (missing folder, offline, no weights)."""


class ModelLoadError(SubagentError):
    """The model files exist but mlx-lm could not load them."""


class ChatTemplateError(ModelLoadError):
    """The model has no chat template, or its template refuses a conversation the host normalised."""


class ModelImportError(SubagentError):
    """A GGUF file cannot be imported (unsupported architecture, tokenizer or tensor type; name taken)."""


class EngineError(SubagentError):
    """An inference engine (`--engine URL`) cannot be reached, refused a request or broke off a reply."""


class PromptTooLongError(SubagentError):
    """A prompt does not fit the context window or an input cap."""


class AgentFileError(SubagentError):
    """An agent markdown file is malformed (bad frontmatter, missing field, unknown tool)."""


class AgentNotFoundError(SubagentError):
    """No discovered agent has the requested name."""


class ConfirmationRequired(SubagentError):
    """A project-local agent needs the user's consent before it runs."""


class ScriptError(SubagentError):
    """A scripted-model file is malformed or a session ran out of replies."""


class ToolError(SubagentError):
    """A tool call failed; its message goes back to the model as the tool result."""


class FileChangedError(ToolError):
    """A file changed between a tool's read and its replacement (another task or process wrote it)."""


class WorkspaceEscapeError(ToolError):
    """A path resolves outside the workspace (`..`, absolute path or symlink)."""


class InputTooLargeError(SubagentError):
    """A task, system prompt or whole request is over its size cap."""


class WorkflowError(SubagentError):
    """A workflow file is invalid (unknown agent or need, duplicate id, cycle)."""


class RequestError(SubagentError):
    """A run request is invalid: too many tasks, a duplicate label, a bad placeholder or tasks file."""


class GrammarError(SubagentError):
    """The grammar cannot hold a reply to a client's schemas: `part` says which (`answer`, `tool` named
    `tool`, or `tools` together), refused before the turn is admitted; or the grammar failed while it held
    a reply (`reply`), which then ends with this error rather than go on unconstrained."""

    def __init__(self, message: str, part: str, tool: str | None = None) -> None:
        super().__init__(message)
        self.part, self.tool = part, tool


class SchemaFileError(SubagentError):
    """An output schema (`--schema FILE.json` or `output_schema`) is not a valid JSON schema."""


class StateHomeError(SubagentError):
    """The state folder (`$MLX_SUBAGENTS_HOME`) cannot hold what must be saved (not a folder, read-only)."""


class DamagedStateError(SubagentError):
    """A state file (a worktree manifest, a prefix file, a run record) is damaged or not a regular file."""


class RunNotFoundError(SubagentError):
    """No saved run (or task in it) matches the id given to `show` or `resume`."""


class TaskNotFoundError(SubagentError):
    """No background task of this parent has the id given (`task_output`, `handle.board.get`)."""


class TaskStateError(SubagentError):
    """A task cannot do what was asked in its state (a message to a cancelled task, output of a queued one)."""


class McpConfigError(SubagentError):
    """An MCP server definition (`.mcp.json`, the home's `mcp.json`, `mcpServers:`) is invalid."""


class McpRequestError(SubagentError):
    """A request an MCP server made of this client (sampling) that it refuses: the message says why."""


class McpAuthError(McpConfigError):
    """An MCP server over HTTP wants a sign-in this run cannot do: no token, or the token was refused."""


class ConfigError(SubagentError):
    """`$MLX_SUBAGENTS_HOME/config.toml` holds a key this version does not know, or a value its flag refuses."""
