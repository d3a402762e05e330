"""Prometheus metrics of the API: requests, submissions, cancellations, jobs waiting or running (from
Postgres) and the queue depth per priority (from Redis), both read at scrape time. The worker's
metrics (engine, latencies, outcomes) are in workers/metrics.py, on its own port."""

from __future__ import annotations

import logging
import time

import redis
from flask import Flask, g, request
from prometheus_client import Counter, Gauge, Histogram
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from jobstore.dispatch import QUEUE
from jobstore.jobs import ACTIVE
from jobstore.models import Job

HTTP_REQUESTS = Counter(
    "genq_http_requests_total", "HTTP requests answered", ["method", "endpoint", "status"]
)
HTTP_LATENCY = Histogram("genq_http_request_duration_seconds", "Time to answer an HTTP request", ["endpoint"])
JOBS_SUBMITTED = Counter("genq_jobs_submitted_total", "Jobs accepted and sent to the queue", ["priority"])
JOBS_ACTIVE = Gauge("genq_jobs", "Jobs queued or running, read from Postgres at scrape time", ["status"])
JOBS_BY_PRIORITY = Gauge(
    "genq_jobs_by_priority",
    "Jobs queued or running per priority (Postgres, at scrape time)",
    ["status", "priority"],
)
JOBS_CANCELLED = Counter("genq_jobs_cancelled_total", "Jobs cancelled through the API", ["priority"])
QUEUE_DEPTH = Gauge(
    "genq_queue_depth", "Messages waiting in Redis per priority (at scrape time)", ["priority"]
)
PRIORITIES = range(10)
log = logging.getLogger(__name__)


def init_metrics(app: Flask) -> None:
    """Time and count every request by its route (not its URL, which holds ids)."""

    @app.before_request
    def start_timer():
        g.started = time.perf_counter()

    @app.after_request
    def observe(response):
        endpoint = request.url_rule.rule if request.url_rule else "unmatched"
        HTTP_REQUESTS.labels(request.method, endpoint, str(response.status_code)).inc()
        if "started" in g:
            HTTP_LATENCY.labels(endpoint).observe(time.perf_counter() - g.started)
        return response


def refresh_job_gauges(session: Session) -> None:
    """Set genq_jobs{status} and genq_jobs_by_priority{status, priority} for the live states from one GROUP BY."""
    counts = {
        (status, priority): n
        for status, priority, n in session.execute(
            select(Job.status, Job.priority, func.count())
            .where(Job.status.in_(ACTIVE))
            .group_by(Job.status, Job.priority)
        ).all()
    }
    for status in ACTIVE:
        JOBS_ACTIVE.labels(status.value).set(sum(counts.get((status, p), 0) for p in PRIORITIES))
        for p in PRIORITIES:
            JOBS_BY_PRIORITY.labels(status.value, str(p)).set(counts.get((status, p), 0))


def refresh_queue_depth(redis_url: str, key_prefix: str) -> None:
    """Set genq_queue_depth{priority}: the length of each kombu priority list (`generate`, `generate:1`, ...)."""
    client = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
    try:
        with client.pipeline(transaction=False) as pipe:
            for p in PRIORITIES:
                pipe.llen(f"{key_prefix}{QUEUE}:{p}" if p else f"{key_prefix}{QUEUE}")
            lengths = pipe.execute()
    except redis.RedisError as exc:  # the rest of /metrics still answers; the depths go stale
        log.warning("metrics: queue depth unavailable: %s", exc)
        return
    finally:
        client.close()
    for p, n in zip(PRIORITIES, lengths, strict=True):
        QUEUE_DEPTH.labels(str(p)).set(n)
