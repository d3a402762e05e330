"""The operator's commands as a user runs them: `genq keys create|list|revoke`, `genq db create`,
`python -m jobstore createdb`, against this session's database."""

from __future__ import annotations

import subprocess
import sys
import uuid

from tests.conftest import BIN, ROOT, settings_env


def run(settings, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in argv],
        cwd=ROOT,
        env=settings_env(settings),
        capture_output=True,
        text=True,
        check=check,
    )


def test_keys_create_list_revoke_and_the_api_refuses_a_revoked_key(settings, database, redis_client):
    from webapi import create_app

    tenant = f"cli-{uuid.uuid4().hex[:6]}"
    key = run(settings, BIN / "genq", "keys", "create", tenant).stdout.splitlines()[-1]
    headers = {"Authorization": f"Bearer {key}"}
    [header, row] = run(settings, BIN / "genq", "keys", "list", "--tenant", tenant).stdout.splitlines()
    assert header.split() == ["PREFIX", "TENANT", "CREATED", "REVOKED"]
    assert row.split()[:2] == [key[:10], tenant] and row.split()[-1] == "-"

    app = create_app(settings)
    assert app.test_client().get("/jobs", headers=headers).status_code == 200
    revoked = run(settings, BIN / "genq", "keys", "revoke", key[:10])
    assert revoked.stdout.startswith(f"revoked {key[:10]}")
    # an API process that has not looked the key up since is refused at once (one that has: within
    # AUTH_CACHE_SECONDS, tests/webapi/test_jobs.py)
    fresh = create_app(settings)
    r = fresh.test_client().get("/jobs", headers=headers)
    assert r.status_code == 401 and r.json["error"]["message"] == "unknown or revoked API key"
    [_, row] = run(settings, BIN / "genq", "keys", "list", "--tenant", tenant).stdout.splitlines()
    assert row.split()[-1] != "-"
    for made in (app, fresh):
        made.extensions["genq"].close()


def test_revoking_an_unknown_key_says_so(settings, database):
    done = run(settings, BIN / "genq", "keys", "revoke", "gq_nothere", check=False)
    assert done.returncode == 1 and "no key matches 'gq_nothere'" in done.stderr


def test_the_flask_command_of_the_contract_prints_the_key_last(settings, database):
    out = run(settings, BIN / "flask", "--app", "webapi", "keys", "create", "flask-tenant").stdout
    assert out.splitlines()[-1].startswith("gq_") and len(out.splitlines()[-1]) > 40


def test_database_commands(settings, database):
    assert run(settings, BIN / "genq", "db", "create").stdout.strip().endswith(": exists")
    assert run(settings, sys.executable, "-m", "jobstore", "createdb").stdout.strip().endswith(": exists")
    assert run(settings, sys.executable, "-m", "jobstore", "nonsense", check=False).returncode == 2
