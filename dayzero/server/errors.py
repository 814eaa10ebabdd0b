"""Errors a client can see, in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause is raised as an :class:`APIError` with the right status; the app turns it
into a JSON response (or, inside a stream, into a final ``data:`` event followed by ``[DONE]``).
"""
from __future__ import annotations

from http import HTTPStatus

# status -> OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    if code is None:
        code = HTTPStatus(status).phrase.lower().replace(" ", "_") if status in HTTPStatus._value2member_map_ else None
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


# fields whose name has no underscore; the others are recognised by their "snake_case" form
_FIELDS = {"n", "temperature", "seed", "stop", "logprobs", "prompt"}


def param_of(message: str) -> str | None:
    """The field a ``SamplingParams`` or engine ``ValueError`` names: its message starts with the field."""
    head = message.split(" ", 1)[0]
    if head in _FIELDS or ("_" in head and head.replace("_", "").isalpha() and head.islower()):
        return head
    return None
