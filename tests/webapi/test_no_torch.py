"""The API installs without torch (`pip install .[api]`): no request path may import it."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT, settings_env

SCRIPT = """
import sys
from webapi import create_app
from webapi.cli import genq  # the CLI the API image runs (keys, db)

app = create_app()
client = app.test_client()
headers = {"Authorization": "Bearer " + sys.argv[1]}
r = client.post("/jobs", json={"prompt": "Hello there", "max_tokens": 4}, headers=headers)
assert r.status_code == 202, r.json
assert client.get(r.headers["Location"], headers=headers).status_code == 200
assert client.get("/metrics").status_code == 200 and client.get("/openapi.json").status_code == 200
app.extensions["genq"].close()
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print("torch modules:", loaded)
sys.exit(1 if loaded else 0)
"""


def test_the_api_never_imports_torch(settings, database, redis_client, new_key):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, new_key()],
        cwd=ROOT,
        env=settings_env(settings),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
