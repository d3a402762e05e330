"""The job system's own CPU per job, apart from the engine (issue 25).

A fresh stack (bench/stack.py: gunicorn, one worker) on a private redis-server, the built-in tiny-llama;
N jobs (default 1,000) of 16 tokens, three ways in:

| path | how the jobs come in | how the bench waits | with `--hold`, the worker stopped until |
| --- | --- | --- | --- |
| `jobs` | one `POST /jobs` each, over 16 keep-alive connections | Postgres (a connection not counted) | every POST answered and the N jobs sent to Redis |
| `batch` | one JSONL upload + `POST /v1/batches` | Postgres, then one `GET /v1/batches/<id>` (it writes the output file) | (not held) |
| `stream` | one streamed `POST /v1/completions` each, all at once | the streams' ends | the N jobs in Postgres and sent to Redis |
| `stream-long` | as `stream`, each job `--long-factor` (8) times the tokens | the streams' ends | as `stream` |

Stack CPU = the CPU time of the API's processes, of the worker's process less its engine process, of the
private Redis, and of the Postgres backends serving the stack's database, from the first request to the
last job done (with `--hold` too: below). The engine process and this client are reported apart and not counted. It prints, per path:
stack ms per job and engine ms per job (targets: batch <= 2 ms/job, jobs <= 4 ms/job). A streamed token's
cost is what `stream-long` costs beyond `stream`, over the tokens it adds: the same number of streamed
jobs, so their per-job costs (request, claim, result) cancel, and what is left is what grows with tokens
(the engine's per-step output, the events, the progress writes, the SSE chunks); target <= 50 µs. Every
job runs to its `max_tokens` (`ignore_eos`), so the token counts are fixed.

    python bench/job_cpu.py                      # all four paths, 1,000 jobs each
    python bench/job_cpu.py --jobs 200 --paths jobs,stream
    python bench/job_cpu.py --paths stream,stream-long --repeat 3   # a streamed token, the median of 3
    python bench/job_cpu.py --profile bench/out/profile   # + py-spy of the API and worker, per path
    python bench/job_cpu.py --paths jobs --rate 100 --repeat 2   # POST /jobs paced: two versions' batches alike
    python bench/job_cpu.py --paths stream --counts --jobs 300     # + what each job did, counted (below)
    python bench/job_cpu.py --paths jobs,stream --hold --jobs 300 --repeat 2   # the same backlog drained (below)

Each path also prints its engine steps per job (the batch's width, a step's wall time): the stack's per-step
work (the worker's reads and token events, the API hub's reads, the engine's own) is paid per step, and the
`jobs` and `stream` paths' jobs arrive as fast as the API takes them, so a version whose API or engine is faster
runs narrower batches and more steps per job; compare such runs at like steps per job, or paced (`--rate`), or
held (`--hold`).

With `--hold`, the `jobs`, `stream` and `stream-long` paths first stop the worker: SIGSTOP to every process of
each worker's session (the Celery worker, its engine process and anything else it started; the same for any
version, nothing asked of the worker), then submit all N jobs, wait until all are accepted (`jobs`: every POST
answered; streams: their requests stay open, so the bench reads Postgres) and sent to Redis (N rows of the path
with `enqueued_at` set, which the API's sent-marks flusher writes within 0.5 s of the send, in both versions), and
only then SIGCONT the worker: every version drains the same backlog of N queued jobs, so its batches are as wide
as its engine's limits let them be (like `batch`), whatever the API's or the engine's speed. The CPU window is
unchanged: from just before the first request to the last job done; it holds the submission with the worker
stopped (a stopped process uses no CPU: the API, Redis and Postgres are counted at work, the worker at zero) and
the drain after it. The worker is resumed even if the bench fails; a hold longer than `--hold-timeout` (60 s)
resumes it and says so (a worker's fleet announcement, where the version has one, expires after 15 s; the API
still takes jobs for its configured model). `batch` is not held (its jobs are all there at once anyway). The
seconds printed include the hold, and the line ends with it ("worker held 1.2 s"). Compare versions held at
like steps per job and width (printed); the engine's slots (256 by default) and its prefill token budget bound
the width, so N within the worker's capacity (slots plus reserve) is drained at the widest.

With `--profile DIR`, py-spy samples the API's and the worker's processes (not the engine's) during each
path (samples holding the GIL: Python CPU, not waits) and writes DIR/<path>-<part>-<pid>.txt (collapsed stacks) and DIR/<path>-<part>.top (the functions
taking the most samples, self and total); the profiler's own cost makes those runs' figures higher.

With `--counts`, each path also counts what the stack did per job, deterministic where timing is not: the
private Redis's commands by name (`INFO commandstats`) and, through MONITOR, by the part whose connection sent
them (API, worker), command and key, with the token events entries' fields (a job's step or status each), and
the Postgres statements of the stack's database
by kind and by text (`log_statement = 'all'` is set on that database alone when it is created; the server's
log, `--pg-log`, is read from where it stood when the path began; the meter's own connection is left out),
beside the database's `pg_stat_database` counters (the meter's own queries subtracted from xact_commit), and
the connections the stack opened to Redis (`INFO stats`; a burst of calls grows the API's pools). An
idle window of `--idle` seconds first gives the background's rate (beat, heartbeats), which a path's counts
also hold. Logging every statement costs Postgres CPU: time runs without `--counts`.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing
import requests  # noqa: E402
from sqlalchemy import text  # noqa: E402

import bench.stack  # noqa: E402
from bench.harness import own_seconds as own_cpu  # noqa: E402
from bench.harness import proc_stat, session_cpu  # noqa: E402
from bench.stack import bench_settings, local_stack, private_redis  # noqa: E402
from jobstore.db import make_engine  # noqa: E402

PROMPT = "Once upon a time"
TARGETS = {"batch": 2.0, "jobs": 4.0}


class Hold:
    """--hold: the stack's workers stopped (SIGSTOP to every process of each worker's session: the Celery worker and
    its engine process) until resume() (SIGCONT to the same processes). A stopped process takes no CPU and reads no
    message: the jobs submitted meanwhile wait in Redis and Postgres, and the worker then drains them together."""

    def __init__(self, stack):
        self.stack = stack
        self.stopped: list[int] = []

    def pause(self) -> None:
        pids = [pid for worker in self.stack.workers for pid in session_cpu(worker.pid)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)
                self.stopped.append(pid)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while not all(state(pid) in ("T", None) for pid in self.stopped):  # every thread stopped
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not stop: {[(p, state(p)) for p in self.stopped]}")
            time.sleep(0.005)
        self.since = time.monotonic()

    def resume(self) -> float:
        """SIGCONT to every process stopped; the seconds they were held (0 if none was)."""
        if not self.stopped:
            return 0.0
        for pid in self.stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.stopped = []
        return time.monotonic() - self.since


def state(pid: int) -> str | None:
    """A process's state letter in /proc/PID/stat (T: stopped), None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2]


