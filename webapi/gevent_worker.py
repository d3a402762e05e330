"""gunicorn's gevent worker with one system call per streamed chunk instead of two.

gevent's `socket.sendall` asks the kernel for the socket's send-buffer size (getsockopt SO_SNDBUF) on every
call, to cut large payloads into pieces, and only then sends. A streamed completion writes one small chunk
(~150 bytes) per token per caller, tens of thousands a second on a busy API: measured in one process, a
120-byte sendall costs 4.1 µs of CPU through gevent's and 2.1 µs with one send first (bench/job_cpu.py for
the whole stack, issue 25). This worker gives each plain TCP connection it accepts a `sendall` that sends
the whole payload with one non-blocking send and leaves only what did not fit to gevent's own (which waits
for the socket, keeping its timeout and error behaviour). TLS connections keep gevent's sockets untouched.

Used by gunicorn.conf.py for API_WORKER_CLASS=gevent (the default).
"""

from __future__ import annotations

from gevent import socket as gevent_socket
from gunicorn.workers.ggevent import GeventWorker as _GeventWorker


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


class GeventWorker(_GeventWorker):
    def handle(self, listener, client, addr):
        if type(client) is gevent_socket.socket:  # plain TCP; a TLS socket is another class and stays so
            client.__class__ = OneSendSocket
        super().handle(listener, client, addr)
