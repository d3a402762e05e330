"""The admin page (webapi/admin.py) served by gunicorn, driven in Debian's headless chromium through
selenium: it opens with the admin key, filters jobs across tenants, cancels a job for real, and edits a
tenant's policy. No worker runs here: jobs stay queued until cancelled."""

from __future__ import annotations

import shutil
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest
import requests

from tests.conftest import serve_api

ADMIN_KEY = "admin-" + uuid.uuid4().hex
pytestmark = pytest.mark.skipif(
    not (shutil.which("chromium") and shutil.which("chromedriver")),
    reason="no chromium + chromedriver (scripts/services.sh installs them)",
)


@pytest.fixture(scope="module")
def admin_server(settings, database, redis_client):
    with serve_api(settings.replace(admin_key=ADMIN_KEY, served_models="spare=tiny-llama")) as url:
        yield url


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium')}")
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def submit(url: str, key: str, **fields) -> str:
    r = requests.post(
        f"{url}/jobs",
        json={"prompt": "Admin page", "max_tokens": 4, **fields},
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
    )
    assert r.status_code == 202, r.text
    return r.json()["id"]


def click_and_wait(browser, element) -> None:
    """Click something that loads a page, and wait until the new page has replaced the old one."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    page = browser.find_element(By.TAG_NAME, "html")
    element.click()
    # asked mid-navigation, chromedriver may answer "unhandled inspector error" (a 500) instead of "stale":
    # asked again, until the old page is gone (or 15 s pass: a click that loads nothing still fails)
    WebDriverWait(browser, 15, ignored_exceptions=(WebDriverException,)).until(
        expected_conditions.staleness_of(page)
    )


def rows(browser) -> list[dict]:
    from selenium.webdriver.common.by import By

    return [
        {
            name: row.get_attribute(f"data-{name}")
            for name in ("job-id", "status", "priority", "tenant", "model")
        }
        for row in browser.find_elements(By.CSS_SELECTOR, "#jobs tbody tr[data-job-id]")
    ]


def test_login_filters_and_a_cancel_that_takes_effect(admin_server, browser, new_key):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    alpha, beta = f"alpha-{uuid.uuid4().hex[:6]}", f"beta-{uuid.uuid4().hex[:6]}"
    alpha_key, beta_key = new_key(alpha), new_key(beta)
    alpha_jobs = [submit(admin_server, alpha_key, priority=p) for p in (2, 7)]
    beta_job = submit(admin_server, beta_key, priority=7)
    spare_job = submit(admin_server, beta_key, priority=7, model="spare")

    browser.get(f"{admin_server}/admin/jobs")
    assert "/admin/login" in browser.current_url  # the key first
    browser.find_element(By.NAME, "key").send_keys("wrong")
    click_and_wait(browser, browser.find_element(By.CSS_SELECTOR, "#login button"))
    assert browser.find_element(By.ID, "error").text == "That is not the admin key."
    browser.find_element(By.NAME, "key").send_keys(ADMIN_KEY)
    click_and_wait(browser, browser.find_element(By.CSS_SELECTOR, "#login button"))
    assert browser.current_url.endswith("/admin/jobs?") or "/admin/jobs" in browser.current_url
    shown = {row["job-id"] for row in rows(browser)}
    assert set(alpha_jobs) | {beta_job} <= shown  # every tenant's jobs

    # filters: tenant alpha, then priority 7 as well
    Select(browser.find_element(By.NAME, "tenant")).select_by_visible_text(alpha)
    click_and_wait(browser, browser.find_element(By.ID, "apply"))
    assert {row["job-id"] for row in rows(browser)} == set(alpha_jobs)
    Select(browser.find_element(By.NAME, "priority")).select_by_visible_text("7")
    click_and_wait(browser, browser.find_element(By.ID, "apply"))
    assert [row["job-id"] for row in rows(browser)] == [alpha_jobs[1]]
    Select(browser.find_element(By.NAME, "model")).select_by_visible_text(settings_model := "tiny-llama")
    click_and_wait(browser, browser.find_element(By.ID, "apply"))
    assert [row["job-id"] for row in rows(browser)] == [alpha_jobs[1]]
    assert rows(browser)[0]["model"] == settings_model
    browser.get(f"{admin_server}/admin/jobs?model=spare&tenant={beta}")  # the second model's: beta's one job
    assert [row["job-id"] for row in rows(browser)] == [spare_job]
    browser.get(f"{admin_server}/admin/jobs?tenant={alpha}&priority=7")

    # the job's page, its timeline, and a cancel that the tenant's API sees
    click_and_wait(browser, browser.find_element(By.CSS_SELECTOR, f'tr[data-job-id="{alpha_jobs[1]}"] a'))
    timeline = browser.find_element(By.ID, "timeline").text
    assert "created" in timeline and "claimed" in timeline  # not yet: no time
    summary = browser.find_element(By.ID, "timeline-summary").text
    assert "0 preemption(s) inside the engine; 0 hand-back(s)" in summary and "0 re-claim(s)" in summary
    assert browser.find_element(By.ID, "status").text == "queued"
    click_and_wait(browser, browser.find_element(By.ID, "cancel"))
    assert browser.find_element(By.ID, "cancel-done").text == "Cancelled."
    assert browser.find_element(By.ID, "status").text == "cancelled"
    assert not browser.find_elements(By.ID, "cancel")  # nothing left to cancel
    owner = requests.get(
        f"{admin_server}/jobs/{alpha_jobs[1]}", headers={"Authorization": f"Bearer {alpha_key}"}, timeout=10
    ).json()
    assert owner["status"] == "cancelled"

    # the cancelled filter finds it; the queued one is not among them
    browser.get(f"{admin_server}/admin/jobs?status=cancelled&tenant={alpha}")
    assert [row["job-id"] for row in rows(browser)] == [alpha_jobs[1]]


def test_a_jobs_timeline_shows_its_preemptions_hand_backs_and_re_claims(
    admin_server, browser, new_key, sessions
):
    """A job's row written as a worker writes it (jobstore's own statements: the worker's end of this is
    tests/workers/test_job_timeline.py): claimed, preempted inside the engine and resumed (with a progress
    write), handed back to the queue, claimed again by another worker, succeeded. The page lists each with its
    time, in order."""
    from selenium.webdriver.common.by import By

    from jobstore import jobs
    from jobstore.job_events import EventKind, event

    job_id = uuid.UUID(submit(admin_server, new_key(f"delta-{uuid.uuid4().hex[:6]}"), priority=6))
    with sessions.begin() as s:
        jobs.claim_job(s, job_id, "worker-a#1", 30)
    with sessions.begin() as s:
        now = datetime.now(timezone.utc)
        engine = [
            event(EventKind.PREEMPTED, now, count=1),
            event(EventKind.RESUMED, now + timedelta(seconds=0.2)),
        ]
        output = jobs.Output(job_id, "worker-a#1", 0, [5, 6], 0, b"ab", now, kept_events=0, new_events=engine)
        assert jobs.save_progress(s, [output], 30)
    time.sleep(0.3)  # after the engine's moments (the database's clock stamps what follows)
    with sessions.begin() as s:
        assert jobs.release_job(
            s, job_id, "worker-a#1", token_ids=[5, 6], text="ab", preempted=True, reason="preempted"
        )
    with sessions.begin() as s:
        jobs.claim_job(s, job_id, "worker-b#1", 30)
    with sessions.begin() as s:
        assert jobs.finish_job(
            s, job_id, "worker-b#1", token_ids=[5, 6, 7], text="abc", finish_reason="length", prompt_tokens=3
        )

    browser.get(f"{admin_server}/admin/jobs/{job_id}")
    if "/admin/login" in browser.current_url:
        browser.find_element(By.NAME, "key").send_keys(ADMIN_KEY)
        click_and_wait(browser, browser.find_element(By.CSS_SELECTOR, "#login button"))
    shown = [
        (row.get_attribute("data-event"), row.get_attribute("data-at"), row.text)
        for row in browser.find_elements(By.CSS_SELECTOR, "#timeline tbody tr")
    ]
    assert [kind for kind, _, _ in shown] == [
        "created",
        "first_claim",
        "first_token",
        "preempted",
        "resumed",
        "handed_back",
        "claimed",
        "ended",
        "queued",  # no time: the hand-back clears the last send to Redis, and nothing sent it again
    ], shown
    times = [datetime.fromisoformat(at) for _, at, _ in shown[:-1]]
    assert times == sorted(times) and shown[-1][1] == ""
    texts = dict((kind, text) for kind, _, text in shown)
    assert texts["preempted"].startswith("preempted") and "more urgent work" in texts["preempted"]
    assert "handed back" in texts["handed_back"] and "worker-a#1" in texts["handed_back"]
    assert "2 tokens kept" in texts["handed_back"]
    assert texts["claimed"].startswith("claimed again") and "claim 2, by worker-b#1" in texts["claimed"]
    assert texts["ended"].startswith("succeeded")
    summary = browser.find_element(By.ID, "timeline-summary").text
    assert (
        summary
        == "1 preemption(s) inside the engine; 1 hand-back(s) to the queue for more urgent work; 1 re-claim(s)"
    )


def test_tenants_show_policy_and_usage_and_edit_the_policy(admin_server, browser, new_key, sessions):
    from selenium.webdriver.common.by import By

    from jobstore.models import Tenant
    from jobstore.tenant_policy import stored_policy

    name = f"gamma-{uuid.uuid4().hex[:6]}"
    key = new_key(name)
    submit(admin_server, key, priority=6)
    browser.get(f"{admin_server}/admin/tenants")
    if "/admin/login" in browser.current_url:
        browser.find_element(By.NAME, "key").send_keys(ADMIN_KEY)
        click_and_wait(browser, browser.find_element(By.CSS_SELECTOR, "#login button"))
    row = browser.find_element(By.CSS_SELECTOR, f'tr[data-tenant="{name}"]')
    assert "queued 1" in row.text
    row.find_element(By.NAME, "top_priority").send_keys("4")
    row.find_element(By.NAME, "max_queued").send_keys("33")
    click_and_wait(browser, row.find_element(By.CSS_SELECTOR, "button"))
    with sessions() as session:
        tenant_id = session.query(Tenant.id).filter(Tenant.name == name).scalar()
        stored = stored_policy(session, tenant_id)
    assert (stored.top_priority, stored.max_queued, stored.rate_limit) == (4, 33, None)
    row = browser.find_element(By.CSS_SELECTOR, f'tr[data-tenant="{name}"]')
    assert row.find_element(By.NAME, "max_queued").get_attribute("value") == "33"
    row.find_element(By.NAME, "top_priority").clear()
    row.find_element(By.NAME, "top_priority").send_keys("12")
    click_and_wait(browser, row.find_element(By.CSS_SELECTOR, "button"))
    assert "top_priority: give 0 (most urgent) to 9, got 12" in browser.find_element(By.ID, "error").text


def test_the_page_is_off_without_a_key_and_scripts_may_send_it(
    settings, database, redis_client, admin_server
):
    from webapi import create_app

    app = create_app(settings)  # ADMIN_KEY unset
    try:
        assert app.test_client().get("/admin/jobs").status_code == 404
    finally:
        app.extensions["genq"].close()
    r = requests.get(
        f"{admin_server}/admin/jobs", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10
    )
    assert r.status_code == 200 and 'id="jobs"' in r.text
    r = requests.get(f"{admin_server}/admin/jobs", allow_redirects=False, timeout=10)
    assert r.status_code == 302 and "/admin/login" in r.headers["Location"]
