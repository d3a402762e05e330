"""GET /jobs/ended over the real app, Postgres and Redis: jobs end here by being cancelled (no worker)."""

from __future__ import annotations

from datetime import datetime, timezone

from webapi.ended_jobs import SETTLE_SECONDS

JOB = {"prompt": "Once upon a time", "max_tokens": 8}


def test_lists_what_ended_in_order_page_by_page_and_only_the_callers(client, auth):
    headers, other = auth(), auth()
    start = datetime.now(timezone.utc).isoformat()
    ids = [client.post("/jobs", json=JOB, headers=headers).json["id"] for _ in range(5)]
    client.post("/jobs", json=JOB, headers=other)
    assert client.get("/jobs/ended", query_string={"since": start}, headers=headers).json["jobs"] == []
    for job_id in ids[:3]:
        assert client.post(f"/jobs/{job_id}/cancel", headers=headers).status_code == 200
    first = client.get("/jobs/ended", query_string={"since": start, "limit": 2}, headers=headers).json
    assert [j["id"] for j in first["jobs"]] == ids[:2] and first["more"]
    rest = client.get("/jobs/ended", query_string={"since": first["next_cursor"]}, headers=headers).json
    assert [j["id"] for j in rest["jobs"]] == ids[2:3] and not rest["more"]
    assert rest["jobs"][0]["status"] == "cancelled"
    assert rest["queue"]["queued"] >= 2  # the caller's own two left queued (counted within a second)
    # ended within SETTLE_SECONDS: listed again, for a job whose end committed late
    again = client.get("/jobs/ended", query_string={"since": rest["next_cursor"]}, headers=headers).json
    assert ids[2] in [j["id"] for j in again["jobs"]]


def test_settled_cursor_lists_nothing_twice(client, auth):
    import time

    headers = auth()
    start = datetime.now(timezone.utc).isoformat()
    job_id = client.post("/jobs", json=JOB, headers=headers).json["id"]
    client.post(f"/jobs/{job_id}/cancel", headers=headers)
    time.sleep(SETTLE_SECONDS + 0.2)
    page = client.get("/jobs/ended", query_string={"since": start}, headers=headers).json
    assert [j["id"] for j in page["jobs"]] == [job_id]
    after = client.get("/jobs/ended", query_string={"since": page["next_cursor"]}, headers=headers).json
    assert after["jobs"] == []


def test_since_must_be_a_time_with_its_zone_or_a_cursor(client, auth):
    headers = auth()
    r = client.get("/jobs/ended", query_string={"since": "2026-11-27T00:00:00"}, headers=headers)
    assert r.status_code == 422 and r.json["error"]["message"].startswith("since: give the time's zone")
    r = client.get("/jobs/ended", query_string={"since": "garbage"}, headers=headers)
    assert r.status_code == 422 and r.json["error"]["message"].startswith("since: neither")
