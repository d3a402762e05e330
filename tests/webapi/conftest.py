"""Fixtures of the HTTP tests that need a real server."""

from __future__ import annotations

import pytest

from tests.conftest import serve_api


@pytest.fixture(scope="module")
def server(settings, database):
    """`gunicorn "webapi:create_app()"` on a free port, as in the Procfile."""
    with serve_api(settings) as url:
        yield url