class Meter:
    """CPU seconds of the stack's parts between start() and stop()."""

    def __init__(self, stack, redis_pid: int, database_url: str):
        self.stack, self.redis_pid = stack, redis_pid
        self.db = make_engine(database_url)
        self.conn = self.db.connect().execution_options(isolation_level="AUTOCOMMIT")
        self.own_backend = self.conn.scalar(text("SELECT pg_backend_pid()"))
        self.name = self.conn.scalar(text("SELECT current_database()"))
        self.own_queries = 0  # this connection's queries, which pg_stat_database counts with the stack's

    def backends(self) -> list[int]:
        self.own_queries += 1
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
        self.own_queries += 1
        return self.conn.scalar(
            text("SELECT count(*) FROM jobs WHERE status = 'succeeded' AND created_at >= to_timestamp(:t)"),
            {"t": since},
        )

    def sent(self, since: float) -> int:
        """Jobs created since `since` whose message went to Redis (`enqueued_at`: the API's sent-marks, batched)."""
        self.own_queries += 1
        return self.conn.scalar(
            text(
                "SELECT count(*) FROM jobs WHERE enqueued_at IS NOT NULL AND created_at >= to_timestamp(:t)"
            ),
            {"t": since},
        )

    def latencies(self, since: float) -> dict[str, float]:
        """Medians (ms) over the jobs created since `since`: created to claimed, to first token, to end. A job
        that ends sooner shares fewer steps with the next ones: the batch is narrower."""
        self.own_queries += 1
        row = self.conn.execute(
            text(
                "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY started_at - created_at), "
                "percentile_cont(0.5) WITHIN GROUP (ORDER BY first_token_at - created_at), "
                "percentile_cont(0.5) WITHIN GROUP (ORDER BY finished_at - created_at) "
                "FROM jobs WHERE status = 'succeeded' AND created_at >= to_timestamp(:t)"
            ),
            {"t": since},
        ).one()
        return {
            name: value.total_seconds() * 1000 if value is not None else float("nan")
            for name, value in zip(("claimed", "first_token", "ended"), row)
        }

    def tokens(self, since: float) -> int:
        return self.conn.scalar(
            text(
                "SELECT coalesce(sum(cardinality(output_token_ids)), 0) FROM jobs "
                "WHERE created_at >= to_timestamp(:t)"
            ),
            {"t": since},
        )


