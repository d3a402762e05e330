"""Idempotency, overload (caps and rate limits), hostile input and tenant isolation, against the real
app on this session's Postgres and Redis (no worker: jobs stay queued unless a test starts one)."""

from __future__ import annotations

import logging
import statistics
import threading
import time
import uuid

import pytest
from sqlalchemy import select

from jobstore.models import ApiKey
from tests.reliability.conftest import job_rows, stack_settings, wait_for

BODY = {"prompt": "Hello", "max_tokens": 4, "temperature": 0.0}


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


# --- idempotency -------------------------------------------------------------------------------------


def test_idempotency_key_same_tenant_same_job_other_body_422_other_tenant_other_job(settings, api, new_key):
    client = api(stack_settings(settings))
    a, b = bearer(new_key()), bearer(new_key())
    first = client.post("/jobs", json=BODY, headers={**a, "Idempotency-Key": "k1"})
    again = client.post("/jobs", json=BODY, headers={**a, "Idempotency-Key": "k1"})
    assert first.status_code == again.status_code == 202 and first.json["id"] == again.json["id"]
    changed = client.post("/jobs", json={**BODY, "max_tokens": 5}, headers={**a, "Idempotency-Key": "k1"})
    assert changed.status_code == 422 and changed.json["error"]["code"] == "idempotency_key_reused"
    other = client.post("/jobs", json=BODY, headers={**b, "Idempotency-Key": "k1"})
    assert other.status_code == 202 and other.json["id"] != first.json["id"]  # keys are per tenant
    assert client.get(f"/jobs/{first.json['id']}", headers=b).status_code == 404


