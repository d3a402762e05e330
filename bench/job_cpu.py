"""The job system's own CPU per job, apart from the engine (issue 25).

A fresh stack (bench/stack.py: gunicorn, one worker) on a private redis-server, the built-in tiny-llama;
N jobs (default 1,000) of 16 tokens, three ways in:

| path | how the jobs come in | how the bench waits |
| --- | --- | --- |
| `jobs` | one `POST /jobs` each, over 16 keep-alive connections | Postgres (a connection not counted) |
| `batch` | one JSONL upload + `POST /v1/batches` | Postgres, then one `GET /v1/batches/<id>` (it writes the output file) |
| `stream` | one streamed `POST /v1/completions` each, all at once | the streams' ends |
| `stream-long` | as `stream`, each job `--long-factor` (8) times the tokens | the streams' ends |

Stack CPU = the CPU time of the API's processes, of the worker's process less its engine process, of the
private Redis, and of the Postgres backends serving the stack's database, from the first request to the
last job done. The engine process and this client are reported apart and not counted. It prints, per path:
stack ms per job and engine ms per job (targets: batch <= 2 ms/job, jobs <= 4 ms/job). A streamed token's
cost is what `stream-long` costs beyond `stream`, over the tokens it adds: the same number of streamed
jobs, so their per-job costs (request, claim, result) cancel, and what is left is what grows with tokens
(the engine's per-step output, the events, the progress writes, the SSE chunks); target <= 50 µs. Every
job runs to its `max_tokens` (`ignore_eos`), so the token counts are fixed.

    python bench/job_cpu.py                      # all four paths, 1,000 jobs each
    python bench/job_cpu.py --jobs 200 --paths jobs,stream
    python bench/job_cpu.py --paths stream,stream-long --repeat 3   # a streamed token, the median of 3
    python bench/job_cpu.py --profile bench/out/profile   # + py-spy of the API and worker, per path

With `--profile DIR`, py-spy samples the API's and the worker's processes (not the engine's) during each
path (samples holding the GIL: Python CPU, not waits) and writes DIR/<path>-<part>-<pid>.txt (collapsed stacks) and DIR/<path>-<part>.top (the functions
taking the most samples, self and total); the profiler's own cost makes those runs' figures higher.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing
import requests  # noqa: E402
from sqlalchemy import text  # noqa: E402

from bench.harness import own_seconds as own_cpu  # noqa: E402
from bench.harness import proc_stat, session_cpu  # noqa: E402
from bench.stack import bench_settings, local_stack, private_redis  # noqa: E402
from jobstore.db import make_engine  # noqa: E402

PROMPT = "Once upon a time"
TARGETS = {"batch": 2.0, "jobs": 4.0}


class Meter:
    """CPU seconds of the stack's parts between start() and stop()."""

    def __init__(self, stack, redis_pid: int, database_url: str):
        self.stack, self.redis_pid = stack, redis_pid
        self.db = make_engine(database_url)
        self.conn = self.db.connect().execution_options(isolation_level="AUTOCOMMIT")
        self.own_backend = self.conn.scalar(text("SELECT pg_backend_pid()"))
        self.name = self.conn.scalar(text("SELECT current_database()"))

    def backends(self) -> list[int]:
        rows = self.conn.execute(
            text("SELECT pid FROM pg_stat_activity WHERE datname = :db AND pid <> :me"),
            {"db": self.name, "me": self.own_backend},
        )
        return [r[0] for r in rows]

    def sample(self) -> dict[str, dict[int, float]]:
        parts: dict[str, dict[int, float]] = {
            "api": {},
            "worker": {},
            "engine": {},
            "redis": {},
            "postgres": {},
        }
        for pid, (_, cpu) in session_cpu(self.stack.api_pid).items():
            parts["api"][pid] = cpu
        for worker in self.stack.workers:
            for pid, (comm, cpu) in session_cpu(worker.pid).items():
                parts["engine" if comm == "genq-engine" else "worker"][pid] = cpu
        stat = proc_stat(self.redis_pid)
        parts["redis"][self.redis_pid] = stat[2] if stat else 0.0
        for pid in self.backends():
            stat = proc_stat(pid)
            if stat is not None:
                parts["postgres"][pid] = stat[2]
        return parts

    def start(self) -> None:
        self.before, self.client_before = self.sample(), own_cpu()

    def stop(self) -> dict[str, float]:
        after = self.sample()
        used = {
            part: sum(cpu - self.before[part].get(pid, 0.0) for pid, cpu in pids.items())
            for part, pids in after.items()
        }
        used["client"] = own_cpu() - self.client_before
        return used

    def done(self, since: float) -> int:
        return self.conn.scalar(
            text("SELECT count(*) FROM jobs WHERE status = 'succeeded' AND created_at >= to_timestamp(:t)"),
            {"t": since},
        )

    def tokens(self, since: float) -> int:
        return self.conn.scalar(
            text(
                "SELECT coalesce(sum(cardinality(output_token_ids)), 0) FROM jobs "
                "WHERE created_at >= to_timestamp(:t)"
            ),
            {"t": since},
        )


