"""A lean open-loop HTTP/1.1 load generator (asyncio, raw sockets), so the client costs little CPU.

The API and the load generator share the machine's cores: a client built on `requests` and threads
spends ~1-2 ms of CPU per request, as much as the server's own work. This one sends pre-built
request bytes over keep-alive connections (reconnecting when the server closes one) and parses
only the status line and Content-Length, about 0.1 ms per request.

    result = offer("http://127.0.0.1:8000", "/jobs", body, headers, rate=300, seconds=5)
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit

from bench.harness import pct


class _Connection:
    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, raw: bytes) -> int:
        """Send one request; its status code. Reconnects once if the kept-alive connection was closed."""
        for attempt in (0, 1):
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            try:
                self.writer.write(raw)
                return await self._response()
            except (ConnectionError, asyncio.IncompleteReadError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _response(self) -> int:
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length, close = 0, False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                close = True
        if length:
            await self.reader.readexactly(length)
        if close:
            self.close()
        return status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def build_request(url: str, path: str, body: dict, headers: dict[str, str]) -> tuple[str, int, bytes]:
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    head = [
        f"POST {path} HTTP/1.1",
        f"Host: {parts.netloc}",
        "Content-Type: application/json",
        f"Content-Length: {len(payload)}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return parts.hostname, parts.port or 80, ("\r\n".join(head) + "\r\n\r\n").encode() + payload


async def _offer(
    host: str, port: int, raw: bytes, rate: float, seconds: float, connections: int, timeout: float
) -> list[tuple[int, float]]:
    idle = asyncio.Queue()
    for _ in range(connections):
        idle.put_nowait(_Connection(host, port))
    results: list[tuple[int, float]] = []

    async def one(scheduled: float) -> None:
        conn = await idle.get()
        try:
            status = await asyncio.wait_for(conn.request(raw), timeout)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
            conn.close()
            status = 0
        finally:
            idle.put_nowait(conn)
        results.append((status, time.monotonic() - scheduled))  # latency from the scheduled send time

    n = int(rate * seconds)
    t0 = time.monotonic()
    tasks = []
    for i in range(n):
        delay = t0 + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(t0 + i / rate)))
    await asyncio.gather(*tasks)
    for _ in range(connections):
        (await idle.get()).close()
    return results


def offer(
    url: str,
    path: str,
    body: dict,
    headers: dict[str, str],
    *,
    rate: float,
    seconds: float,
    connections: int = 64,
    timeout: float = 5.0,
    accepted: int = 202,
) -> dict:
    """POST `body` to `path` `rate` times a second for `seconds` (open loop); counts and latencies.

    Latency is measured from each request's scheduled time, so a server that falls behind shows it
    (no coordinated omission); a request waiting for a free connection counts that wait too."""
    host, port, raw = build_request(url, path, body, headers)
    t0 = time.monotonic()
    results = asyncio.run(_offer(host, port, raw, rate, seconds, connections, timeout))
    elapsed = time.monotonic() - t0
    ok = sum(status == accepted for status, _ in results)
    every = [1000 * latency for _, latency in results]
    return {
        "offered": rate,
        "sent": len(results),
        "accepted": ok,
        "errors": len(results) - ok,
        "accepted_per_s": ok / elapsed,
        "p50_ms": pct(every, 50),
        "p99_ms": pct(every, 99),
    }
