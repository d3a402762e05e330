"""genq-batch installs and runs without the server: the `client` extra is the base (click, requests, tqdm),
and the client imports nothing of the server's dependencies."""

from __future__ import annotations

import re
import subprocess
import sys

import tomllib

from tests.conftest import ROOT

SERVER_ONLY = (
    "torch",
    "celery",
    "sqlalchemy",
    "flask",
    "kombu",
    "redis",
    "pydantic",
    "transformers",
    "psycopg",
)
BLOCKER = """
import sys
BLOCKED = {blocked!r}
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"the client imported {{name}}")
sys.meta_path.insert(0, Blocker())
sys.argv = ["genq-batch", "submit", "--help"]
from batchclient.cli import main
main()
"""


def test_the_client_extra_installs_no_server_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [
        re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()
        for requirement in project["dependencies"] + project["optional-dependencies"]["client"]
    ]
    assert sorted(names) == ["click", "requests", "tqdm"]
    for extra in ("api", "worker"):  # the server's own extras still bring what the server imports
        assert "genq[server]" in project["optional-dependencies"][extra]


def test_the_client_runs_with_the_server_dependencies_missing():
    done = subprocess.run(
        [sys.executable, "-c", BLOCKER.format(blocked=SERVER_ONLY)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "Submit a JSONL file of requests" in done.stdout
