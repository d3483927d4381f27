"""Errors answered in the format of the API a client speaks (OpenAI's, or Anthropic's on the
Messages API), so every SDK raises its usual exception."""

from __future__ import annotations

from typing import Any

SHOULD_RETRY = "x-should-retry"
MESSAGES_PATH = "/v1/messages"  # Anthropic's Messages API: its errors take Anthropic's shape
# Anthropic's error types by HTTP status; it gives any other 4xx as an invalid_request_error.
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


class ApiError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}.

    `retry=False` adds `x-should-retry: false`, which the OpenAI and Anthropic SDKs obey: they
    retry a 409, a 429 and every 5xx on their own (twice by default), and for some of ours a retry
    can only repeat a whole run, or the same refusal."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.retry = retry

    def headers(self) -> dict[str, str]:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry is not None:
            headers[SHOULD_RETRY] = "true" if self.retry else "false"
        return headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self, request_id: str | None = None) -> dict[str, Any]:
        """The error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
        body: dict[str, Any] = {
            "type": "error",
            "error": {"type": anthropic_type(self.status), "message": self.message},
        }
        if request_id:
            body["request_id"] = request_id
        return body

    def body_for(self, path: str, request_id: str | None = None) -> dict[str, Any]:
        """The body in the shape of the API that `path` belongs to."""
        return self.anthropic_body(request_id) if speaks_anthropic(path) else self.body()


def speaks_anthropic(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_type(status: int) -> str:
    if status >= 500 and status != 529:
        return "api_error"
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error")


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)

