"""Checks a worker and beat run when they start: the deployment's Postgres connections against the server's
max_connections (jobstore.db.check_deployment_connections, as gunicorn.conf.py does for the API) and Redis'
eviction policy (contract.redis_client.warn_unless_noeviction)."""

from __future__ import annotations

import logging

from sqlalchemy.exc import OperationalError

from contract.redis_client import warn_unless_noeviction
from contract.settings import Settings
from jobstore.db import TooManyConnections, check_deployment_connections

log = logging.getLogger(__name__)


def check_services(process: str) -> None:
    """Exit the process (SystemExit, its message naming the settings) when the deployment's connections do not
    fit Postgres; a database or Redis that does not answer yet is only logged (the process retries as it runs).
    SystemExit, not TooManyConnections: Celery's signals log a handler's exception and go on starting."""
    settings = Settings.from_env()
    try:
        check = check_deployment_connections(settings)
    except TooManyConnections as exc:
        raise SystemExit(f"genq {process} not started: TooManyConnections: {exc}") from exc
    except OperationalError as exc:
        log.warning("%s: Postgres connections not checked, the database does not answer: %s", process, exc)
    else:
        if check is not None:
            log.info("%s: %s", process, check.describe())
    warn_unless_noeviction(settings.redis_url, log)