async def http(port: int, requests_: list[bytes], connections: int) -> list[int]:
    """Send raw HTTP/1.1 requests over `connections` keep-alive connections; their statuses."""
    queue: asyncio.Queue = asyncio.Queue()
    for r in requests_:
        queue.put_nowait(r)
    statuses: list[int] = []

    async def connection():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while not queue.empty():
            writer.write(queue.get_nowait())
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(
                next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
            )
            await reader.readexactly(length)
            statuses.append(int(head.split(b" ", 2)[1]))
        writer.close()

    await asyncio.gather(*(connection() for _ in range(connections)))
    return statuses


def post(path: str, key: str, body: dict, close: bool = False) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n{'Connection: close' + chr(13) + chr(10) if close else ''}\r\n"
    ).encode() + data


async def streams(port: int, key: str, n: int, max_tokens: int) -> list[int]:
    body = {
        "model": "tiny-llama",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    request = post("/v1/completions", key, body, close=True)

    async def one() -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        await writer.drain()
        raw = await reader.read()
        writer.close()
        return int(raw.split(b" ", 2)[1]) if raw.endswith(b"0\r\n\r\n") and b"[DONE]" in raw else -1

    return await asyncio.gather(*(one() for _ in range(n)))


class Profiler:
    """py-spy record on the API's and the worker's processes (the engine apart) while a path runs."""

    def __init__(self, folder: Path | None, meter: Meter):
        self.folder, self.meter, self.running = folder, meter, []

    def start(self, path: str) -> None:
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        for part in ("api", "worker"):
            for pid in self.meter.sample()[part]:
                out = self.folder / f"{path}-{part}-{pid}.txt"
                command = [
                    "py-spy",
                    "record",
                    "-p",
                    str(pid),
                    "-r",
                    "250",
                    "--nonblocking",
                    "--gil",
                    "-f",
                    "raw",
                ]
                spy = subprocess.Popen(
                    [shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"), *command[1:]]
                    + ["-o", str(out)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                self.running.append((path, part, out, spy))

    def stop(self) -> None:
        for _, _, _, spy in self.running:
            spy.send_signal(signal.SIGINT)
        for _, _, _, spy in self.running:
            spy.wait()
        by_part: dict[tuple[str, str], list[Path]] = {}
        for path, part, out, _ in self.running:
            by_part.setdefault((path, part), []).append(out)
        for (path, part), outs in by_part.items():
            (self.folder / f"{path}-{part}.top").write_text(top_functions(outs))
        self.running = []


def top_functions(files: list[Path], n: int = 60) -> str:
    """The functions with the most samples in py-spy's collapsed stacks: self and total, as % of samples."""
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    samples = 0
    for file in files:
        if not file.exists():
            continue
        for line in file.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            frames = stack.split(";")
            samples += int(count)
            own[frames[-1]] = own.get(frames[-1], 0) + int(count)
            for frame in set(frames):
                total[frame] = total.get(frame, 0) + int(count)
    lines = [f"{samples} samples"]
    for title, table in (("self", own), ("total", total)):
        lines.append(f"--- {title}")
        for frame, count in sorted(table.items(), key=lambda kv: -kv[1])[:n]:
            lines.append(f"{count / max(samples, 1) * 100:6.1f}%  {frame}")
    return "\n".join(lines) + "\n"


def run_path(
    path: str, stack, meter: Meter, n: int, max_tokens: int, profiler: Profiler, long_factor: int = 8
) -> dict:
    port = int(stack.url.rsplit(":", 1)[1])
    since = time.time() - 0.01  # jobs created from now: not the previous path's last ones
    profiler.start(path)
    meter.start()
    started = time.monotonic()
    if path == "jobs":
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        statuses = asyncio.run(http(port, [post("/jobs", stack.key, body)] * n, 16))
        assert statuses.count(202) == n, {s: statuses.count(s) for s in set(statuses)}
    elif path == "batch":
        lines = "".join(
            json.dumps(
                {
                    "custom_id": f"r{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {
                        "prompt": PROMPT,
                        "max_tokens": max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                }
            )
            + "\n"
            for i in range(n)
        )
        file = requests.post(
            stack.url + "/v1/files",
            headers=stack.headers,
            files={"file": ("in.jsonl", io.BytesIO(lines.encode()))},
            data={"purpose": "batch"},
        ).json()
        batch = requests.post(
            stack.url + "/v1/batches",
            headers=stack.headers,
            json={"input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "24h"},
        ).json()
    failed = {}
    if path in ("stream", "stream-long"):
        tokens = max_tokens * (long_factor if path == "stream-long" else 1)
        statuses = asyncio.run(streams(port, stack.key, n, tokens))
        failed = {s: statuses.count(s) for s in set(statuses) if s != 200}  # -1: no [DONE]
        n = statuses.count(200)
    while meter.done(since) < n:
        time.sleep(0.2)
    if path == "batch":
        while requests.get(f"{stack.url}/v1/batches/{batch['id']}", headers=stack.headers).json()[
            "status"
        ] != ("completed"):
            time.sleep(0.2)
    seconds = time.monotonic() - started
    used = meter.stop()
    profiler.stop()
    tokens = meter.tokens(since)
    stack_cpu = used["api"] + used["worker"] + used["redis"] + used["postgres"]
    return {
        "path": path,
        "jobs": n,
        "tokens": tokens,
        "seconds": seconds,
        "stack_cpu_s": stack_cpu,
        "stack_ms_per_job": stack_cpu / n * 1000,
        "engine_ms_per_job": used["engine"] / n * 1000,
        "parts_ms_per_job": {k: v / n * 1000 for k, v in used.items()},
        "stack_us_per_token": stack_cpu / max(tokens, 1) * 1e6,
        "failed": failed,
    }


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--paths", default="jobs,batch,stream,stream-long")
    ap.add_argument(
        "--repeat", type=int, default=1, help="rounds of the paths in one stack (medians printed)"
    )
    ap.add_argument(
        "--long-factor", type=int, default=8, help="stream-long's jobs make this many times --max-tokens"
    )
    ap.add_argument("--json", default="bench/out/job_cpu.json")
    ap.add_argument("--profile", type=Path, help="a folder for py-spy profiles of the API and the worker")
    args = ap.parse_args(argv)
    results = []
    with private_redis() as own_redis:
        settings = bench_settings(redis_url=f"redis://127.0.0.1:{own_redis.port}/0")
        with local_stack(settings, log_dir=Path("bench/out/logs/job_cpu")) as stack:
            meter = Meter(stack, own_redis.pid, settings.database_url)
            profiler = Profiler(args.profile, meter)
            for round_ in range(args.repeat):
                for path in args.paths.split(","):
                    load = os.getloadavg()[0]
                    result = run_path(
                        path, stack, meter, args.jobs, args.max_tokens, profiler, args.long_factor
                    )
                    result["load_before"], result["round"] = load, round_
                    results.append(result)
                    report(result, load)
    if args.repeat > 1:
        for path in args.paths.split(","):
            rounds = [r["stack_ms_per_job"] for r in results if r["path"] == path]
            print(
                f"{path:>6}: stack {statistics.median(rounds):.2f} ms/job, the median of {len(rounds)} rounds "
                f"({', '.join(f'{v:.2f}' for v in rounds)}; target {TARGETS.get(path, '-')})"
            )
    per_token = streamed_token_cost(results)
    if per_token:
        median = {part: statistics.median(r[part] for r in per_token) for part in per_token[0]}
        rounds = ", ".join(f"{r['stack']:.1f}" for r in per_token)
        parts = ", ".join(f"{part} {v:.1f}" for part, v in median.items() if part != "stack")
        print(
            f"streaming: {median['stack']:.1f} µs of stack CPU per streamed token, the median of {len(per_token)} "
            f"round(s) ({rounds}); by part: {parts} (stream-long's tokens beyond stream's, same number of "
            "jobs; target <= 50)"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"runs": results, "streamed_token_us": per_token}, indent=2))
    return results


def report(result: dict, load: float) -> None:
    parts = ", ".join(f"{k} {v:.2f}" for k, v in result["parts_ms_per_job"].items())
    print(
        f"{result['path']:>6}: {result['jobs']} jobs, {result['tokens']} tokens in {result['seconds']:.1f} s "
        f"(load {load:.1f}): stack {result['stack_ms_per_job']:.2f} ms/job "
        f"(target {TARGETS.get(result['path'], '-')}), engine {result['engine_ms_per_job']:.2f} ms/job; "
        f"per part ms/job: {parts}" + (f"; failed: {result['failed']}" if result["failed"] else ""),
        flush=True,
    )


def streamed_token_cost(results: list[dict]) -> list[dict]:
    """Per round with both stream paths: µs of CPU per streamed token, the stack's and each part's."""
    costs = []
    for round_ in sorted({r["round"] for r in results}):
        by_path = {r["path"]: r for r in results if r["round"] == round_}
        if "stream" not in by_path or "stream-long" not in by_path:
            continue
        short, long = by_path["stream"], by_path["stream-long"]
        added = max(long["tokens"] - short["tokens"], 1)
        cost = {"stack": (long["stack_cpu_s"] - short["stack_cpu_s"]) / added * 1e6}
        for part in ("api", "worker", "redis", "postgres"):
            spent = (
                long["parts_ms_per_job"][part] * long["jobs"]
                - short["parts_ms_per_job"][part] * short["jobs"]
            )
            cost[part] = spent / 1000 / added * 1e6
        long["us_per_streamed_token"] = cost["stack"]
        costs.append(cost)
    return costs


if __name__ == "__main__":
    main()