PG_STATS = ("xact_commit", "xact_rollback", "tup_returned", "tup_fetched", "tup_inserted", "tup_updated",
            "tup_deleted", "blks_hit", "blks_read")  # fmt: skip
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:.]+ \w+ \[(\d+)\] (\S*)@(\S*) (\w+):  (.*)$")
STATEMENT = re.compile(r"^(?:statement|execute [^:]*): (.*)$", re.S)


def log_statements(database_url: str) -> None:
    """Have the stack's database log every statement (set as it is created, so every connection does)."""
    from sqlalchemy.engine import make_url

    create = bench.stack.create_database_if_missing

    def create_and_log(url: str) -> bool:
        created = create(url)
        name = make_url(url).database
        server = make_engine(url.rsplit("/", 1)[0] + "/postgres")
        with server.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f"ALTER DATABASE \"{name}\" SET log_statement = 'all'"))
        server.dispose()
        return created

    assert make_url(database_url).database
    bench.stack.create_database_if_missing = create_and_log  # local_stack looks the name up when it runs


def kind(statement: str) -> str:
    """A statement's verb and first table: 'SELECT jobs', 'UPDATE jobs', 'BEGIN'."""
    words = statement.split()
    verb = words[0].upper().rstrip(";") if words else "?"
    table = re.search(
        {"SELECT": r"\bFROM\s+(\w+)", "INSERT": r"\bINTO\s+(\w+)", "UPDATE": r"^\s*UPDATE\s+(\w+)",
         "DELETE": r"\bFROM\s+(\w+)", "WITH": r"\b(?:UPDATE|INTO|FROM)\s+(\w+)"}.get(verb, r"^$(x)"),
        statement, re.I,
    )  # fmt: skip
    return f"{verb} {table.group(1)}" if table else verb


def normal(statement: str) -> str:
    """A statement's text with its literals folded, one line."""
    one = " ".join(statement.split())
    one = re.sub(r"'[^']*'", "?", one)
    one = re.sub(r"\b\d+\b", "N", one)
    return re.sub(r"\$N", "$", one)


