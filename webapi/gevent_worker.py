"""gunicorn's gevent worker with one system call per streamed chunk instead of two.

gevent's `socket.sendall` asks the kernel for the socket's send-buffer size (getsockopt SO_SNDBUF) on every
call, to cut large payloads into pieces, and only then sends. A streamed completion writes one small chunk
(~150 bytes) per token per caller, tens of thousands a second on a busy API: measured in one process, a
120-byte sendall costs 4.1 µs of CPU through gevent's and 2.1 µs with one send first (bench/job_cpu.py for
the whole stack, issue 25). This worker gives each plain TCP connection it accepts a `sendall` that sends
the whole payload with one non-blocking send and leaves only what did not fit to gevent's own (which waits
for the socket, keeping its timeout and error behaviour). TLS connections keep gevent's sockets untouched.

It also lets a stream's body be written from outside its own greenlet (`DirectWriter`): the token-event hub
writes a caught-up stream's next chunk itself rather than waking the stream's greenlet to write it (a
wake-up, a switch there and back and the generators between the follower and gunicorn, per token per
caller; webapi/following.py). For that the worker hands each request's gunicorn response to the app, in the
WSGI environ (RESPONSE_KEY), when it is a plain HTTP/1 response on a plain TCP socket.

Used by gunicorn.conf.py for API_WORKER_CLASS=gevent (the default).
"""

from __future__ import annotations

from gevent import socket as gevent_socket
from gunicorn.http.wsgi import Response as GunicornResponse
from gunicorn.workers.ggevent import GeventWorker as _GeventWorker

RESPONSE_KEY = "genq.gunicorn_response"


class OneSendSocket(gevent_socket.socket):
    """A gevent socket whose sendall tries one send(2) of the whole payload first."""

    __slots__ = ()

    def sendall(self, data, flags=0):
        if type(data) is not bytes:  # memoryviews and arrays: gevent counts their bytes
            return super().sendall(data, flags)
        try:
            sent = self._sock.send(data, flags)  # the raw socket is non-blocking under gevent
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            return super().sendall(memoryview(data)[sent:], flags)
        return None


class DirectWriter:
    """Writes body bytes of a response under way from another greenlet, never waiting: what the socket
    takes now goes out, framed as gunicorn frames it (a chunk of a chunked response), and counted in the
    response's `sent`; what it does not take is kept (`unsent`) for the response's own greenlet to send
    before its next write (`flush`). Only between two writes of that greenlet, once the headers went out."""

    __slots__ = ("_response", "_raw", "unsent", "written")

    def __init__(self, response: GunicornResponse):
        self._response = response
        self._raw = response.sock._sock  # the non-blocking socket under gevent's
        self.unsent = b""
        self.written = 0  # writes made

    @classmethod
    def of(cls, environ: dict) -> DirectWriter | None:
        """The writer of this request's response; None outside this worker, or for TLS or HTTP/2."""
        response = environ.get(RESPONSE_KEY)
        return cls(response) if response is not None else None

    def write(self, data: bytes) -> bool:
        """Send `data` now, or say False (nothing sent: the headers are not out, bytes are still unsent, the
        response has a Content-Length, the socket is full or failed; the caller's greenlet writes it then)."""
        response = self._response
        if (
            self.unsent
            or not response.headers_sent
            or response.response_length is not None  # a body of a set length: gunicorn's writes count it
            or getattr(response, "_omits_body", False)
        ):
            return False
        frame = b"%X\r\n%b\r\n" % (len(data), data) if response.chunked else data
        try:
            sent = self._raw.send(frame)
        except OSError:  # full (BlockingIOError), or the client is gone: its own write will say so
            return False
        response.sent += len(data)
        self.written += 1
        if sent < len(frame):
            self.unsent = frame[sent:]
        return True

    def flush(self) -> None:
        """Send what a write left unsent (waiting for the socket, as the response's own writes do)."""
        if self.unsent:
            unsent, self.unsent = self.unsent, b""
            self._response.sock.sendall(unsent)


class GeventWorker(_GeventWorker):
    def handle(self, listener, client, addr):
        if type(client) is gevent_socket.socket:  # plain TCP; a TLS socket is another class and stays so
            client.__class__ = OneSendSocket
        super().handle(listener, client, addr)

    def load_wsgi(self):
        super().load_wsgi()
        app = self.wsgi

        def with_response(environ, start_response):
            response = getattr(start_response, "__self__", None)  # gunicorn's Response.start_response
            if type(response) is GunicornResponse and type(response.sock) is OneSendSocket:
                environ[RESPONSE_KEY] = response
            return app(environ, start_response)

        self.wsgi = with_response