def test_concurrent_duplicate_submissions_make_one_job(settings, api, new_key, sessions, figures):
    app = api(stack_settings(settings)).application
    headers = {**bearer(new_key()), "Idempotency-Key": f"dup-{uuid.uuid4()}"}
    ids, statuses, barrier = [], [], threading.Barrier(12)

    def submit():
        client = app.test_client()
        barrier.wait()
        r = client.post("/jobs", json=BODY, headers=headers)
        statuses.append(r.status_code)
        ids.append(r.json.get("id"))

    threads = [threading.Thread(target=submit) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert statuses == [202] * 12 and len(set(ids)) == 1, (statuses, ids)
    figures["idempotency"] = {"concurrent_submissions": 12, "jobs_created": len(set(ids))}


# --- overload ----------------------------------------------------------------------------------------


def test_queued_job_caps_answer_429_with_retry_after(settings, api, new_key, figures):
    client = api(stack_settings(settings, max_queued_per_tenant=3, max_queued_jobs=10**6))
    a = bearer(new_key())
    for i in range(3):
        assert client.post("/jobs", json=BODY, headers={**a, "Idempotency-Key": f"c{i}"}).status_code == 202
    over = client.post("/jobs", json=BODY, headers=a)
    assert over.status_code == 429 and int(over.headers["Retry-After"]) > 0
    assert over.json["error"]["code"] == "too_many_queued_jobs"
    retry = client.post(
        "/jobs", json=BODY, headers={**a, "Idempotency-Key": "c0"}
    )  # a retry is not a new job
    assert retry.status_code == 202
    assert client.post("/jobs", json=BODY, headers=bearer(new_key())).status_code == 202  # others unaffected
    # global cap: whatever is queued in this database already counts
    client = api(stack_settings(settings, max_queued_jobs=1))
    crowded = client.post("/jobs", json=BODY, headers=bearer(new_key()))
    assert crowded.status_code == 429 and crowded.json["error"]["code"] == "overloaded"
    assert int(crowded.headers["Retry-After"]) > 0
    figures["caps"] = {"per_tenant_cap": 3, "answer_over_cap": over.status_code}


def test_rate_limit_per_key_in_redis(settings, api, new_key, redis_client):
    st = stack_settings(settings, rate_limit="5/minute")
    client = api(st)
    a, b = bearer(new_key()), bearer(new_key())
    codes = [client.get("/jobs", headers=a).status_code for _ in range(7)]
    assert codes[:5] == [200] * 5 and codes[5:] == [429, 429], codes
    limited = client.get("/jobs", headers=a)
    assert int(limited.headers["Retry-After"]) > 0 and limited.json["error"]["code"] == "too_many_requests"
    assert client.get("/jobs", headers=b).status_code == 200  # per key
    assert client.get("/healthz").status_code == 200  # ops endpoints are not limited
    assert list(redis_client.scan_iter(match=f"*{st.redis_key_prefix}ratelimit*"))  # counters live in Redis
    raw_key = a["Authorization"].split()[1]
    assert not any(raw_key.encode() in k for k in redis_client.scan_iter(match=f"*{st.redis_key_prefix}*"))


def test_api_stays_responsive_while_the_worker_is_saturated(
    settings, api, new_key, make_worker, sessions, figures
):
    st = stack_settings(settings, max_num_seqs=8, rate_limit="1000/second")
    client, headers = api(st), bearer(new_key())
    make_worker(st, concurrency=8).start()
    ids = [
        client.post(
            # 1,500 tokens, cancelled once measured: jobs of 200 all ended during the 100 GETs (16 x 200 tokens on
            # 8 slots are ~400 steps of a few ms), leaving none running to saturate the worker
            "/jobs",
            json={"prompt": f"load {i}", "max_tokens": 1500, "temperature": 0.0},
            headers=headers,
        ).json["id"]
        for i in range(16)
    ]
    wait_for(
        lambda: sum(r["status"] == "running" for r in job_rows(sessions, ids).values()) >= 8, 60, "8 running"
    )
    latencies = []
    for i in range(100):
        started = time.perf_counter()
        assert client.get(f"/jobs/{ids[i % len(ids)]}", headers=headers).status_code == 200
        latencies.append(time.perf_counter() - started)
    running = sum(r["status"] == "running" for r in job_rows(sessions, ids).values())
    p50, p95 = statistics.median(latencies), statistics.quantiles(latencies, n=20)[-1]
    for job_id in ids:
        client.post(f"/jobs/{job_id}/cancel", headers=headers)
    assert running >= 4 and p95 < 0.25, (running, p50, p95)
    figures["saturated_get_latency"] = {
        "jobs_running": running,
        "requests": 100,
        "p50_ms": round(p50 * 1000, 1),
        "p95_ms": round(p95 * 1000, 1),
        "max_ms": round(max(latencies) * 1000, 1),
    }


# --- hostile input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        "SELECT * FROM jobs; DROP TABLE jobs; --'\"",
        "<script>alert(1)</script><img src=x onerror=alert(2)>",
        "nul\x00inside\x00",
        "emoji 🦜 and RTL \u202e and \ufeff",
    ],
)
def test_prompts_are_stored_and_returned_verbatim(settings, api, new_key, payload):
    client, a = api(stack_settings(settings)), bearer(new_key())
    r = client.post(
        "/jobs",
        json={**BODY, "prompt": payload, "metadata": {"note": payload.replace("\x00", "")}},
        headers=a,
    )
    assert r.status_code == 202, r.json
    job = client.get(f"/jobs/{r.json['id']}", headers=a).json
    assert job["metadata"] == {"note": payload.replace("\x00", "")}
    from jobstore import jobs as jobstore_jobs

    with client.application.extensions["genq"].sessions() as s:
        assert jobstore_jobs.get_job(s, uuid.UUID(r.json["id"])).prompt == payload


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"\xff\xfe\x00{not json", 400),
        (b'{"prompt": "\xc3\x28", "max_tokens": 4}', 400),  # invalid UTF-8 inside a string
        (b"[" * 100_000 + b"]" * 100_000, 400),  # deeply nested (200 kB: under the body limit)
        (b"[" * 600_000 + b"]" * 600_000, 413),  # deeply nested and over the body limit (1.2 MB)
        (b'{"prompt":' + b"[" * 5000 + b"]" * 5000 + b"}", 400),  # deeply nested, small
        (b'{"prompt": "x", "max_tokens": 1e999}', 422),
        (b'{"prompt": "' + b"a" * (2 << 20) + b'"}', 413),  # huge
    ],
)
def test_malformed_bodies_are_4xx(settings, api, new_key, data, status):
    client = api(stack_settings(settings))
    r = client.post("/jobs", data=data, headers={**bearer(new_key()), "Content-Type": "application/json"})
    assert r.status_code == status, (r.status_code, r.data[:200])
    assert r.json["error"]["code"]


@pytest.mark.parametrize(
    "header",
    [
        ("Idempotency-Key", "a\x01b"),
        ("Idempotency-Key", "x\x7f"),
        ("Authorization", "Bearer \x00\x01"),
        ("Authorization", "Bearer " + "k" * 10000),
    ],
)
def test_control_characters_in_headers_are_4xx(settings, api, new_key, header):
    client = api(stack_settings(settings))
    headers = {**bearer(new_key()), header[0]: header[1]}
    r = client.post("/jobs", json=BODY, headers=headers)
    assert 400 <= r.status_code < 500, r.status_code


