"""Request ids and the API's log context (contract/log_setup.py).

Each request gets an id: the caller's `X-Request-ID` when it sends a sensible one, else a new one; the response
echoes it in `X-Request-ID`. Every line logged while the request is served carries it as `request_id`, with
`tenant` once the API key is checked and `job_id` when the request names a job (its path) or made one (POST
/jobs' Location). With LOG_FORMAT=json the API also logs one line per answered request (logger
`webapi.requests`: method, path, status, duration_ms), in place of gunicorn's plain-text access log.
"""

from __future__ import annotations

import logging
import time

from flask import Flask, Response, g, has_request_context, request

from contract.log_setup import add_source, bind, new_request_id, unbind

HEADER = "X-Request-ID"
log = logging.getLogger("webapi.requests")


def init_request_log(app: Flask, fmt: str) -> None:
    """Request ids for `app`'s requests; with `fmt` json, a line per request."""
    add_source(_request_fields)
    app.before_request(_start)
    app.after_request(_finish_json if fmt == "json" else _finish)
    app.teardown_request(_unbind)


def _start() -> None:
    g.request_id = new_request_id(request.headers.get(HEADER))
    g.log_tokens = bind(request_id=g.request_id)
    g.started = time.perf_counter()


def _finish(response: Response) -> Response:
    if "request_id" in g:
        response.headers[HEADER] = g.request_id
    return response


def _finish_json(response: Response) -> Response:
    response = _finish(response)
    location = response.headers.get("Location", "")
    extra = {"job_id": location.rsplit("/", 1)[1]} if location.startswith("/jobs/") else {}
    log.info(
        "%s %s %d",
        request.method,
        request.path,
        response.status_code,
        extra={
            "method": request.method,
            "path": request.path,
            "status": response.status_code,
            "duration_ms": round((time.perf_counter() - g.get("started", time.perf_counter())) * 1000, 2),
            **extra,
        },
    )
    return response


def _unbind(_exc: BaseException | None) -> None:
    unbind(g.pop("log_tokens", []))


def _request_fields() -> dict[str, object]:
    """The tenant (after auth) and the job a request's path names, for a line logged while it is served."""
    if not has_request_context():
        return {}
    tenant = g.get("tenant")
    view_args = request.view_args or {}
    return {"tenant": tenant.id if tenant is not None else None, "job_id": view_args.get("job_id")}