class Counter:
    """Redis commands and Postgres statements between start() and stop(): the stack's, per path."""

    def __init__(self, redis_port: int, meter: Meter, pg_log: Path):
        import redis

        self.redis = redis.Redis(port=redis_port)
        self.meter, self.pg_log = meter, pg_log
        url = meter.db.url.set(database="postgres")  # read from another database: not counted in the stack's
        self.server = make_engine(url.render_as_string(hide_password=False))
        self.stats = self.server.connect().execution_options(isolation_level="AUTOCOMMIT")

    def redis_calls(self) -> dict[str, int]:
        return {
            name.removeprefix("cmdstat_"): int(v["calls"])
            for name, v in self.redis.info("commandstats").items()
            if name not in ("cmdstat_info", "cmdstat_monitor")
        }

    def pg_stats(self) -> dict[str, int]:
        self.stats.execute(text("SELECT pg_stat_clear_snapshot()"))
        row = self.stats.execute(
            text(f"SELECT {', '.join(PG_STATS)} FROM pg_stat_database WHERE datname = :db"),
            {"db": self.meter.name},
        ).one()
        return dict(zip(PG_STATS, row))

    SETTLE = 11.0  # an idle backend reports its statistics within 10 s (PGSTAT_IDLE_INTERVAL)

    def start(self) -> None:
        time.sleep(self.SETTLE)
        self.log_at = self.pg_log.stat().st_size
        self.redis_before, self.pg_before = self.redis_calls(), self.pg_stats()
        self.connections_before = self.redis.info("stats")["total_connections_received"]
        self.own_before = self.meter.own_queries
        self.monitor = Monitor(self.redis)

    def parts_by_port(self) -> dict[int, str]:
        """The stack's part ("api", "worker") that owns each local TCP port of the stack's processes."""
        import psutil

        owner: dict[int, str] = {}
        for part, pids in self.meter.sample().items():
            for pid in pids:
                try:
                    for conn in psutil.Process(pid).net_connections("tcp"):
                        owner[conn.laddr.port] = part
                except psutil.Error:
                    pass
        return owner

    def stop(self) -> dict:
        redis_after = self.redis_calls()
        connections = self.redis.info("stats")["total_connections_received"] - self.connections_before - 1
        open_by_command: dict[
            str, int
        ] = {}  # the stack's connections open now, by the last command each sent
        for client in self.redis.client_list():
            if client.get("cmd") not in ("client|list", "monitor"):
                open_by_command[client.get("cmd", "?")] = open_by_command.get(client.get("cmd", "?"), 0) + 1
        owner = self.parts_by_port()
        monitored = self.monitor.stop()
        event_fields = self.monitor.fields
        by_key: dict[str, int] = {}
        for (port, command), calls in monitored.items():
            name = f"{owner.get(port, '?')}: {command}"
            by_key[name] = by_key.get(name, 0) + calls
        with self.pg_log.open("rb") as log:
            log.seek(self.log_at)
            lines = log.read().decode(errors="replace").splitlines()
        time.sleep(self.SETTLE)  # pg_stat_database alone waits: it also holds this idle window
        pg_after = self.pg_stats()
        statements: list[str] = []
        current: list[str] | None = None
        for line in lines:
            if line.startswith("\t") and current is not None:
                current.append(line[1:])
                continue
            if current is not None:
                statements.append("\n".join(current))
                current = None
            found = LOG_LINE.match(line)
            if not found or found[3] != self.meter.name or int(found[1]) == self.meter.own_backend:
                continue
            if found[4] == "LOG" and (stmt := STATEMENT.match(found[5])):
                current = [stmt[1]]
        if current is not None:
            statements.append("\n".join(current))
        by_kind: dict[str, int] = {}
        by_text: dict[str, int] = {}
        for stmt in statements:
            by_kind[kind(stmt)] = by_kind.get(kind(stmt), 0) + 1
            by_text[normal(stmt)] = by_text.get(normal(stmt), 0) + 1
        pg = {k: pg_after[k] - self.pg_before[k] for k in PG_STATS}
        pg["xact_commit"] -= self.meter.own_queries - self.own_before  # the meter's own reads
        return {
            "redis": {
                k: v - self.redis_before.get(k, 0)
                for k, v in redis_after.items()
                if v != self.redis_before.get(k, 0)
            },
            "redis_by_key": by_key,
            "redis_connections": connections,  # opened by the stack (this counter's MONITOR left out)
            "redis_open_by_command": open_by_command,
            "event_fields": event_fields,
            "pg_statements": len(statements),
            "pg_by_kind": by_kind,
            "pg_by_text": by_text,
            "pg_stats": pg,
        }