def test_schemathesis_finds_no_5xx(settings, api, new_key, figures):
    import schemathesis

    key = new_key()
    # no worker runs here: a valid synchronous completion waits for its job until its timeout, then
    # answers 503 "timeout" (documented, with Retry-After); kept short, and not counted as a bug
    st = stack_settings(settings, rate_limit="100000/second", completion_timeout_seconds=0.02)
    app = api(st).application
    schema = schemathesis.openapi.from_wsgi("/openapi.json", app)
    failures = []
    started = time.monotonic()
    calls = []
    for operation in schema.get_all_operations():
        run_operation(operation.ok(), key, failures, calls)
    figures["schemathesis"] = {
        "requests": len(calls),
        "5xx": len(failures),
        "statuses": {str(c): calls.count(c) for c in sorted(set(calls))},
    }
    assert len(calls) > 100, calls
    assert not failures, failures[:5]
    assert time.monotonic() - started < 60


def run_operation(op, key: str, failures: list, calls: list) -> None:
    """Up to 40 generated requests to one operation; every 5xx is recorded."""
    from hypothesis import HealthCheck, given
    from hypothesis import settings as hsettings

    @hsettings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy())
    def check(case):
        response = case.call(headers={"Authorization": f"Bearer {key}"})
        calls.append(response.status_code)
        timed_out = response.status_code == 503 and response.json()["error"]["code"] == "timeout"
        if response.status_code >= 500 and not (timed_out and op.path.endswith("completions")):
            failures.append((op.label, response.status_code, case.body, case.path_parameters, case.query))

    check()


# --- security ----------------------------------------------------------------------------------------


def test_keys_stored_hashed_and_never_logged(settings, api, new_key, sessions, caplog):
    caplog.set_level(logging.DEBUG)
    client, key = api(stack_settings(settings)), new_key()
    r = client.post("/jobs", json=BODY, headers=bearer(key))
    client.get("/jobs", headers=bearer(key + "x"))  # a wrong key is not logged either
    client.get(f"/jobs/{r.json['id']}", headers=bearer(key))
    with sessions.begin() as s:
        stored = [row for row in s.scalars(select(ApiKey))]
    assert stored and not any(key in (k.key_hash + k.prefix) for k in stored)
    assert key not in caplog.text and key[8:] not in caplog.text


def test_tenant_isolation_on_every_endpoint(settings, api, new_key):
    client = api(stack_settings(settings))
    a, b = bearer(new_key()), bearer(new_key())
    job = client.post("/jobs", json=BODY, headers={**a, "Idempotency-Key": "iso"}).json
    assert client.get(f"/jobs/{job['id']}", headers=b).status_code == 404
    assert client.post(f"/jobs/{job['id']}/cancel", headers=b).status_code == 404
    assert job["id"] not in [j["id"] for j in client.get("/jobs?limit=100", headers=b).json["jobs"]]
    mine = client.post("/jobs", json=BODY, headers={**b, "Idempotency-Key": "iso"}).json
    assert mine["id"] != job["id"]
    assert client.get(f"/jobs/{job['id']}", headers=a).json["status"] == "queued"  # b's cancel did nothing
    for path in ("/jobs", f"/jobs/{job['id']}"):
        assert client.get(path).status_code == 401


def test_no_secrets_in_tracked_files():
    import re
    import subprocess

    from tests.conftest import ROOT

    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    patterns = [
        re.compile(p)
        for p in (
            r"gq_[A-Za-z0-9_-]{30,}",
            r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
            r"AKIA[0-9A-Z]{16}",
            r"(?i)password\s*[:=]\s*['\"]?(postgres|admin|secret|changeme)\b",
        )
    ]
    hits = []
    for name in files:
        path = ROOT / name
        if not path.is_file() or path.stat().st_size > 2_000_000 or name.startswith("tests/reliability/"):
            continue
        text = path.read_text(errors="ignore")
        hits += [(name, p.pattern) for p in patterns if p.search(text)]
    assert not hits, hits
    compose = (ROOT / "docker-compose.yml").read_text()
    for line in compose.splitlines():
        if re.search(r"(?i)(PASSWORD|BASIC_AUTH|SECRET)\s*[:=]", line):
            assert "${" in line, (
                f"docker-compose.yml: a secret not taken from the environment: {line.strip()}"
            )
