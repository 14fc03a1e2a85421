"""The gateway's HTTP errors, in OpenAI's shape (each API's own shape is made from them:
anthropic_api.error_body, the Ollama routes')."""
from __future__ import annotations

import math


class ApiError(Exception):
    """An HTTP error with OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict:
        h = {}
        if self.retry_after is not None:
            h["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        if self.status == 401:
            h["WWW-Authenticate"] = "Bearer"
        return h


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_request")
