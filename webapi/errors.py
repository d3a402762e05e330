"""The one error shape, `{"error": {"code", "message"}}`, for every failure the API answers; under /v1
(the OpenAI-compatible surface) the same errors take OpenAI's shape, `{"error": {"message", "type",
"param", "code"}}`, and invalid requests answer 400 as OpenAI's do, so OpenAI's clients raise their usual
exceptions (BadRequestError, AuthenticationError, NotFoundError, RateLimitError)."""

from __future__ import annotations

import logging
import re

from flask import Flask, has_request_context, jsonify, request
from pydantic import ValidationError
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from werkzeug.exceptions import HTTPException

log = logging.getLogger(__name__)


class APIError(Exception):
    """A failure to report to the client with `status`, a stable `code` and a readable `message`."""

    def __init__(self, status: int, code: str, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}


OPENAI_PREFIX = "/v1/"
OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
}
FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")  # "messages.0.role: ..." names the field at fault


def error_response(status: int, code: str, message: str, headers: dict | None = None):
    if has_request_context() and request.path.startswith(OPENAI_PREFIX):
        return openai_error_response(status, code, message, headers)
    return jsonify(error={"code": code, "message": message}), status, headers or {}


def openai_error_response(status: int, code: str, message: str, headers: dict | None = None):
    """The error in OpenAI's shape; 422 becomes 400, as OpenAI answers an invalid request."""
    status = 400 if status == 422 else status
    kind = OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    field = FIELD.match(message)
    body = {"message": message, "type": kind, "param": field and field.group(1), "code": code}
    return jsonify(error=body), status, headers or {}


def from_validation_error(exc: ValidationError, where: str = "body") -> APIError:
    """400 for a body that is not JSON, else 422 naming each offending field."""
    errors = exc.errors(include_url=False)
    if any(e["type"] == "json_invalid" for e in errors):
        return APIError(400, "malformed_json", f"{where} is not valid JSON: {errors[0]['msg']}")
    parts = []
    for e in errors:
        field = ".".join(str(p) for p in e["loc"]) or where
        message = e["msg"].removeprefix("Value error, ")
        parts.append(f"{field}: {message}")
    return APIError(422, "invalid_request", "; ".join(parts))


def init_errors(app: Flask) -> None:
    """Answer every error in the one JSON shape; a 5xx is logged with its traceback."""

    @app.errorhandler(APIError)
    def api_error(exc: APIError):
        return error_response(exc.status, exc.code, exc.message, exc.headers)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        code = (exc.name or "error").lower().replace(" ", "_")
        headers = dict(exc.get_headers())
        headers.pop("Content-Type", None)
        return error_response(exc.code or 500, code, exc.description or exc.name, headers)

    @app.errorhandler(OperationalError)
    @app.errorhandler(InterfaceError)
    @app.errorhandler(PoolTimeout)
    def database_down(exc: Exception):
        log.error("database unavailable: %s", getattr(exc, "orig", None) or exc)
        return error_response(
            503, "unavailable", "the database is unavailable; retry later", {"Retry-After": "5"}
        )

    @app.errorhandler(Exception)
    def internal_error(exc: Exception):
        log.exception("unhandled error")
        return error_response(500, "internal_error", "internal error (a bug); it has been logged")
