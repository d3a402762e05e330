"""OpenTelemetry traces (the otel extra) with the SDK's in-memory exporter.

- workers/job_spans.py fed as the job book feeds it (claimed before the submit, each step's report, the end of
  the hold) by a real EngineHost running tiny-llama: a job preempted by a more urgent one gets queued, prefill
  and preempted spans and admitted, first_token, preempted, resumed and finished events, in order.
- contract/tracing.py in a process of its own (it sets the process's tracer provider): the API app with
  TRACING=true makes Flask, SQLAlchemy and Redis spans for one request; with tracing off it sets up nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid
from datetime import datetime, timedelta, timezone

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from batching import EngineConfig  # noqa: E402
from jobstore.models import Job  # noqa: E402
from tests.conftest import ROOT, settings_env  # noqa: E402
from workers import job_spans  # noqa: E402
from workers.engine_host import EngineHost  # noqa: E402
from workers.held_job import HeldJob  # noqa: E402
from workers.outcomes import Outcome  # noqa: E402


def a_job(priority: int, max_tokens: int) -> Job:
    """A claimed job's row as the intake holds it (not stored: the engine host needs none)."""
    return Job(
        id=uuid.uuid4(),
        tenant_id=uuid.uuid4(),
        priority=priority,
        prompt="Once upon a time",
        input_ids=None,
        max_tokens=max_tokens,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        seed=None,
        stop=[],
        options={"ignore_eos": True},
        output_token_ids=[],
        output_text="",
        attempts=1,
        handbacks=0,
        created_at=datetime.now(timezone.utc) - timedelta(seconds=2),
        enqueued_at=None,
    )


def test_a_preempted_jobs_engine_phases_become_spans(settings):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    job_spans.start(provider.get_tracer("test"))
    # two sequences at most, swap off: an urgent job arriving while two less urgent ones decode preempts one
    config = EngineConfig(**settings.replace(max_num_seqs=2, num_host_blocks=0).engine_options())
    host = EngineHost(config).start()
    ended: dict[str, threading.Event] = {}

    def on_end(held):
        job_spans.done(held, Outcome.SUCCEEDED)
        ended[held.request_id].set()

    host.on_step, host.on_end = job_spans.stepped, on_end

    def hold(job: Job) -> HeldJob:
        held = HeldJob(job, f"lease-{job.id.hex[:6]}")
        ended[held.request_id] = threading.Event()
        job_spans.claimed(held)
        host.submit(held, held.prompt, held.sampling_params(), held.resume_token_ids)
        return held

    try:
        low = [hold(a_job(9, 120)) for _ in range(2)]
        while not all(len(h.transcript.token_ids) >= 4 for h in low):
            ended[low[0].request_id].wait(0.01)
        urgent = hold(a_job(0, 8))
        for held in (*low, urgent):
            assert ended[held.request_id].wait(120), held.request_id
    finally:
        host.stop()
        job_spans.start(None)

    preempted = [h for h in low if h.num_preemptions]
    assert len(preempted) == 1, [h.num_preemptions for h in low]
    spans = exporter.get_finished_spans()
    roots = {s.attributes["genq.job_id"]: s for s in spans if s.name == "genq.job"}
    assert set(roots) == {str(h.job.id) for h in (*low, urgent)}
    for held in (*low, urgent):
        root = roots[str(held.job.id)]
        children = sorted(
            (s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id),
            key=lambda s: s.start_time,
        )
        names = [s.name for s in children]
        events = [e.name for e in root.events]
        if held is preempted[0]:
            assert names == ["queued", "prefill", "preempted"], names
            assert events == ["admitted", "first_token", "preempted", "resumed", "finished"], events
        else:
            assert names == ["queued", "prefill"], names
            assert events == ["admitted", "first_token", "finished"], events
        assert root.attributes["genq.outcome"] == "succeeded"
        assert root.attributes["genq.tokens"] == held.job.max_tokens
        assert root.attributes["genq.tenant"] == str(held.job.tenant_id)
        assert all(root.start_time <= s.start_time <= s.end_time <= root.end_time for s in children)
        assert children[0].end_time <= children[1].start_time  # queued until admitted, then prefill
        stamps = [e.timestamp for e in root.events]
        assert stamps == sorted(stamps)
    # the preempted span covers the time the urgent job ran in its place
    gap = next(s for s in spans if s.name == "preempted")
    assert gap.start_time <= roots[str(urgent.job.id)].end_time <= gap.end_time + 50_000_000


API_SPANS = """
import json, sys
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from contract.settings import ApiSettings
from contract import tracing
exporter = InMemorySpanExporter()
settings = ApiSettings.from_env()
if settings.tracing:
    assert tracing.setup_tracing("api", settings, exporter=exporter) is not None
else:
    assert tracing.setup_tracing("api", settings) is None
from webapi import create_app
app = create_app(settings)
r = app.test_client().get("/readyz")
assert r.status_code == 200, r.data
print(json.dumps([[s.name, s.kind.name, dict(s.resource.attributes)["service.name"]]
                  for s in exporter.get_finished_spans()]))
"""


@pytest.mark.parametrize("tracing", [True, False])
def test_the_api_traces_requests_statements_and_redis_commands_when_on(settings, database, tracing):
    env = settings_env(settings) | {"TRACING": str(tracing).lower()}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    done = subprocess.run(
        [sys.executable, "-c", API_SPANS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    spans = json.loads(done.stdout.strip().splitlines()[-1])
    if not tracing:
        assert spans == []
        return
    kinds = {kind for _, kind, _ in spans}
    names = " ".join(name for name, _, _ in spans)
    assert "SERVER" in kinds and "GET /readyz" in names, spans  # Flask's request span
    assert "SELECT" in names, spans  # SQLAlchemy's (the readiness check's SELECT 1)
    assert "PING" in names, spans  # Redis' (its PING)
    assert {service for _, _, service in spans} == {"genq-api"}
