"""A server-sent-events response over a follower's pieces: what was ready written together, nothing between
the pieces and gunicorn's write.

A stream writes one chunk per engine step per caller, tens of thousands a second on a busy API, so the layers
between a chunk and the socket count (issue 25): the response hands gunicorn its own generator
(`direct_passthrough`: no werkzeug encoding and closing wrappers around each chunk), and that generator runs
the response's clean-up when it is closed, which gunicorn does once the response ends or the client is gone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from flask import Response, request

from webapi.events import FLUSH, Flush

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering


def sse_response(pieces: Iterator[bytes | Flush], on_close: Callable[[], None]) -> Response:
    """`pieces` (bytes, and FLUSH where the follower waits) as a text/event-stream response; `on_close()` runs
    once when it ends, whether it was read to its end, the client went away or it never started (HEAD)."""
    if request.method == "HEAD":  # the headers alone: nothing to follow
        on_close()
        return Response(mimetype="text/event-stream", headers=SSE_HEADERS)
    writes = in_writes(pieces, on_close)
    next(writes)  # started: from here on, closing it runs on_close
    return Response(writes, mimetype="text/event-stream", headers=SSE_HEADERS, direct_passthrough=True)


def in_writes(pieces: Iterator[bytes | Flush], on_close: Callable[[], None]) -> Iterator[bytes]:
    """The pieces joined into one write up to each FLUSH: a stream that fell behind (its steps' events came
    together) sends them in one write, the events themselves unchanged (one per step). Its first item is
    b"" (taken by sse_response to start it); `on_close()` runs when it ends or is closed."""
    try:
        yield b""
        gathered: list[bytes] = []
        for piece in pieces:
            if piece is FLUSH:
                if gathered:
                    yield b"".join(gathered)
                    gathered = []
            else:
                gathered.append(piece)  # type: ignore[arg-type]
        if gathered:
            yield b"".join(gathered)
    finally:
        close = getattr(pieces, "close", None)
        if close is not None:
            close()
        on_close()
