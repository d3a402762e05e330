"""OpenTelemetry traces, optional: the `otel` extra (`pip install genq[otel]`) and on only when TRACING=true or
OTEL_EXPORTER_OTLP_ENDPOINT is set (then spans go over OTLP/HTTP to that endpoint, configured by OpenTelemetry's
own OTEL_* variables). Off, nothing of OpenTelemetry is imported.

Each process sets it up once (`setup_tracing`): the API when its app is made (Flask's requests, Redis' commands,
Celery's sends), the worker and beat when Celery's app is loaded (Redis, Celery's own task spans); each
instruments its database engine when it makes it (`instrument_engine`: SQLAlchemy's statements). A worker adds
spans for each job's engine phases (workers/job_spans.py).

A job is one trace from the API to the worker: the API stores the W3C `traceparent` of the request that created
the job on its row (`current_traceparent`, the jobs.traceparent column), and each worker that holds the job starts
its spans as children of it (`parent_context`). The row, not the queue message, carries it, so a job handed back
or recovered from a dead worker (sent again from its row) stays in its request's trace.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from contract.settings import StoreSettings

log = logging.getLogger(__name__)
_provider: Any = None  # this process's TracerProvider once set up
# W3C Trace Context's header: version-trace id-parent span id-flags (55 characters)
TRACEPARENT = "traceparent"


def tracing_enabled(settings: StoreSettings) -> bool:
    return settings.tracing or bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def setup_tracing(service: str, settings: StoreSettings, exporter: Any = None) -> Any:
    """This process's TracerProvider (service.name `genq-<service>`), the instrumentations applied; None when
    tracing is off, or on without the `otel` extra (logged). `exporter` (a SpanExporter, e.g. the SDK's
    in-memory one) replaces OTLP and gets each span as it ends. Set up once per process: later calls return
    the first provider."""
    global _provider
    if _provider is not None:
        return _provider
    if exporter is None and not tracing_enabled(settings):
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.instrumentation.celery import CeleryInstrumentor
        from opentelemetry.instrumentation.redis import RedisInstrumentor
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as exc:
        log.warning("tracing is on but OpenTelemetry is not installed (pip install genq[otel]): %s", exc)
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": f"genq-{service}"}))
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    RedisInstrumentor().instrument(tracer_provider=provider)
    CeleryInstrumentor().instrument(tracer_provider=provider)
    _provider = provider
    log.info("tracing on: spans of genq-%s", service)
    return provider


def instrument_flask(app: Any) -> None:
    """Spans for `app`'s requests, when tracing is set up in this process."""
    if _provider is None:
        return
    from opentelemetry.instrumentation.flask import FlaskInstrumentor

    FlaskInstrumentor().instrument_app(app, tracer_provider=_provider)


def instrument_engine(engine: Any) -> None:
    """Spans for the statements of `engine`, the process's database engine (the API's pool, a worker's job
    writes, beat's): instrumented as an engine, since jobstore.db binds SQLAlchemy's create_engine before
    any instrumentation could wrap it. SQLAlchemy's instrumentation is set up once per process: the first
    engine given here (and engines made through sqlalchemy.create_engine after it) get spans."""
    if _provider is None:
        return
    from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor

    instrumentor = SQLAlchemyInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        # its declared range ends below SQLAlchemy 2.1, which genq runs; it works there
        # (tests/deployment/test_tracing.py checks the statements' spans)
        instrumentor.instrument(engine=engine, tracer_provider=_provider, skip_dep_check=True)


def current_traceparent() -> str | None:
    """The W3C traceparent of this thread's (greenlet's) current span, to store with a job it creates; None when
    tracing is off or no span is current (a CLI, a background thread)."""
    if _provider is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get(TRACEPARENT)


def parent_context(traceparent: str | None) -> Any:
    """The context whose remote parent is `traceparent` (a job's: its spans join the trace of the request that
    created it); None (a new trace) without one, or for one that does not parse."""
    if not traceparent:
        return None
    from opentelemetry.trace import get_current_span
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context = TraceContextTextMapPropagator().extract({TRACEPARENT: traceparent})
    return context if get_current_span(context).get_span_context().is_valid else None


def tracer(name: str) -> Any:
    """A tracer of this process's provider; None when tracing is off."""
    return None if _provider is None else _provider.get_tracer(name)
