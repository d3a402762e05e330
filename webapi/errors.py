"""The one error shape, `{"error": {"code", "message"}}`, for every failure the API answers; under /v1
(the OpenAI-compatible surface) the same errors take OpenAI's shape, `{"error": {"message", "type",
"param", "code"}}`, and invalid requests answer 400 as OpenAI's do, so OpenAI's clients raise their usual
exceptions (BadRequestError, AuthenticationError, NotFoundError, RateLimitError). A message starts with the
field at fault (`max_tokens: ...`), which /v1 also gives as `param`; webapi/validation.py words a request
that fails validation."""

from __future__ import annotations

import logging
import re

from flask import Flask, has_request_context, jsonify, request
from pydantic import ValidationError
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from werkzeug.exceptions import HTTPException

from webapi.validation import MISSING, problems

log = logging.getLogger(__name__)
FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")  # "messages[0].role: ..." names the field at fault
FROM_MESSAGE = "from the message"


class APIError(Exception):
    """A failure to report to the client with `status`, a stable `code` and a readable `message`; `param`
    names the field at fault (by default, the one the message starts with: "max_tokens: ...")."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: dict | None = None,
        param: str | None = FROM_MESSAGE,
    ):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}
        field = FIELD.match(message)
        self.param = (field and field.group(1)) if param is FROM_MESSAGE else param


OPENAI_PREFIX = "/v1/"
OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
}


def error_response(
    status: int, code: str, message: str, headers: dict | None = None, param: str | None = None
):
    if has_request_context() and request.path.startswith(OPENAI_PREFIX):
        return openai_error_response(status, code, message, headers, param)
    return jsonify(error={"code": code, "message": message}), status, headers or {}


def openai_error_response(
    status: int, code: str, message: str, headers: dict | None = None, param: str | None = None
):
    """The error in OpenAI's shape; 422 becomes 400, as OpenAI answers an invalid request."""
    status = 400 if status == 422 else status
    kind = OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    if param is None and (field := FIELD.match(message)):
        param = field.group(1)
    body = {"message": message, "type": kind, "param": param, "code": code}
    return jsonify(error=body), status, headers or {}


def from_validation_error(exc: ValidationError, where: str = "body", document=MISSING) -> APIError:
    """400 for a body that is not JSON; 404 model_not_found for a model this server does not serve; else
    422 naming each offending field (webapi/validation.py). `document`: the request as parsed JSON."""
    errors = exc.errors(include_url=False)
    if any(e["type"] == "json_invalid" for e in errors):
        return APIError(400, "malformed_json", f"{where} is not valid JSON: {errors[0]['msg']}")
    found = problems(exc, document)
    first = next((p for p in found if p.status != 422), found[0])  # an unknown model is the answer
    if first.status != 422:
        return APIError(first.status, first.code, str(first), param=first.param)
    text = "; ".join(str(p) if p.param else f"{where}: {p}" for p in found)
    return APIError(422, "invalid_request", text, param=first.param)


def init_errors(app: Flask) -> None:
    """Answer every error in the one JSON shape; a 5xx is logged with its traceback."""

    @app.errorhandler(APIError)
    def api_error(exc: APIError):
        return error_response(exc.status, exc.code, exc.message, exc.headers, exc.param)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        code = (exc.name or "error").lower().replace(" ", "_")
        headers = dict(exc.get_headers())
        headers.pop("Content-Type", None)
        message = exc.description or exc.name
        if exc.code == 413 and request.max_content_length:
            message = (
                f"the request body is larger than {request.max_content_length:,} bytes, the most this server "
                "takes (MAX_BODY_BYTES)"
            )
        return error_response(exc.code or 500, code, message, headers)

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
