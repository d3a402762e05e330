"""Every `sh` and `python` example of README.md and docs/*.md runs, as a reader would type it, against a
real stack: gunicorn serving the API, a worker with tiny-llama, Postgres and Redis.

A page's examples run in the order they appear, in one scratch directory: `sh` blocks in bash with
`set -euo pipefail` and curl failing on an HTTP error, `python` blocks in one interpreter (a later block
sees what an earlier one defined, as in a notebook). `localhost:8000` / `127.0.0.1:8000` become the
test API's address, and `$KEY` holds a fresh key (an example may make its own). Blocks tagged otherwise
(`console`, `dotenv`, none) are shown, not run: the commands that start or build whole stacks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, serve_api, settings_env
from tests.workers.conftest import worker_stack

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = ("sh", "python")
BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```$", re.M | re.S)
CURL_FAILS_ON_HTTP_ERRORS = 'curl() { command curl --fail-with-body "$@"; }\n'


def examples(page: Path) -> list[tuple[str, str]]:
    """The page's runnable blocks, (language, code), in order."""
    return [(lang, code) for lang, code in BLOCK.findall(page.read_text()) if lang in RUN]


def test_the_docs_have_runnable_examples_on_every_interface_page():
    runnable = {page.name: len(examples(page)) for page in PAGES}
    for name in ("README.md", "http-api.md", "openai.md", "library.md"):
        assert runnable[name] >= 1, (name, runnable)


@pytest.fixture(scope="module")
def stack_url(settings, new_key, tmp_path_factory, redis_client):
    with worker_stack(settings, new_key, tmp_path_factory.mktemp("docs"), max_num_seqs=8) as stack:
        with serve_api(stack.settings) as url:
            yield stack, url, new_key()


@pytest.mark.parametrize("page", [p for p in PAGES if examples(p)], ids=lambda p: p.name)
def test_every_example_of_the_page_runs(page, stack_url, tmp_path):
    stack, url, key = stack_url
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    env = {**settings_env(stack.settings), "KEY": key, "PYTHONUNBUFFERED": "1"}
    namespace: dict = {}
    for i, (lang, code) in enumerate(examples(page)):
        code = re.sub(r"(localhost|127\.0\.0\.1):8000", url.removeprefix("http://"), code)
        where = f"{page.name}, example {i + 1} ({lang}):\n{code}"
        if lang == "sh":
            done = subprocess.run(
                ["bash", "-c", "set -euo pipefail\n" + CURL_FAILS_ON_HTTP_ERRORS + code],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=180,
            )
            assert done.returncode == 0, (
                f"{where}\nexit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
            )
        else:
            before, cwd = dict(os.environ), os.getcwd()
            os.environ.update(env)
            os.chdir(tmp_path)
            try:
                exec(compile(code, f"{page.name}#{i + 1}", "exec"), namespace)  # noqa: S102 - the docs' own code
            finally:
                os.chdir(cwd)
                os.environ.clear()
                os.environ.update(before)
    assert "Traceback" not in stack.log_text(), stack.log_text()
