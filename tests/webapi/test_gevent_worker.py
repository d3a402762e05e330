"""webapi/gevent_worker.py: the one-send sendall of the API's gevent worker sends every byte, in order, as
gevent's does, whether the payload fits the socket's buffer or not; a DirectWriter writes between a
gunicorn response's own writes without waiting, framed as gunicorn frames them, and what the socket did not
take goes out before the response's next write."""

from __future__ import annotations

import gevent
import pytest
from gevent import socket as gevent_socket
from gunicorn.config import Config
from gunicorn.http import wsgi
from gunicorn.http.parser import RequestParser

from webapi.gevent_worker import DirectWriter, OneSendSocket


@pytest.fixture
def connected_pair():
    """connected_pair(buffer_bytes): a OneSendSocket writing to a plain gevent socket (a small buffer: partial
    sends); both closed after the test."""
    made = []

    def make(buffer_bytes: int | None = None):
        writer, reader = gevent_socket.socketpair()
        made.extend((writer, reader))
        if buffer_bytes is not None:
            writer.setsockopt(gevent_socket.SOL_SOCKET, gevent_socket.SO_SNDBUF, buffer_bytes)
            reader.setsockopt(gevent_socket.SOL_SOCKET, gevent_socket.SO_RCVBUF, buffer_bytes)
        writer.__class__ = OneSendSocket
        return writer, reader

    yield make
    for sock in made:
        sock.close()


@pytest.fixture
def tcp_pair():
    """tcp_pair(buffer_bytes): a OneSendSocket's TCP connection to a plain gevent socket on this host, small
    buffers on both ends (TCP cuts a write short where a local socket pair would refuse it whole)."""
    made = []

    def make(buffer_bytes: int):
        listener = gevent_socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        reader = gevent_socket.socket()
        reader.setsockopt(gevent_socket.SOL_SOCKET, gevent_socket.SO_RCVBUF, buffer_bytes)
        reader.connect(listener.getsockname())
        writer, _ = listener.accept()
        listener.close()
        writer.setsockopt(gevent_socket.SOL_SOCKET, gevent_socket.SO_SNDBUF, buffer_bytes)
        writer.__class__ = OneSendSocket
        made.extend((writer, reader))
        return writer, reader

    yield make
    for sock in made:
        sock.close()


def read_all(sock, expected: int) -> bytes:
    got = bytearray()
    while len(got) < expected:
        piece = sock.recv(65536)
        if not piece:
            break
        got += piece
    return bytes(got)


def test_a_small_payload_goes_in_one_send(connected_pair):
    writer, reader = connected_pair()
    calls = []
    raw_send = writer._sock.send

    class CountingSocket:  # the raw socket's calls, counted
        def send(self, data, flags=0):
            calls.append(("send", len(data)))
            return raw_send(data, flags)

        def getsockopt(self, *args):  # gevent's sendall asks for the buffer's size first
            calls.append(("getsockopt",))
            return real.getsockopt(*args)

    real = writer._sock
    writer._sock = CountingSocket()
    try:
        writer.sendall(b"data: {}\n\n")
    finally:
        writer._sock = real
    assert calls == [("send", 10)]
    assert reader.recv(100) == b"data: {}\n\n"


@pytest.mark.parametrize("size", [1, 4096, 5_000_000])
def test_every_byte_arrives_in_order(connected_pair, size):
    writer, reader = connected_pair(buffer_bytes=16384)
    payload = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    receiving = gevent.spawn(read_all, reader, len(payload))
    writer.sendall(payload)  # far beyond the buffer: the rest after the first send goes through gevent's
    assert receiving.get(timeout=30) == payload


def test_views_and_arrays_are_sent_whole(connected_pair):
    writer, reader = connected_pair(buffer_bytes=16384)
    payload = bytearray(b"abc" * 200_000)
    receiving = gevent.spawn(read_all, reader, len(payload) + 6)
    writer.sendall(payload)
    writer.sendall(memoryview(b"xyzxyz"))
    assert receiving.get(timeout=30) == bytes(payload) + b"xyzxyz"


