"""Log lines of every genq process (API, worker, engine process, beat): plain text by default, one JSON object
a line with LOG_FORMAT=json (python-json-logger), each line carrying what is known of the request and the job
it is about: `request_id`, `job_id`, `tenant` (the tenant's id).

Where they come from:
- the API sets `request_id` for each request it serves (X-Request-ID, or one made up; echoed in the response:
  webapi/request_log.py) and adds the authenticated tenant and the request's job (a source: `add_source`);
- a worker passes a job's fields with a line about it (`extra=job_fields(job)`), or sets them for a block
  (`job_context`): a worker handles hundreds of jobs in one thread, so a context per job lasts only as long
  as the work on that job.

`ContextFilter` adds them to each record; `configure` installs it (and, for json, the JSON formatter) on the
handlers a process logs through. The context lives in contextvars: each thread, and each gevent greenlet of
the API, has its own.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from pythonjsonlogger.json import JsonFormatter

FORMATS = ("text", "json")
FIELDS = ("request_id", "job_id", "tenant")
_VARS: dict[str, ContextVar[str | None]] = {name: ContextVar(f"genq_{name}", default=None) for name in FIELDS}
_SOURCES: list[Callable[[], Mapping[str, Any]]] = []  # more fields, read when a line is logged (the API's)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_format() -> str:
    """LOG_FORMAT (contract/settings.py documents it): "text" (the default) or "json"."""
    value = (os.environ.get("LOG_FORMAT") or "text").strip().lower()
    if value not in FORMATS:
        raise ValueError(f"LOG_FORMAT must be one of {', '.join(FORMATS)}, not {value!r}")
    return value


def job_fields(job: Any) -> dict[str, str]:
    """The log fields of a job row (anything with `id` and `tenant_id`): `log.info(..., extra=job_fields(job))`."""
    return {"job_id": str(job.id), "tenant": str(job.tenant_id)}


def bind(**fields: Any) -> list:
    """Set context fields (request_id, job_id, tenant) until `unbind(tokens)`; None leaves a field as it is."""
    return [(_VARS[name], _VARS[name].set(str(value))) for name, value in fields.items() if value is not None]


def unbind(tokens: list) -> None:
    for var, token in reversed(tokens):
        var.reset(token)


@contextmanager
def job_context(job_id: Any, tenant: Any = None) -> Iterator[None]:
    """Lines logged in the block are about job `job_id` (of `tenant`)."""
    tokens = bind(job_id=job_id, tenant=tenant)
    try:
        yield
    finally:
        unbind(tokens)


def new_request_id(header: str | None) -> str:
    """The caller's X-Request-ID when it is a sensible one (1-128 printable ASCII characters), else a new id."""
    if header and len(header) <= 128 and header.isascii() and header.isprintable() and header.strip():
        return header.strip()
    return uuid.uuid4().hex


def add_source(source: Callable[[], Mapping[str, Any]]) -> None:
    """`source()` gives more fields for each line, when known (the API's tenant and job, read from the request)."""
    if source not in _SOURCES:
        _SOURCES.append(source)


class ContextFilter(logging.Filter):
    """Adds request_id, job_id and tenant to a record where known (fields passed with `extra=` win)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, var in _VARS.items():
            if getattr(record, name, None) is None and (value := var.get()) is not None:
                setattr(record, name, value)
        for source in _SOURCES:
            try:
                fields = source()
            except Exception:  # noqa: BLE001 - a field it cannot read now is not logged
                continue
            for name, value in fields.items():
                if value is not None and getattr(record, name, None) is None:
                    setattr(record, name, str(value))
        return True


def json_formatter(process: str) -> logging.Formatter:
    """One JSON object a line: time, level, logger, message, pid, thread, service (api, worker, engine, beat),
    the context fields where known, and exc_info / stack_info when there are."""
    return JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s %(process)d %(threadName)s",
        rename_fields={
            "asctime": "time",
            "levelname": "level",
            "name": "logger",
            "process": "pid",
            "threadName": "thread",
        },
        static_fields={"service": process},
        datefmt="%Y-%m-%dT%H:%M:%S%z",
    )


def install(handler: logging.Handler, process: str, fmt: str | None = None) -> None:
    """Put the context filter on `handler` and, for json, the JSON formatter."""
    if not any(isinstance(f, ContextFilter) for f in handler.filters):
        handler.addFilter(ContextFilter())
    if (fmt or log_format()) == "json":
        handler.setFormatter(json_formatter(process))


def configure(
    process: str,
    fmt: str | None = None,
    level: str | int | None = None,
    loggers: tuple[str, ...] = ("",),
) -> None:
    """Set up logging for `process` in format `fmt` (None: LOG_FORMAT): the root logger gets a stderr handler
    unless it has one, and every handler of `loggers` (the root's, and e.g. gunicorn's or Celery's own) gets the
    filter and, for json, the formatter, as does every logger with handlers of its own (torch's)."""
    fmt = fmt or log_format()
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
        root.addHandler(handler)
    if level is not None:
        root.setLevel(level.upper() if isinstance(level, str) else level)
    names = set(loggers)
    if fmt == "json":
        names |= {
            name for name, lg in logging.Logger.manager.loggerDict.items() if getattr(lg, "handlers", None)
        }
    for name in names:
        for each in logging.getLogger(name).handlers:
            install(each, process, fmt)
