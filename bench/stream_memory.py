"""Memory per waiting stream in the API (issue 25): N streamed /v1 completions held open at once.

A fresh stack (bench/stack.py, gunicorn's gevent workers) whose worker takes no job (its intake paused):
N clients each open a streamed `POST /v1/completions` and read its first bytes (the call is submitted and
waiting: a greenlet following its job). It prints the API processes' resident memory before and with the N
calls open, per call, and that none was refused.

    python bench/stream_memory.py --streams 5000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing
from bench.harness import session_cpu  # noqa: E402
from bench.stack import bench_settings, local_stack  # noqa: E402


def rss_mib(sid: int) -> float:
    total = 0
    for pid in session_cpu(sid):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


async def hold(port: int, key: str, n: int, ready: asyncio.Event, done: asyncio.Event) -> list[int]:
    body = json.dumps({"model": "tiny-llama", "prompt": "Hi", "max_tokens": 8, "stream": True}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    statuses: list[int] = []

    async def one():
        # a connection refused or reset while thousands open at once (the listen backlog overflowed) is
        # tried again, as a client would; one that never gets an answer head counts as -1
        for attempt in range(5):
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(request)
                await writer.drain()
                head = await reader.readuntil(b"\r\n\r\n")
                break
            except (OSError, asyncio.IncompleteReadError):
                await asyncio.sleep(0.5 * (attempt + 1))
        else:
            head, writer = b"- -1 failed", None
        statuses.append(int(head.split(b" ", 2)[1]))
        if len(statuses) == n:
            ready.set()
        await done.wait()
        if writer is not None:
            writer.close()

    await asyncio.gather(*(one() for _ in range(n)))
    return statuses


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=5000)
    args = ap.parse_args(argv)
    with local_stack(bench_settings(), log_dir=Path("bench/out/logs/stream_memory")) as stack:
        stack.pause_intake()
        port = int(stack.url.rsplit(":", 1)[1])
        before = rss_mib(stack.api_pid)

        async def run():
            ready, done = asyncio.Event(), asyncio.Event()
            task = asyncio.create_task(hold(port, stack.key, args.streams, ready, done))
            await ready.wait()
            with_calls = rss_mib(stack.api_pid)
            done.set()
            return with_calls, await task

        with_calls, statuses = asyncio.run(run())
        refused = {s: statuses.count(s) for s in set(statuses) if s != 200}
        per_call = (with_calls - before) * 1024 / args.streams
        print(
            f"{args.streams} streams open at once (load {os.getloadavg()[0]:.1f}): API RSS {before:.0f} MiB -> "
            f"{with_calls:.0f} MiB, {per_call:.1f} KiB per call; answered other than 200: {refused or 'none'}"
        )


if __name__ == "__main__":
    main()
