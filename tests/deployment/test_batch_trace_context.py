"""A Batch API file's jobs are in the trace of the request that created the batch (issue 42, traces), as a POST
/jobs job is in its request's: each job's row keeps the W3C traceparent of the POST /v1/batches span (their COPY
writes it), so each worker's genq.job span of the job is a child of it (tests/deployment/test_trace_context.py
checks that a stored traceparent becomes the holds' parent). The API in one process with the SDK's in-memory
exporter, against the real Postgres and Redis; with tracing off nothing is stored.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("opentelemetry.sdk")

from tests.conftest import ROOT, settings_env  # noqa: E402

CREATE_TRACED = """
import io, json, sys
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
lines = "".join(
    json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 4}}) + "\\n"
    for i in range(3)
)
upload = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(lines.encode()), "in.jsonl")},
                     headers=headers, content_type="multipart/form-data")
assert upload.status_code == 200, upload.data
batch = client.post("/v1/batches", json={"input_file_id": upload.json["id"], "endpoint": "/v1/chat/completions",
                    "completion_window": "24h"}, headers=headers)
assert batch.status_code == 200 and batch.json["status"] == "in_progress", batch.data
engine = make_engine(settings.database_url)
with engine.connect() as conn:
    stored = [t for (t,) in conn.execute(select(Job.traceparent).where(Job.batch_id == batch.json["id"]))]
engine.dispose()
spans = [(format(s.context.trace_id, "032x"), format(s.context.span_id, "016x"))
         for s in exporter.get_finished_spans() if s.name == "POST /v1/batches"]
print(json.dumps({"stored": stored, "spans": spans}))
"""


@pytest.mark.parametrize("tracing", [True, False])
def test_each_job_of_a_batch_stores_the_creating_requests_traceparent(settings, database, new_key, tracing):
    env = settings_env(settings) | {"TRACING": str(tracing).lower()}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    done = subprocess.run(
        [sys.executable, "-c", CREATE_TRACED, new_key()],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(seen["stored"]) == 3
    if not tracing:
        assert seen["stored"] == [None, None, None] and seen["spans"] == []
        return
    [(trace_id, span_id)] = seen["spans"]
    for traceparent in seen["stored"]:
        assert traceparent is not None and traceparent.split("-")[1:3] == [trace_id, span_id], traceparent
