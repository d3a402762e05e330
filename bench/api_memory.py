"""Memory of the API's gunicorn processes with the tokenizer loaded once per host (in the arbiter, before the
fork: gunicorn.conf.py's load_tokenizer_before_fork) against once per worker process (API_SHARED_TOKENIZER=false),
alternating, in the same run (issue 42).

A synthetic byte-level BPE tokenizer of a large model's size (`--merges`, default 128,000: Llama 3's vocabulary
is 128,256) is built and saved locally (no download) and served as MODEL. Each round starts gunicorn with
`--api-workers` processes, sends `--requests` POST /tokenize calls (the tokenizer used in every worker), then reads
each process's /proc/<pid>/smaps_rollup: RSS counts shared pages in full in every process, PSS divides each
shared page among the processes that map it, so the sum of PSS over the arbiter and its workers is what the API
costs the host.

    .venv/bin/python bench/api_memory.py --api-workers 4 --rounds 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batching.tokenizer import byte_level_tokenizer  # noqa: E402
from bench.stack import _start, _stop, bench_database, bench_settings, wait_for  # noqa: E402
from tests.conftest import BIN, ROOT, free_port, settings_env  # noqa: E402

FIELDS = ("Rss", "Pss", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty")


def synthetic_tokenizer(directory: Path, merges: int) -> Path:
    """A byte-level BPE with `merges` merges (so its vocabulary is 259 + merges): every pair of byte characters,
    then each two-character token with a byte character after it, until there are `merges`; saved with
    save_pretrained; returns the directory."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    pairs = [(a, b) for a, b in itertools.product(alphabet, alphabet)][:merges]
    for left, right in itertools.product([a + b for a, b in pairs], alphabet):
        if len(pairs) >= merges:
            break
        pairs.append((left, right))
    byte_level_tokenizer(pairs).save_pretrained(directory)
    return directory


def smaps(pid: int) -> dict[str, int]:
    """kB of each FIELDS entry of /proc/<pid>/smaps_rollup."""
    values = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in FIELDS:
            values[name] = int(rest.split()[0])
    return values


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@contextmanager
def api(settings, workers: int, env: dict, log: Path):
    """gunicorn (gunicorn.conf.py) with `workers` processes for `settings`; yields (url, arbiter pid, key)."""
    port = free_port()
    with ExitStack() as cleanup:
        base = {**settings_env(settings), "PYTHONPATH": str(ROOT)}
        key = bench_database(settings, base, cleanup)
        process = _start(
            [
                BIN / "gunicorn",
                "--bind",
                f"127.0.0.1:{port}",
                "--workers",
                str(workers),
                "webapi:create_app()",
            ],
            {**base, "API_ACCESS_LOG": "", **env},
            log,
        )
        cleanup.callback(_stop, process)
        url = f"http://127.0.0.1:{port}"
        wait_for(url + "/healthz", process, log)
        deadline = time.monotonic() + 120
        while len(children(process.pid)) < workers:  # each worker answers once its app is built
            if time.monotonic() > deadline:
                raise RuntimeError(f"{workers} workers not started:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield url, process.pid, key


def measure(settings, workers: int, shared: bool, calls: int, log: Path) -> dict:
    env = {"API_SHARED_TOKENIZER": "true" if shared else "false"}
    with api(settings, workers, env, log) as (url, arbiter, key):
        headers = {"Authorization": f"Bearer {key}"}
        text = "The quick brown fox jumps over the lazy dog. " * 40
        for _ in range(calls):  # new connections: gunicorn spreads them over its workers
            r = requests.post(url + "/tokenize", json={"prompt": text}, headers=headers, timeout=30)
            r.raise_for_status()
        time.sleep(1.0)
        pids = children(arbiter)
        per_worker = [smaps(pid) for pid in pids]
        master = smaps(arbiter)
        warned = "after parallelism has already been used" in log.read_text()
    return {
        "shared": shared,
        "workers": len(pids),
        "arbiter": master,
        "worker_mean": {f: statistics.mean(w[f] for w in per_worker) for f in FIELDS},
        "total_pss_kb": master["Pss"] + sum(w["Pss"] for w in per_worker),
        "total_rss_kb": master["Rss"] + sum(w["Rss"] for w in per_worker),
        "tokenizers_parallelism_warning": warned,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--api-workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--merges", type=int, default=128_000)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("bench/out/api_memory.json"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="genq-bench-tokenizer-") as folder:
        started = time.monotonic()
        model = synthetic_tokenizer(Path(folder), args.merges)
        print(f"tokenizer: {args.merges} merges, {time.monotonic() - started:.1f} s to build", flush=True)
        runs = []
        for round_ in range(args.rounds):
            for shared in (False, True) if round_ % 2 == 0 else (True, False):  # alternate which goes first
                settings = bench_settings(model=str(model))
                log = args.out.parent / f"api_memory_{'shared' if shared else 'each'}.log"
                run = measure(settings, args.api_workers, shared, args.requests, log)
                run["round"] = round_
                runs.append(run)
                print(
                    f"round {round_} {'shared ' if shared else 'each   '} workers={run['workers']} "
                    f"worker PSS {run['worker_mean']['Pss'] / 1024:.1f} MiB RSS {run['worker_mean']['Rss'] / 1024:.1f}"
                    f" MiB private dirty {run['worker_mean']['Private_Dirty'] / 1024:.1f} MiB | arbiter PSS "
                    f"{run['arbiter']['Pss'] / 1024:.1f} MiB | all processes PSS {run['total_pss_kb'] / 1024:.1f} MiB"
                    f"{' | tokenizers parallelism warning' if run['tokenizers_parallelism_warning'] else ''}",
                    flush=True,
                )
    for shared in (False, True):
        totals = [r["total_pss_kb"] / 1024 for r in runs if r["shared"] is shared]
        workers = [r["worker_mean"]["Pss"] / 1024 for r in runs if r["shared"] is shared]
        print(
            f"{'shared (once per host)' if shared else 'each worker loads it  '}: all processes PSS median "
            f"{statistics.median(totals):.1f} MiB, per worker {statistics.median(workers):.1f} MiB"
        )
    args.out.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, indent=1)
    )


if __name__ == "__main__":
    main()