class Monitor:
    """Redis's MONITOR in a thread: calls by (client port, command and its key with ids folded)."""

    def __init__(self, client):
        import threading

        self.calls: dict[tuple[int, str], int] = {}
        self.fields: dict[str, int] = {}  # token events entries' fields (one job each), deltas and status
        self.connection = client.connection_pool.get_connection()
        self.connection.send_command("MONITOR")
        assert self.connection.read_response() in (b"OK", "OK")
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.read, daemon=True)
        self.thread.start()

    def read(self) -> None:
        head = re.compile(r"^[\d.]+ \[\d+ ([\d.]+|unix|lua):?(\d*)\] ")
        arg = re.compile(r'"((?:[^"\\]|\\.)*)"')
        while not self.done.is_set():
            try:
                raw = self.connection.read_response()
            except Exception:
                return
            raw = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
            found = head.match(raw)
            args = arg.findall(raw[found.end() :]) if found else []
            if not args or args[0].lower() == "monitor":
                continue
            name = args[0].lower()
            if name == "xadd" and "*" in args:  # a token events entry: a step's deltas or status changes
                values = args[args.index("*") + 2 :: 2]
                what = "status" if values and values[0].startswith('\\"') else "deltas"
                name = f"xadd events {what}"
                self.fields[what] = self.fields.get(what, 0) + len(values)
            elif name in ("xread", "xrevrange", "blmpop", "lmpop", "evalsha", "eval"):
                name = f"{name} {' '.join(args[1:4])}"  # options before the key
            else:
                name = f"{name} {args[1] if len(args) > 1 else ''}"
            name = re.sub(r"[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}", "<id>", name)
            name = re.sub(r"[0-9a-f]{40}", "<sha>", re.sub(r"genq-bench-[0-9a-f]+:", "", name))
            name = re.sub(r"\d+", "N", name)[:70].strip()
            slot = (int(found[2] or 0), name)
            self.calls[slot] = self.calls.get(slot, 0) + 1

    def stop(self) -> dict[tuple[int, str], int]:
        time.sleep(0.2)  # the last commands' lines
        self.done.set()
        self.connection.disconnect()
        self.thread.join(timeout=5)
        return dict(self.calls)


def count_table(title: str, counts: dict, n: int, limit: int = 40, unit: str = "job") -> str:
    rows = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
    return "\n".join(
        [f"  {title}: {sum(counts.values()) / n:.2f} per {unit}"]
        + [f"    {v / n:8.3f}  {k[:160]}" for k, v in rows]
    )


def report_counts(counts: dict, n: int, unit: str = "job") -> None:
    print(count_table(f"Redis commands per {unit}", counts["redis"], n, unit=unit))
    print(
        f"  Redis connections opened per {unit}: {counts['redis_connections'] / n:.3f}; open at the end, by the last "
        "command each sent: "
        + ", ".join(f"{k} {v}" for k, v in sorted(counts["redis_open_by_command"].items()))
    )
    print(
        count_table(
            f"Redis commands per {unit}, by part, command and key (MONITOR)",
            counts["redis_by_key"],
            n,
            unit=unit,
        )
    )
    print(
        count_table(
            f"token events entries' fields per {unit} (a job's step or status each)",
            counts["event_fields"],
            n,
            unit=unit,
        )
    )
    print(count_table(f"Postgres statements per {unit}, by kind", counts["pg_by_kind"], n, unit=unit))
    print(
        count_table(f"Postgres statements per {unit}, by text", counts["pg_by_text"], n, limit=30, unit=unit)
    )
    print(
        "  pg_stat_database per "
        + unit
        + ": "
        + ", ".join(f"{k} {v / n:.2f}" for k, v in counts["pg_stats"].items())
    )


