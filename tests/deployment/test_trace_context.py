"""A job is one trace from the API request that created it through every worker hold (issue 42, traces).

Real processes all the way: gunicorn serving the API and a Celery worker running tiny-llama, both exporting their
spans over OTLP/HTTP (OTEL_EXPORTER_OTLP_ENDPOINT, as an operator sets it) to a collector this test runs on
loopback, which decodes OpenTelemetry's own protobuf. The worker holds one job at a time, so an urgent job makes
it hand a long one back to the queue; the long job's two holds (the hand-back and the re-claim, by the message the
worker sent again) and the urgent job's hold must each be a child of the POST /jobs span that created the job.
The API half alone, with the SDK's in-memory exporter: POST /jobs and each job of a POST /jobs/bulk store their
request span's traceparent, and nothing is stored with tracing off.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from sqlalchemy import select

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from jobstore.models import Job  # noqa: E402
from tests.conftest import ROOT, free_port, serve_api, settings_env, worker_command  # noqa: E402

FINISHED = ("succeeded", "failed", "cancelled")


@dataclasses.dataclass(frozen=True)
class Span:
    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict


class Collector:
    """An OTLP/HTTP trace receiver on loopback: POST /v1/traces with ExportTraceServiceRequest protobufs."""

    def __init__(self):
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                collector.add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Collector:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        Span(
                            service=resource.get("service.name", ""),
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                        )
                    )
        with self._lock:
            self.spans.extend(spans)

    def wait_for(self, found, timeout: float = 60):
        """`found(spans)` once it is truthy (spans arrive in batches as each process exports them)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            result = found(spans)
            if result or time.monotonic() > deadline:
                return result, spans
            time.sleep(0.2)


def _value(value):
    return getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None