def test_a_closed_peer_raises_as_gevents_sendall_does(connected_pair):
    writer, reader = connected_pair()
    reader.close()
    with pytest.raises(OSError):
        for _ in range(100):  # the first write may still be buffered; the peer's reset comes after
            writer.sendall(b"x" * 1000)
            gevent.sleep(0.001)


def unchunk(raw: bytes) -> tuple[bytes, list[bytes]]:
    """A chunked HTTP/1.1 response: its head, and its chunks in order (all of it up to the last chunk)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    chunks = []
    while True:
        size, _, body = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return head, chunks
        chunks.append(body[:n])
        assert body[n : n + 2] == b"\r\n"
        body = body[n + 2 :]


def gunicorn_response(
    server_side, client_side, request: bytes, headers=(("Content-Type", "text/event-stream"),)
):
    """A real gunicorn response (gunicorn's parser and wsgi.create) to `request`, sent by the client end."""
    client_side.sendall(request)
    cfg = Config()
    req = next(iter(RequestParser(cfg, server_side, ("127.0.0.1", 1))))
    response, _ = wsgi.create(req, server_side, ("127.0.0.1", 1), ("127.0.0.1", 2), cfg)
    response.start_response("200 OK", list(headers))
    return response


def test_a_direct_writer_writes_between_the_responses_writes_and_keeps_what_did_not_fit(tcp_pair):
    server_side, client_side = tcp_pair(buffer_bytes=4096)
    response = gunicorn_response(server_side, client_side, b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n")
    writer = DirectWriter(response)
    assert not writer.write(b"too early")  # the headers are not out: the response writes first
    response.write(b"first")
    # pieces up to ~10 kB, more than the buffer: small ones TCP takes whole or refuses, a large one it cuts
    pieces = [b"data: %d %s\n\n" % (i, b"x" * (i % 7 * 1500)) for i in range(2000)]
    direct, cut_short = [], False
    for piece in pieces:  # nobody reads: the socket fills, a write is cut short, later ones are refused
        if writer.write(piece):
            direct.append(piece)
            cut_short = cut_short or bool(writer.unsent)
    assert cut_short and writer.written == len(direct) < len(pieces)
    receiving = gevent.spawn(read_all, client_side, 10**7)
    writer.flush()  # what did not fit, before the response's own next write
    assert not writer.unsent
    response.write(b"last")
    response.close()
    server_side.close()
    head, chunks = unchunk(receiving.get(timeout=30))
    assert head.startswith(b"HTTP/1.1 200 OK") and b"chunked" in head.lower()
    assert chunks == [b"first", *direct, b"last"]
    assert response.sent == sum(map(len, chunks))  # counted as gunicorn counts its own


def test_a_direct_writer_sends_an_http_1_0_body_as_it_is(connected_pair):
    server_side, client_side = connected_pair()
    response = gunicorn_response(server_side, client_side, b"GET /s HTTP/1.0\r\n\r\n")
    writer = DirectWriter(response)
    response.write(b"first ")
    assert writer.write(b"second ")
    response.write(b"third")
    server_side.close()
    assert read_all(client_side, 10**6).partition(b"\r\n\r\n")[2] == b"first second third"


def test_a_direct_writer_to_a_client_gone_says_false(connected_pair):
    server_side, client_side = connected_pair()
    response = gunicorn_response(server_side, client_side, b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n")
    writer = DirectWriter(response)
    response.write(b"first")
    client_side.close()
    assert not all(writer.write(b"x" * 1000) for _ in range(100))  # the reset comes after a write or two


def test_a_direct_writer_leaves_a_body_of_a_set_length_to_the_response(connected_pair):
    server_side, client_side = connected_pair()
    request = b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n"
    response = gunicorn_response(server_side, client_side, request, [("Content-Length", "10")])
    response.write(b"first")
    assert not DirectWriter(response).write(b"second")  # gunicorn counts a set length against its writes