async def http(port: int, requests_: list[bytes], connections: int, rate: float | None = None) -> list[int]:
    """Send raw HTTP/1.1 requests over `connections` keep-alive connections; their statuses. With `rate`, the
    i-th request goes no sooner than i / rate seconds after the first (the same arrivals whatever the API's
    speed, so the engine's batches are as wide for any two versions)."""
    queue: asyncio.Queue = asyncio.Queue()
    for i, r in enumerate(requests_):
        queue.put_nowait((i, r))
    statuses: list[int] = []
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def connection():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while not queue.empty():
            i, request_ = queue.get_nowait()
            if rate is not None:
                await asyncio.sleep(max(0.0, start + i / rate - loop.time()))
            writer.write(request_)
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


def engine_steps(stack) -> tuple[int, float]:
    """Engine steps the stack's workers made so far and their seconds (genq_engine_steps_total,
    genq_engine_step_seconds_sum). The per-step work (token events, the engine host's reads, the API hub's reads)
    grows with the steps, and the same jobs take more steps when they arrive spread out (a narrower batch: a
    faster step ends a job before the next ones come): a path's cost per job is read beside its steps per job."""
    steps = seconds = 0.0
    for url in stack.worker_metrics_urls:
        text_ = requests.get(url, timeout=5).text
        for name, value in re.findall(
            r"^(genq_engine_steps_total|genq_engine_step_seconds_sum)(?:\{[^}]*\})? (\S+)", text_, re.M
        ):
            if name == "genq_engine_steps_total":
                steps += float(value)
            else:
                seconds += float(value)
    return int(steps), seconds


def run_path(
    path: str,
    stack,
    meter: Meter,
    n: int,
    max_tokens: int,
    profiler: Profiler,
    long_factor: int = 8,
    counter: Counter | None = None,
    rate: float | None = None,
    hold: Hold | None = None,
    hold_timeout: float = 60.0,
) -> dict:
    """One path's N jobs, measured; with `hold`, the worker is stopped while they are submitted (module doc)."""
    hold = hold if path in ("jobs", "stream", "stream-long") else None
    try:
        return _run_path(
            path, stack, meter, n, max_tokens, profiler, long_factor, counter, rate, hold, hold_timeout
        )
    finally:
        if hold is not None:
            hold.resume()  # a failed path leaves no stopped worker (its stop at the stack's end would wait)