def start_worker(settings, env: dict, log_path):
    """The Procfile's worker for `settings`, its spans exported as `env` says; waits until it is ready."""
    with log_path.open("w") as out:
        worker = subprocess.Popen(
            worker_command(f"trace-{uuid.uuid4().hex[:6]}@%h", 2),
            cwd=ROOT,
            env={**settings_env(settings), "WORKER_METRICS_PORT": str(free_port()), **env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 180
    while " ready." not in log_path.read_text():
        assert worker.poll() is None, f"worker exited:\n{log_path.read_text()[-5000:]}"
        assert time.monotonic() < deadline, f"worker not ready:\n{log_path.read_text()[-5000:]}"
        time.sleep(0.2)
    return worker


def stop(worker) -> None:
    worker.send_signal(signal.SIGTERM)  # warm shutdown: its held jobs go back, its last spans are exported
    try:
        worker.wait(timeout=30)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


def test_a_job_is_one_trace_from_its_request_through_every_worker_hold(
    settings, database, sessions, new_key, tmp_path
):
    name = f"trace-{uuid.uuid4().hex[:6]}"
    # one job held at a time (engine max_num_seqs 1, no reserve): an urgent job makes the worker hand back its job
    settings = settings.replace(
        redis_key_prefix=f"{settings.redis_key_prefix}{name}:", max_num_seqs=1, worker_reserve=0
    )
    with Collector() as collector:
        otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
        worker = start_worker(settings, otel, tmp_path / "worker.log")
        try:
            with serve_api(settings, workers=2, env=otel) as url:
                api = Api(url, {"Authorization": f"Bearer {new_key()}"})
                long = api.submit(prompt="Once upon a time", max_tokens=1500, ignore_eos=True, priority=9)
                api.wait(long, lambda job: len(job["output"]["token_ids"]) >= 4, tmp_path)
                urgent = api.submit(prompt="Quick", max_tokens=8, priority=0)
                assert (
                    api.wait(urgent, lambda job: job["status"] in FINISHED, tmp_path)["status"] == "succeeded"
                )
                # the long job was handed back for the urgent one, then claimed again from the message re-sent
                deadline = time.monotonic() + 60
                while (row := job_row(sessions, long)).attempts < 2 or row.status != "running":
                    assert time.monotonic() < deadline, (row.status, row.attempts, row.handbacks)
                    time.sleep(0.05)
                assert row.handbacks == 1, row.handbacks
                requests.post(f"{url}/jobs/{long}/cancel", headers=api.headers, timeout=10).raise_for_status()
                api.wait(long, lambda job: job["status"] in FINISHED, tmp_path)
        finally:
            stop(worker)

        def traced(spans):
            holds = [s for s in spans if s.name == "genq.job"]
            by_job = {
                job_id: [s for s in holds if s.attributes["genq.job_id"] == job_id]
                for job_id in (long, urgent)
            }
            return by_job if len(by_job[long]) == 2 and len(by_job[urgent]) == 1 else None

        holds, spans = collector.wait_for(traced)
        assert holds, (
            f"the worker's job spans did not all arrive: {sorted({(s.service, s.name) for s in spans})}"
        )

    posts = [s for s in spans if s.service == "genq-api" and s.name == "POST /jobs"]
    assert len(posts) == 2, [(s.service, s.name) for s in spans if s.service == "genq-api"]
    for job_id in (long, urgent):
        row = job_row(sessions, job_id)
        # the row keeps the request span's W3C traceparent: version-trace id-span id-flags (sampled, here with
        # Trace Context level 2's random trace id flag too: 03)
        version, trace_id, span_id, flags = row.traceparent.split("-")
        assert version == "00" and int(flags, 16) & 1, row.traceparent
        request = next((s for s in posts if (s.trace_id, s.span_id) == (trace_id, span_id)), None)
        assert request is not None, (row.traceparent, posts, holds[job_id])
        for hold in holds[job_id]:
            assert hold.service == "genq-worker"
            assert (hold.trace_id, hold.parent_span_id) == (request.trace_id, request.span_id)
            # the hold's own phases are in that trace too, under the hold
            phases = {s.name for s in spans if s.parent_span_id == hold.span_id}
            assert {"queued", "prefill"} <= phases, phases
    first, second = sorted(holds[long], key=lambda s: s.attributes["genq.attempt"])
    assert (first.attributes["genq.attempt"], second.attributes["genq.attempt"]) == (1, 2)
    assert first.attributes["genq.outcome"] == "preempted"  # handed back for the urgent job
    assert holds[urgent][0].attributes["genq.outcome"] == "succeeded"
    assert holds[urgent][0].trace_id != first.trace_id  # a trace per request


@dataclasses.dataclass
class Api:
    url: str
    headers: dict

    def submit(self, **body) -> str:
        r = requests.post(f"{self.url}/jobs", json=body, headers=self.headers, timeout=10)
        assert r.status_code == 202, r.text
        return r.json()["id"]

    def wait(self, job_id: str, until, tmp_path, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = requests.get(f"{self.url}/jobs/{job_id}", headers=self.headers, timeout=10).json()
            if until(job):
                return job
            time.sleep(0.05)
        raise AssertionError(
            f"job {job_id}: {job}; worker log:\n{(tmp_path / 'worker.log').read_text()[-5000:]}"
        )


def job_row(sessions, job_id: str):
    with sessions.begin() as session:
        return session.execute(
            select(Job.status, Job.attempts, Job.handbacks, Job.traceparent).where(
                Job.id == uuid.UUID(job_id)
            )
        ).one()


SUBMIT_TRACED = """
import json, sys
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import select
from contract.settings import ApiSettings
from contract import tracing
from jobstore.db import make_engine
from jobstore.models import Job
exporter = InMemorySpanExporter()
settings = ApiSettings.from_env()
if settings.tracing:
    tracing.setup_tracing("api", settings, exporter=exporter)
from webapi import create_app
app = create_app(settings)
headers = {"Authorization": "Bearer " + sys.argv[1]}
client = app.test_client()
job = {"prompt": "Once upon a time", "max_tokens": 8, "priority": 9}
one = client.post("/jobs", json=job, headers=headers)
many = client.post("/jobs/bulk", json={"jobs": [job, job]}, headers=headers)
assert one.status_code == 202 and many.status_code == 200, (one.data, many.data)
ids = {"POST /jobs": [one.json["id"]], "POST /jobs/bulk": [r["job"]["id"] for r in many.json["results"]]}
engine = make_engine(settings.database_url)
with engine.connect() as conn:
    stored = {str(i): t for i, t in conn.execute(select(Job.id, Job.traceparent).where(
        Job.id.in_([i for found in ids.values() for i in found])))}
engine.dispose()
spans = {s.name: (format(s.context.trace_id, "032x"), format(s.context.span_id, "016x"))
         for s in exporter.get_finished_spans() if s.name in ids}
print(json.dumps({"ids": ids, "stored": stored, "spans": spans}))
"""


@pytest.mark.parametrize("tracing", [True, False])
def test_post_jobs_and_each_bulk_job_store_their_requests_traceparent(settings, database, new_key, tracing):
    """The API half, in one process with the SDK's in-memory exporter: POST /jobs and every job of one POST
    /jobs/bulk keep their request span's traceparent; untraced, none is stored."""
    env = settings_env(settings) | {"TRACING": str(tracing).lower()}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    done = subprocess.run(
        [sys.executable, "-c", SUBMIT_TRACED, new_key()],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    for route, job_ids in seen["ids"].items():
        for job_id in job_ids:
            traceparent = seen["stored"][job_id]
            if not tracing:
                assert traceparent is None
                continue
            trace_id, span_id = seen["spans"][route]
            assert traceparent.split("-")[1:3] == [trace_id, span_id], (route, traceparent)
