"""The claims of README.md, RELIABILITY.md, docs/*.md, bench/README.md and .env.example that can be checked
against the code, checked: settings' defaults, the error codes the API answers, and the commits they name.

(Their runnable examples run in tests/workers/test_docs_examples.py; .env.example naming every setting is
tests/workers/test_deployment.py's.)"""

from __future__ import annotations

import dataclasses
import re
import subprocess

import pytest

from batching.config import EngineConfig
from contract.settings import Settings
from tests.conftest import ROOT

PAGES = [
    ROOT / "README.md",
    ROOT / "RELIABILITY.md",
    ROOT / "bench" / "README.md",
    *(ROOT / "docs").glob("*.md"),
]
# .env.example values that are not a default: the variable has none (why)
NOT_DEFAULTS = {"COMPOSE_PROFILES": "unset, `docker compose up` starts no worker"}
# commits of the history d859f9a squashed, which bench/RESULTS.md names as the code of older runs (and says so)
SQUASHED = {"10a80bd", "578a4aa", "8555dbf", "86257b2", "a332e5a", "ae09b9e", "ce54fad", "e4d74bb"}
# (status, code) pairs the API answers that its source does not spell as literals
DERIVED_CODES = {
    (413, "request_entity_too_large"),  # werkzeug's 413, named by webapi/errors.http_error
}


def env_example() -> dict[str, str]:
    """The variables .env.example sets (not the commented examples), with their values."""
    text = (ROOT / ".env.example").read_text()
    return dict(re.findall(r"^([A-Z][A-Z0-9_]*)=(.*)$", text, flags=re.M))


@pytest.fixture
def clean_env(monkeypatch):
    """No setting of genq's in the environment (the test run's own DATABASE_URL and so on), so that
    Settings.from_env() gives the defaults."""
    for name in Settings.model_fields:
        monkeypatch.delenv(name.upper(), raising=False)
    return monkeypatch


def test_every_value_in_env_example_is_the_default(clean_env):
    defaults = Settings.from_env()
    read_by = ("docker-compose.yml", "Procfile", "gunicorn.conf.py", "workers/flowerconfig.py")
    compose = "".join((ROOT / name).read_text() for name in read_by)
    wrong, unchecked = {}, []
    for name, value in env_example().items():
        if name in NOT_DEFAULTS:
            continue
        field = name.lower()
        if field in Settings.model_fields:
            clean_env.setenv(name, value)
            read = getattr(Settings.from_env(), field)
            clean_env.delenv(name)
            if read != getattr(defaults, field):
                wrong[name] = (value, getattr(defaults, field))
        elif found := re.findall(
            rf"\$\{{{name}:-([^}}]*)\}}|environ.get\(\"{name}\", \"([^\"]*)\"\)", compose
        ):
            found = ["".join(pair) for pair in found]
            if set(found) != {value}:
                wrong[name] = (value, found)
        else:
            unchecked.append(name)
    assert wrong == {}, "name: (.env.example, the default)"
    assert unchecked == [], f"neither a setting nor given a default in {read_by}"


def test_the_settings_tables_of_the_docs_give_the_defaults(clean_env):
    """Rows `| `NAME` | `value` | ...` of the docs' tables, for the settings of contract/settings.py."""
    defaults = Settings.from_env()
    checked, wrong = 0, {}
    for page in PAGES:
        for name, value in re.findall(
            r"^\| `([A-Z][A-Z0-9_]*)` \| `([^`]*)` \|", page.read_text(), flags=re.M
        ):
            if name.lower() not in Settings.model_fields or " " in value:  # an expression, not a value
                continue
            clean_env.setenv(name, value)
            read = getattr(Settings.from_env(), name.lower())
            clean_env.delenv(name)
            checked += 1
            if read != getattr(defaults, name.lower()):
                wrong[f"{page.name}: {name}"] = (value, getattr(defaults, name.lower()))
    assert checked >= 10 and wrong == {}, wrong


def test_the_engine_defaults_the_docs_quote(clean_env):
    """MAX_NUM_SEQS unset is the engine's 256 (README, operations.md, .env.example), so a worker holds 768 under the
    default SCHEDULING_POLICY=preemptive (256 + 2 x 256), 288 under predicted."""
    max_num_seqs = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "max_num_seqs")
    assert max_num_seqs == 256
    assert Settings.from_env().worker_capacity(max_num_seqs) == 768  # operations.md's sample log line
    assert Settings.from_env(scheduling_policy="predicted").worker_capacity(max_num_seqs) == 288
    operations = (ROOT / "docs" / "operations.md").read_text()
    assert "holds up to 768 jobs" in operations and "288 under `predicted`" in operations


def answered_codes() -> set[tuple[int, str]]:
    """(status, code) of every error the API's source answers with a literal code."""
    from webapi.validation import NOT_FOUND

    found = set(DERIVED_CODES) | {(404, code) for code in NOT_FOUND}
    for path in sorted((ROOT / "webapi").glob("*.py")):
        for status, code in re.findall(
            r"(?:APIError|error_response)\(\s*(\d{3}),\s*\"([a-z_]+)\"", path.read_text()
        ):
            found.add((int(status), code))
    return found


def documented_codes() -> set[tuple[int, str]]:
    """(status, code) of every `NNN code` the docs write."""
    return {
        (int(status), code)
        for page in PAGES
        for status, code in re.findall(r"`([1-5]\d\d) ([a-z_]+)`", page.read_text())
    }


def test_the_error_codes_the_docs_list_are_the_ones_the_api_answers():
    answered, documented = answered_codes(), documented_codes()
    assert len(answered) >= 15, answered  # the scan still finds them
    assert documented - answered == set(), "documented, never answered"
    assert answered - documented == set(), "answered, not in docs/http-api.md's list"


def test_the_commits_the_docs_name_exist():
    if (
        subprocess.run(
            ["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        != "false"
    ):
        pytest.skip("a shallow clone: older commits are not here to look up")
    named = {
        word
        for page in [*PAGES, ROOT / "bench" / "RESULTS.md"]
        for word in re.findall(r"\b[0-9a-f]{7,40}\b", page.read_text())
        if re.search(r"[a-f]", word) and re.search(r"\d", word)
    } - SQUASHED
    header = (ROOT / "bench" / "RESULTS.md").read_text()[:2000]
    assert all(c in header for c in SQUASHED), "RESULTS.md's header names every squashed commit it cites"
    missing = [
        c
        for c in sorted(named)
        if subprocess.run(["git", "cat-file", "-e", f"{c}^{{commit}}"], cwd=ROOT).returncode
    ]
    assert missing == [], "commits named in the docs that this repository does not have"


# a file of the repository a page names by its path (bench/out/ holds what the benches write: not in git)
REPO_PATH = re.compile(
    r"\b((?:batching|batchclient|bench|contract|deploy|jobstore|migrations|scripts|tests|tools|webapi|workers)"
    r"/[\w./-]*\w\.(?:py|md|sh|ya?ml|json|cpp|h))\b"
)


def test_the_files_the_docs_name_exist():
    """Modules move (contract/ out of jobstore/, the hub and the follower out of webapi/events.py): a page
    that names a file names one that is there."""
    named = {(page.relative_to(ROOT), path) for page in PAGES for path in REPO_PATH.findall(page.read_text())}
    assert len(named) > 50, "the pattern finds the paths the pages name"
    missing = sorted(
        f"{page}: {path}"
        for page, path in named
        if not path.startswith("bench/out/") and not (ROOT / path).exists()
    )
    assert not missing, "pages name files that are not there:\n" + "\n".join(missing)
