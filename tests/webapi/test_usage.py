"""GET /usage and the per-tenant metrics against jobs a real worker ran: usage is the sum of the jobs."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from jobstore.tenant_policy import set_policy


@pytest.fixture(scope="module")
def ran(settings, new_key, tmp_path_factory, redis_client, sessions):
    """A worker, a tenant whose 6 jobs ended (one cancelled before it could start, maybe), and another's."""
    from tests.workers.conftest import worker_stack
    from webapi import create_app

    with worker_stack(settings, new_key, tmp_path_factory.mktemp("usage"), max_num_seqs=4) as stack:
        client = stack.client
        other = {"Authorization": f"Bearer {new_key()}"}
        name = "usage-tenant-" + str(time.monotonic_ns())[-8:]
        headers = {"Authorization": f"Bearer {new_key(name)}"}
        with sessions.begin() as session:
            set_policy(session, name, {"token_budget": 100_000})
        jobs = [{"prompt": f"Usage {i}", "max_tokens": 2 + i, "temperature": 0.0} for i in range(6)]
        answer = client.post("/jobs/bulk", json={"jobs": jobs}, headers=headers).json
        ids = [r["job"]["id"] for r in answer["results"]]
        client.post(f"/jobs/{ids[-1]}/cancel", headers=headers)
        # a job for a second model the fleet serves (no worker of it here: cancelled while queued)
        spare_app = create_app(stack.settings.replace(served_models="spare=tiny-llama"))
        spare = spare_app.test_client().post(
            "/jobs", json={"prompt": "Spare", "max_tokens": 3, "model": "spare"}, headers=headers
        )
        assert spare.status_code == 202, spare.json
        client.post(f"/jobs/{spare.json['id']}/cancel", headers=headers)
        spare_app.extensions["genq"].close()
        client.post("/jobs", json={"prompt": "someone else", "max_tokens": 3}, headers=other)
        deadline = time.monotonic() + 120
        while True:
            listed = client.get("/jobs", query_string={"limit": 100}, headers=headers).json["jobs"]
            if all(j["status"] not in ("queued", "running") for j in listed):
                break
            assert time.monotonic() < deadline
            time.sleep(0.2)
        yield stack, headers, name, listed


def test_usage_is_the_sum_of_the_tenants_jobs(ran):
    stack, headers, name, jobs = ran
    usage = stack.client.get("/usage", headers=headers).json
    assert usage["tenant"] == name
    assert usage["prompt_tokens"] == sum(j["usage"]["prompt_tokens"] for j in jobs)
    assert usage["completion_tokens"] == sum(j["usage"]["completion_tokens"] for j in jobs)
    assert usage["completion_tokens"] > 0
    counted = Counter(j["status"] for j in jobs)
    assert usage["jobs"] == {
        s: counted.get(s, 0) for s in ("queued", "running", "succeeded", "failed", "cancelled")
    }
    models = {m["model"]: m for m in usage["models"]}
    assert set(models) == {stack.settings.fleet_default_model(), "spare"}
    assert models["spare"]["jobs"]["cancelled"] == 1 and models["spare"]["prompt_tokens"] == len("Spare") + 1
    assert sum(m["prompt_tokens"] for m in models.values()) == usage["prompt_tokens"]
    assert sum(sum(m["jobs"].values()) for m in models.values()) == len(jobs)
    budget = usage["token_budget"]
    assert (
        budget["budget"] == 100_000 and budget["used"] == usage["prompt_tokens"] + usage["completion_tokens"]
    )
    # a period before the jobs holds none of them
    empty = stack.client.get(
        "/usage",
        query_string={"since": "2020-01-01T00:00:00Z", "until": "2020-01-02T00:00:00Z"},
        headers=headers,
    ).json
    assert empty["prompt_tokens"] == 0 and empty["models"] == [] and sum(empty["jobs"].values()) == 0


def test_usage_refuses_a_period_that_ends_before_it_starts(ran):
    stack, headers, _, _ = ran
    r = stack.client.get(
        "/usage",
        query_string={"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"},
        headers=headers,
    )
    assert r.status_code == 422 and r.json["error"]["message"] == "until: must be after since"


def _tenant_samples(text: str, metric: str) -> dict[tuple[str, str], float]:
    """(tenant, the other label's value) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.labels["tenant"], s.labels.get("kind", s.labels.get("status"))): s.value
        for family in text_string_to_metric_families(text)
        if family.name == metric
        for s in family.samples
    }


def test_metrics_label_the_busiest_tenants_and_sum_the_rest(ran, settings, database, redis_client):
    from webapi import create_app

    stack, headers, name, jobs = ran

    def scrape(named_tenants: int) -> str:
        app = create_app(stack.settings.replace(usage_metrics_tenants=named_tenants))
        try:
            return app.test_client().get("/metrics").get_data(as_text=True)
        finally:
            app.extensions["genq"].close()

    # every tenant named (the suite's other tests made tenants of their own today: this one need not be
    # among the 20 busiest)
    tokens = _tenant_samples(scrape(100_000), "genq_tenant_tokens")
    assert tokens[name, "prompt"] == sum(j["usage"]["prompt_tokens"] for j in jobs)
    assert tokens[name, "completion"] == sum(j["usage"]["completion_tokens"] for j in jobs)
    text = scrape(1)
    labelled = {tenant for tenant, _ in _tenant_samples(text, "genq_tenant_tokens")}
    assert len(labelled) == 2 and "other" in labelled  # the busiest by name, every other one as "other"
    totals = [s for s in _tenant_samples(text, "genq_tenant_jobs").values()]
    assert sum(totals) >= len(jobs) + 1
