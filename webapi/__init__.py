"""The HTTP API: `gunicorn "webapi:create_app()"` (dev: `flask --app webapi run`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flask import Flask

    from contract.settings import ApiSettings


def create_app(settings: ApiSettings | None = None) -> Flask:
    """Build the app; settings default to the environment (see .env.example).

    The app's modules are imported here, not when the package is: gunicorn's master process loads the
    worker class (webapi.gevent_worker) from this package, and must not import the app's clients (Redis,
    Postgres, threads) before a gevent worker patches them."""
    from flask import Flask

    from contract.settings import ApiSettings
    from contract.tracing import instrument_flask, setup_tracing
    from webapi import (
        admin,
        batches,
        bulk_jobs,
        completions,
        docs,
        ended_jobs,
        files,
        jobs,
        ops,
        served_models,
        tokens,
        usage,
    )
    from webapi.cli import keys
    from webapi.errors import init_errors
    from webapi.extensions import init_extensions
    from webapi.metrics import init_metrics
    from webapi.request_log import init_request_log

    settings = settings or ApiSettings.from_env()
    app = Flask(__name__)
    app.config.update(MAX_CONTENT_LENGTH=settings.max_body_bytes)
    if setup_tracing("api", settings) is not None:  # TRACING: before the database engine is made
        instrument_flask(app)
    _init_logging(settings.log_level, settings.log_format)
    init_extensions(app, settings)
    init_errors(app)
    init_metrics(app)
    init_request_log(app, settings.log_format)
    app.register_blueprint(bulk_jobs.bp)  # before jobs': /jobs/bulk and /jobs/ended are not job ids
    app.register_blueprint(ended_jobs.bp)
    app.register_blueprint(jobs.bp)
    app.register_blueprint(files.bp)
    app.register_blueprint(batches.bp)
    app.register_blueprint(completions.bp)
    app.register_blueprint(served_models.bp)
    app.register_blueprint(tokens.bp)
    app.register_blueprint(usage.bp)
    app.register_blueprint(admin.bp)
    app.register_blueprint(ops.bp)
    app.register_blueprint(docs.bp)
    app.cli.add_command(keys)
    return app


def _init_logging(level: str, fmt: str) -> None:
    """Log our own messages at `level` to stderr, next to gunicorn's, unless logging is set up already; in
    format `fmt` (LOG_FORMAT), with the request's context (contract/log_setup.py), gunicorn's lines too."""
    from contract.log_setup import configure

    configure("api", fmt, loggers=("", "gunicorn.error", "gunicorn.access"))
    logging.getLogger("webapi").setLevel(level.upper())
