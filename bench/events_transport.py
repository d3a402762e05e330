"""How a worker's token events should reach Redis: one stream per job, or one stream for all (issue 25).

A worker's engine step changes W jobs at once. Two ways to publish that step and read it back:

| design | worker, per step | a reader (one per API process), per step |
| --- | --- | --- |
| per-job streams | a pipeline of W `XADD job:<id> MAXLEN ~ 64` (+ `EXPIRE` each) | one `XREAD` over the W streams it follows |
| one stream (chosen) | one `XADD events MINID ~ <now - retention>` with W fields | one `XREAD` of one stream, W fields taken out |

Against a private redis-server (its CPU from `INFO cpu`, nobody else's), it publishes S steps of W jobs
(one new token and a few characters each) in each design, then reads them back as a hub does, and prints
the CPU per job-step (one token of one job) of the publisher, of Redis and of the reader.

    python bench/events_transport.py                 # W = 16, 64, 256; 400 steps each
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import redis  # noqa: E402

from bench.harness import own_seconds  # noqa: E402
from bench.stack import private_redis  # noqa: E402
from contract.deltas import Delta  # noqa: E402
from contract.token_events import decode, encode  # noqa: E402


def redis_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return info["used_cpu_user"] + info["used_cpu_sys"]


def run(client: redis.Redis, design: str, width: int, steps: int) -> dict[str, float]:
    client.flushdb()
    keys = [os.urandom(16).hex() for _ in range(width)]
    deltas = [Delta(i, [1000 + i], 3 * i, "abc") for i in range(steps)]
    c0, r0 = own_seconds(), redis_cpu(client)
    for i in range(steps):
        payload = encode(deltas[i])
        if design == "per-job":
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.xadd(f"job:{key}", {"d": payload}, maxlen=64, approximate=True)
                if i == 0:
                    pipe.expire(f"job:{key}", 600)
            pipe.execute()
        else:
            minid = int(time.time() * 1000) - 60_000
            client.xadd("events", {key: payload for key in keys}, minid=minid, approximate=True)
    c1, r1 = own_seconds(), redis_cpu(client)
    got = 0
    if design == "per-job":
        last = {f"job:{key}": "0-0" for key in keys}
        while replies := client.xread(last, count=1000):  # what trimming kept
            for stream, entries in replies:
                for entry_id, fields in entries:
                    last[stream.decode()] = entry_id
                    decode(fields[b"d"])
                    got += 1
    else:
        last_id = "0-0"
        wanted = [key.encode() for key in keys]
        while replies := client.xread({"events": last_id}, count=1000):
            for _, entries in replies:
                for entry_id, fields in entries:
                    last_id = entry_id
                    for key in wanted:
                        decode(fields[key])
                        got += 1
    c2, r2 = own_seconds(), redis_cpu(client)
    n = width * steps
    return {
        "publish_us": (c1 - c0) / n * 1e6,
        "redis_us": ((r1 - r0) + (r2 - r1)) / n * 1e6,
        "read_us": (c2 - c1) / max(got, 1) * 1e6,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="16,64,256")
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args(argv)
    with private_redis() as server:
        client = redis.Redis(port=server.port)
        print(
            f"load average {os.getloadavg()[0]:.2f}; microseconds of CPU per job-step (one token of one job)"
        )
        print(f"{'width':>6} {'design':>10} {'publisher':>10} {'redis':>8} {'reader':>8} {'total':>8}")
        for width in map(int, args.widths.split(",")):
            for design in ("per-job", "one"):
                r = run(client, design, width, args.steps)
                total = r["publish_us"] + r["redis_us"] + r["read_us"]
                print(
                    f"{width:>6} {design:>10} {r['publish_us']:>10.2f} {r['redis_us']:>8.2f} "
                    f"{r['read_us']:>8.2f} {total:>8.2f}"
                )


if __name__ == "__main__":
    main()
