"""webapi/gevent_worker.py: the one-send sendall of the API's gevent worker sends every byte, in order, as
gevent's does, whether the payload fits the socket's buffer or not."""

from __future__ import annotations

import gevent
import pytest
from gevent import socket as gevent_socket

from webapi.gevent_worker import OneSendSocket


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
