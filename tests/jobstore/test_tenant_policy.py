"""`genq tenants set|list` as an operator runs them, and the stored policy the API resolves."""

from __future__ import annotations

import uuid

import pytest

from jobstore.tenant_policy import Policy, StoredPolicy, set_policy
from tests.conftest import BIN
from tests.jobstore.test_cli import run


def test_tenants_set_and_list(settings, database, new_key):
    tenant = f"pol-{uuid.uuid4().hex[:6]}"
    new_key(tenant)
    done = run(
        settings,
        BIN / "genq",
        "tenants",
        "set",
        tenant,
        "--top-priority",
        "5",
        "--max-queued",
        "20",
        "--rate-limit",
        "10/second",
        "--token-budget",
        "5000",
    )
    assert "top_priority=5" in done.stdout and "max_queued=20" in done.stdout
    back = run(settings, BIN / "genq", "tenants", "set", tenant, "--max-queued", "default")
    assert "max_queued=None" in back.stdout and "top_priority=5" in back.stdout
    rows = {
        line.split()[0]: line.split()
        for line in run(settings, BIN / "genq", "tenants", "list").stdout.splitlines()
    }
    assert rows["TENANT"][1:3] == ["TOP_PRIORITY", "SYNC_PRIORITY"]
    assert rows[tenant][1:] == ["5", "-", "-", "10/second", "5000", "86400"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--top-priority", "12"], "top_priority: give 0 (most urgent) to 9, got 12"),
        (["--rate-limit", "lots"], "rate_limit: 'lots' is not a rate limit"),
        (["--max-queued", "many"], "'many': give a number, or `default`"),
        ([], "give at least one limit to set"),
    ],
)
def test_tenants_set_refuses_a_bad_value_naming_it(settings, database, new_key, argv, message):
    tenant = f"pol-{uuid.uuid4().hex[:6]}"
    new_key(tenant)
    done = run(settings, BIN / "genq", "tenants", "set", tenant, *argv, check=False)
    assert done.returncode != 0 and message in done.stderr


def test_an_unknown_tenant_is_named(sessions):
    with pytest.raises(LookupError, match="no tenant named 'nobody-here'"), sessions.begin() as session:
        set_policy(session, "nobody-here", {"max_queued": 3})


def test_defaults_keep_todays_behaviour_and_sync_priority_never_beats_the_cap():
    defaults = Policy.resolve(None, max_queued=1000, rate_limit="50/second")
    assert (defaults.top_priority, defaults.sync_priority, defaults.max_queued, defaults.token_budget) == (
        0,
        0,
        1000,
        None,
    )
    capped = Policy.resolve(StoredPolicy(top_priority=5, sync_priority=2), max_queued=1000, rate_limit="x")
    assert capped.sync_priority == 5