def _run_path(
    path, stack, meter, n, max_tokens, profiler, long_factor, counter, rate, hold, hold_timeout
) -> dict:
    port = int(stack.url.rsplit(":", 1)[1])
    if counter:
        counter.start()
    steps_before, step_seconds_before = engine_steps(stack)  # the worker's metrics: read before it is stopped
    since = time.time() - 0.01  # jobs created from now: not the previous path's last ones
    if hold is not None:
        hold.pause()
    profiler.start(path)
    meter.start()
    started = time.monotonic()
    held_s = 0.0

    def release(short: Callable[[], bool]) -> float:
        """Once the N jobs are in Postgres and sent to Redis, the worker resumes; also if the hold times out or
        `short()` says the submission ended with fewer (refused requests)."""
        deadline = time.monotonic() + hold_timeout
        while meter.sent(since) < n:
            if time.monotonic() > deadline or short():
                print(f"--hold: {meter.sent(since)} of {n} jobs sent after {hold_timeout:.0f} s (or the "
                      "submission ended short); the worker resumes", flush=True)  # fmt: skip
                break
            time.sleep(0.05)
        return hold.resume()

    if path == "jobs":
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        statuses = asyncio.run(http(port, [post("/jobs", stack.key, body)] * n, 16, rate))
        if hold is not None:
            held_s = release(lambda: statuses.count(202) < n)
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
        if hold is None:
            statuses = asyncio.run(streams(port, stack.key, n, tokens))
        else:  # the streams stay open until their jobs end: they run in a thread while this one waits to resume
            ended: list[list[int]] = []
            thread = threading.Thread(
                target=lambda: ended.append(asyncio.run(streams(port, stack.key, n, tokens)))
            )
            thread.start()
            held_s = release(lambda: not thread.is_alive())
            thread.join()
            statuses = ended[0] if ended else []
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
    steps, step_seconds = engine_steps(stack)
    steps, step_seconds = steps - steps_before, step_seconds - step_seconds_before
    profiler.stop()
    counts = counter.stop() if counter else None
    tokens = meter.tokens(since)
    latency = meter.latencies(since)
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
        "engine_steps": steps,  # the jobs' tokens over these: the batch's mean width
        "engine_step_ms": step_seconds / max(steps, 1) * 1000,  # a step's mean wall time
        "latency_ms": latency,  # medians from creation: claimed, first token, ended
        "failed": failed,
        "held_s": held_s,  # --hold: seconds the worker was stopped while the jobs came in (0: not held)
        **({"counts": counts} if counts else {}),
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
    ap.add_argument(
        "--counts", action="store_true", help="count Redis commands and Postgres statements per job"
    )
    ap.add_argument("--rate", type=float, help="jobs path: send POST /jobs at this many a second at most")
    ap.add_argument(
        "--hold",
        action="store_true",
        help="jobs and stream paths: stop the worker (SIGSTOP) until all N jobs are accepted, then drain them",
    )
    ap.add_argument(
        "--hold-timeout", type=float, default=60.0, help="with --hold: resume after this many seconds"
    )
    ap.add_argument("--pg-log", type=Path, default=Path("/var/log/postgresql/postgresql-15-main.log"))
    ap.add_argument(
        "--idle", type=float, default=10.0, help="with --counts: seconds of idle stack counted first"
    )
    args = ap.parse_args(argv)
    results = []
    with private_redis() as own_redis:
        settings = bench_settings(redis_url=f"redis://127.0.0.1:{own_redis.port}/0")
        if args.counts:
            log_statements(settings.database_url)
        with local_stack(settings, log_dir=Path("bench/out/logs/job_cpu")) as stack:
            meter = Meter(stack, own_redis.pid, settings.database_url)
            profiler = Profiler(args.profile, meter)
            counter = Counter(own_redis.port, meter, args.pg_log) if args.counts else None
            hold = Hold(stack) if args.hold else None
            if counter and args.idle > 0:
                counter.start()
                time.sleep(args.idle)
                idle = counter.stop()
                print(f"idle stack, {args.idle:.0f} s (rates per second):")
                report_counts(idle, args.idle, unit="second")
                results.append({"path": "idle", "seconds": args.idle, "counts": idle, "round": -1})
            for round_ in range(args.repeat):
                for path in args.paths.split(","):
                    load = os.getloadavg()[0]
                    result = run_path(
                        path,
                        stack,
                        meter,
                        args.jobs,
                        args.max_tokens,
                        profiler,
                        args.long_factor,
                        counter,
                        args.rate,
                        hold,
                        args.hold_timeout,
                    )
                    result["load_before"], result["round"] = load, round_
                    results.append(result)
                    report(result, load)
                    if counter:
                        report_counts(result["counts"], result["jobs"])
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
        f"(target {TARGETS.get(result['path'], '-')}), engine {result['engine_ms_per_job']:.2f} ms/job, "
        f"{result['engine_steps'] / max(result['jobs'], 1):.2f} steps/job "
        f"(width {result['tokens'] / max(result['engine_steps'], 1):.1f}, {result['engine_step_ms']:.2f} ms a step); "
        f"from creation, median ms: "
        + ", ".join(f"{k} {v:.0f}" for k, v in result["latency_ms"].items())
        + f"; per part ms/job: {parts}"
        + (f"; worker held {result['held_s']:.1f} s" if result.get("held_s") else "")
        + (f"; failed: {result['failed']}" if result["failed"] else ""),
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
