"""Prometheus metrics of the API: requests, submissions and cancellations (counted by each process),
and jobs waiting or running (from Postgres) and the queue depth per priority (from Redis), both read
at scrape time. The worker's metrics (engine, latencies, outcomes) are in workers/metrics.py, on its
own port.

Under gunicorn several processes answer requests, each with its own counters: gunicorn.conf.py sets
PROMETHEUS_MULTIPROC_DIR, where prometheus_client keeps every process's values in files, and
`exposition()` adds up all of them, so any one scrape shows the whole API's counts. Without it
(`flask run`, tests) the process's own registry is served.
"""

from __future__ import annotations

import logging
import os
import time

import redis
from flask import Flask, g, request
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from contract.dispatch import model_queue, queue_lengths
from contract.settings import ApiSettings
from jobstore.jobs import ACTIVE, live_deadline_counts
from jobstore.models import Job
from webapi.tenant_metrics import tenant_gauges

HTTP_REQUESTS = Counter(
    "genq_http_requests_total", "HTTP requests answered", ["method", "endpoint", "status"]
)
HTTP_LATENCY = Histogram("genq_http_request_duration_seconds", "Time to answer an HTTP request", ["endpoint"])
JOBS_SUBMITTED = Counter("genq_jobs_submitted_total", "Jobs accepted and sent to the queue", ["priority"])
JOBS_CANCELLED = Counter("genq_jobs_cancelled_total", "Jobs cancelled through the API", ["priority"])
STREAMED_DELTAS = Counter(
    "genq_streamed_deltas_total",
    "Steps' deltas sent to streams (streamed completions, GET /jobs/<id>/events), by who wrote them: the "
    "stream's own greenlet, or the token-event hub while the stream waited (gevent worker; webapi/following.py)",
    ["writer"],
)
PRIORITIES = range(10)


def count_streamed_deltas(by_stream: int, writer) -> None:
    """A stream's deltas, as it closes: `by_stream` written by its own greenlet, the rest by the hub through
    `writer` (webapi/gevent_worker.DirectWriter; None where there is none)."""
    STREAMED_DELTAS.labels("stream").inc(by_stream)
    if writer is not None:
        STREAMED_DELTAS.labels("hub").inc(writer.written)


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


def exposition(session: Session, settings: ApiSettings) -> bytes:
    """The /metrics text: the counters of every API process, then the gauges read now."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        counted = CollectorRegistry()
        multiprocess.MultiProcessCollector(counted)
    else:
        counted = REGISTRY
    read_now = CollectorRegistry(auto_describe=False)
    read_now.register(_ReadAtScrape(session, settings))
    return generate_latest(counted) + generate_latest(read_now)


class _ReadAtScrape:
    """genq_jobs, genq_jobs_by_priority (Postgres) and genq_queue_depth (Redis), read when scraped:
    values of the service, not of the process that answers, so no process keeps them."""

    def __init__(self, session: Session, settings: ApiSettings):
        self.session, self.settings = session, settings

    def collect(self):
        yield from job_gauges(self.session)
        yield deadline_gauge(self.session, self.settings.deadline_margin_seconds)
        yield from fleet_gauges(self.settings)
        yield from tenant_gauges(self.session, self.settings.usage_metrics_tenants)


def job_gauges(session: Session) -> list[GaugeMetricFamily]:
    """genq_jobs{status} and genq_jobs_by_priority{status, priority} for the live states, from one GROUP BY."""
    counts = {
        (status, priority): n
        for status, priority, n in session.execute(
            select(Job.status, Job.priority, func.count())
            .where(Job.status.in_(ACTIVE))
            .group_by(Job.status, Job.priority)
        ).all()
    }
    jobs = GaugeMetricFamily(
        "genq_jobs", "Jobs queued or running, read from Postgres at scrape time", labels=["status"]
    )
    by_priority = GaugeMetricFamily(
        "genq_jobs_by_priority",
        "Jobs queued or running per priority (Postgres, at scrape time)",
        labels=["status", "priority"],
    )
    for status in ACTIVE:
        jobs.add_metric([status.value], sum(counts.get((status, p), 0) for p in PRIORITIES))
        for p in PRIORITIES:
            by_priority.add_metric([status.value, str(p)], counts.get((status, p), 0))
    return [jobs, by_priority]


def deadline_gauge(session: Session, margin_seconds: float) -> GaugeMetricFamily:
    """genq_jobs_deadline{status, state}: queued or running jobs past their deadline (state "missed") or within
    DEADLINE_MARGIN_SECONDS of it ("at_risk"), from Postgres at scrape time."""
    gauge = GaugeMetricFamily(
        "genq_jobs_deadline",
        "Jobs queued or running past their deadline (missed) or near it (at_risk), at scrape time",
        labels=["status", "state"],
    )
    for (status, state), n in live_deadline_counts(session, margin_seconds).items():
        gauge.add_metric([status.value, state], n)
    return gauge


def fleet_gauges(settings: ApiSettings) -> list[GaugeMetricFamily]:
    """genq_queue_depth{model, priority}: the length of each served model's kombu priority lists (`generate`,
    `generate:1`, ... for the default model; `generate.<name>`, ... for another), and genq_model_live_workers{model}
    (0: a model configured in SERVED_MODELS whose jobs wait for a worker), read at scrape time."""
    from webapi.extensions import services  # it imports this module

    fleet = services().fleet
    try:
        models = fleet.models()
        queues = {name: model_queue(settings, name) for name in models}
        lengths = queue_lengths(fleet.redis, settings, queues.values())
    except redis.RedisError as exc:  # the rest of /metrics still answers, without the depths
        log.warning("metrics: queue depth unavailable: %s", exc)
        return []
    depth = GaugeMetricFamily(
        "genq_queue_depth",
        "Messages waiting in Redis per model and priority (at scrape time)",
        labels=["model", "priority"],
    )
    live = GaugeMetricFamily(
        "genq_model_live_workers",
        "Live workers per served model (0: its jobs wait for one)",
        labels=["model"],
    )
    for name, model in models.items():
        for p, n in zip(PRIORITIES, lengths[queues[name]], strict=True):
            depth.add_metric([name, str(p)], n)
        live.add_metric([name], len(model.workers))
    return [depth, live]
