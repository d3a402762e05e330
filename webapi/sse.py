"""A server-sent-events response over a follower's pieces: what was ready written together, nothing between
the pieces and gunicorn's write.

A stream writes one chunk per engine step per caller, tens of thousands a second on a busy API, so the layers
between a chunk and the socket count (issue 25): the response hands gunicorn its own generator
(`direct_passthrough`: no werkzeug encoding and closing wrappers around each chunk), and that generator runs
the response's clean-up when it is closed, which gunicorn does once the response ends or the client is gone.
Under the API's gevent worker a stream may also be written between its own writes, by the token-event hub
(`direct_writer`, webapi/following.py): what that left unsent goes out first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

from flask import Response, request

try:  # the API's gevent worker (the api extra)
    from webapi.gevent_worker import DirectWriter
except ImportError:
    DirectWriter = None  # type: ignore[assignment,misc]

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering

# What a stream writes when nothing came for a while (a Tick): a blank line. Every SSE reader skips it (an
# empty event), and writing it keeps proxies from timing the connection out and notices a caller gone.
# Not a comment line (": keep-alive"): vLLM's benchmark client strips each network read of its blank lines
# before splitting events at them, so a comment sent on its own glues onto the next event, which is lost.
HEARTBEAT = b"\n"


class Flush(NamedTuple):
    """Everything that was ready has been given out and the follower waits now: time to write."""


FLUSH = Flush()


def direct_writer():
    """A writer of this request's response body from another greenlet (webapi/gevent_worker.py), None where
    the server offers none (another worker class, TLS, HTTP/2, Flask's test client)."""
    return DirectWriter.of(request.environ) if DirectWriter is not None else None


def sse_response(pieces: Iterator[bytes | Flush], on_close: Callable[[], None], writer=None) -> Response:
    """`pieces` (bytes, and FLUSH where the follower waits) as a text/event-stream response; `on_close()` runs
    once when it ends, whether it was read to its end, the client went away or it never started (HEAD).
    `writer`: the direct_writer() that may write between the pieces; what it left unsent goes first."""
    if request.method == "HEAD":  # the headers alone: nothing to follow
        on_close()
        return Response(mimetype="text/event-stream", headers=SSE_HEADERS)
    writes = in_writes(pieces, on_close, writer)
    next(writes)  # started: from here on, closing it runs on_close
    return Response(writes, mimetype="text/event-stream", headers=SSE_HEADERS, direct_passthrough=True)


def in_writes(pieces: Iterator[bytes | Flush], on_close: Callable[[], None], writer=None) -> Iterator[bytes]:
    """The pieces joined into one write up to each FLUSH: a stream that fell behind (its steps' events came
    together) sends them in one write, the events themselves unchanged (one per step). Its first item is
    b"" (taken by sse_response to start it); `on_close()` runs when it ends or is closed. Before each write,
    and at the end, what `writer` left unsent is sent."""
    try:
        yield b""
        gathered: list[bytes] = []
        for piece in pieces:
            if piece is FLUSH:
                if writer is not None and writer.unsent:  # before what comes after it, and before a wait
                    writer.flush()
                if gathered:
                    yield b"".join(gathered)
                    gathered = []
            else:
                gathered.append(piece)  # type: ignore[arg-type]
        if writer is not None:
            writer.flush()
        if gathered:
            yield b"".join(gathered)
    finally:
        close = getattr(pieces, "close", None)
        if close is not None:
            close()
        on_close()
