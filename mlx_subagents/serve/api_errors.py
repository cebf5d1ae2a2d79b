"""The errors of the OpenAI- and Anthropic-compatible endpoints: one exception, shaped for each API.

Every refused request is answered with one JSON error in the shape its API's SDKs read, so that a
client shows the message as it would the vendor's: OpenAI `{"error": {"message", "type", "param",
"code"}}`, Anthropic `{"type": "error", "error": {"type", "message"}}`. The message is one line that
names what was wrong and how to fix it, as everywhere in the package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ModelNotFoundError, PromptTooLongError, SubagentError

Api = Literal["openai", "anthropic"]

# The Anthropic error type of each status (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
# How the Messages API begins the message of a prompt over the context window: Claude Code knows the
# error by it (its own "Prompt is too long", to compact or trim), where it shows any other as an API error.
PROMPT_TOO_LONG = "prompt is too long: "
# The OpenAI error type of each status (what its API answers).
OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


@dataclass
class ApiError(Exception):
    """A request refused: its HTTP status, the one-line message, and for OpenAI the parameter at fault
    and a machine-readable code (`model_not_found`, `context_length_exceeded`, ...)."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message

    def body(self, api: Api) -> dict[str, Any]:
        """The JSON body of the error, as `api`'s SDKs read it."""
        if api == "anthropic":
            message = self.message
            if self.code == "context_length_exceeded":
                message = f"{PROMPT_TOO_LONG}{message}"
            return {
                "type": "error",
                "error": {"type": ANTHROPIC_TYPES.get(self.status, "api_error"), "message": message},
            }
        kind = OPENAI_TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def api_error(exc: BaseException) -> ApiError:
    """What an exception raised while answering a request tells its client.

    A `SubagentError` is the request's fault or the server's state, said in one line (a prompt over
    the window or the KV budget, a model that does not load); anything else is a fault of the server,
    logged by the caller, and answered as such."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return ApiError(400, str(exc), "messages", "context_length_exceeded")
    if isinstance(exc, ModelNotFoundError):
        return ApiError(404, str(exc), "model", "model_not_found")
    if isinstance(exc, SubagentError):
        return ApiError(400, str(exc))
    return ApiError(500, f"the server failed on this request ({type(exc).__name__}: {exc}); its log says more")


__all__ = ["Api", "ApiError", "api_error"]
