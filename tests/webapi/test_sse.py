"""A server-sent-events response (webapi/sse.py): what was ready up to each FLUSH goes out in one write, and
its clean-up runs once, whether it was read to its end, closed early or never started (HEAD)."""

from __future__ import annotations

import pytest

from webapi.sse import FLUSH, in_writes


@pytest.mark.parametrize(
    "pieces, writes",
    [
        ([b"a", FLUSH, b"b", FLUSH], [b"a", b"b"]),  # one step at a time: a write each
        ([b"a", b"b", b"c", FLUSH], [b"abc"]),  # steps that came together: one write
        ([FLUSH, FLUSH, b"a", FLUSH, FLUSH], [b"a"]),  # nothing gathered: nothing written
        ([b"a", b"b"], [b"ab"]),  # the end writes what is left
    ],
)
def test_a_response_writes_what_was_ready_together(pieces, writes):
    closed = []
    assert list(in_writes(iter(pieces), lambda: closed.append(True))) == [b"", *writes]
    assert closed == [True]


def test_a_response_closed_early_runs_its_clean_up_once():
    """The client went away after the first write: gunicorn closes the iterator, which closes the pieces
    (the follower unsubscribes) and runs the clean-up (the slot released, the job cancelled)."""
    closed, pieces_closed = [], []

    def pieces():
        try:
            yield b"a"
            yield FLUSH
            yield b"b"
            yield FLUSH
        finally:
            pieces_closed.append(True)

    writes = in_writes(pieces(), lambda: closed.append(True))
    assert next(writes) == b"" and next(writes) == b"a"
    writes.close()
    assert closed == [True] and pieces_closed == [True]


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_an_sse_response_runs_its_clean_up_once_and_a_head_follows_nothing(method):
    from flask import Flask

    from webapi.sse import sse_response

    started, closed = [], []

    def pieces():
        started.append(True)
        yield b"data: 1\n\n"
        yield FLUSH

    app = Flask(__name__)
    with app.test_request_context("/jobs/x/events", method=method):
        response = sse_response(pieces(), lambda: closed.append(True))
    assert response.mimetype == "text/event-stream" and response.headers["Cache-Control"] == "no-cache"
    if method == "HEAD":  # headers only: nothing followed, the slot given back at once
        assert closed == [True] and not started
        return
    assert closed == [] and list(response.response) == [b"data: 1\n\n"]
    response.response.close()  # what gunicorn does at the end
    assert closed == [True] and started == [True]
