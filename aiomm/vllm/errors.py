"""OpenAI-style API errors: a status code and ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

from typing import Any

from aiomm.errors import (
    AiommError,
    BlockedAddressError,
    EngineClosedError,
    ImageTooLargeError,
    InvalidRequestError,
    ItemCountMismatchError,
    ItemRejectedError,
    MediaError,
    OverloadedError,
)
from aiomm.redaction import redact

__all__ = ("ApiError", "from_aiomm_error")


class ApiError(Exception):
    """Raised for a request the server refuses; rendered as an OpenAI error body (credentials
    in a URL it quotes masked, :func:`aiomm.redaction.redact`)."""

    def __init__(
        self, message: str, *, status: int = 400, type: str | None = None, param: str | None = None
    ) -> None:
        message = redact(message)
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or {
            404: "NotFoundError",
            413: "RequestTooLargeError",
            503: "ServiceUnavailableError",
        }.get(status, "BadRequestError" if status < 500 else "InternalServerError")
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


def from_aiomm_error(exc: AiommError) -> ApiError:
    """The API error for an engine error: the client's fault is a 4xx naming what was wrong."""
    name = type(exc).__name__
    if isinstance(exc, BlockedAddressError):
        return ApiError(f"{name}: {exc}", status=400, param="image_url")
    if isinstance(exc, ImageTooLargeError):
        return ApiError(f"{name}: {exc}", status=400, param="image_url")
    if isinstance(exc, (MediaError, InvalidRequestError)):
        return ApiError(f"{name}: {exc}", status=400)
    if isinstance(exc, ItemRejectedError):
        # the model's processor refuses the client's item (vLLM: a 400 naming no parameter)
        return ApiError(f"{name}: {exc}", status=400)
    if isinstance(exc, ItemCountMismatchError):
        # the prompt's placeholders are the client's text (an image token typed in a message)
        return ApiError(f"{name}: {exc}", status=400, param="messages")
    if isinstance(exc, (OverloadedError, EngineClosedError)):
        # not the request's fault and not a bug: a client may retry (the openai client does)
        return ApiError(f"{name}: {exc}", status=503)
    return ApiError(f"{name}: {exc}", status=500)
