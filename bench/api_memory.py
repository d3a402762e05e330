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

A fleet's other models (issue 40): `--models N` serves N - 1 more models (SERVED_MODELS, each its own synthetic
tokenizer of the same size in a directory of its own), the calls name each model in turn, so every worker uses
every tokenizer. `--baseline-config PATH` adds a third way, sharing on under another gunicorn config file (an
earlier gunicorn.conf.py, `git show REV:gunicorn.conf.py > PATH`), against the same code otherwise. Each way's
start-up is timed too: from gunicorn's start until /healthz answers and every worker is forked.

    .venv/bin/python bench/api_memory.py --models 3 --baseline-config /tmp/gunicorn.before.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
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
def api(settings, workers: int, env: dict, log: Path, config: Path | None = None):
    """gunicorn (`config`, gunicorn.conf.py by default) with `workers` processes for `settings`; yields (url,
    arbiter pid, key, seconds from gunicorn's start until /healthz answers and every worker is forked)."""
    port = free_port()
    with ExitStack() as cleanup:
        base = {**settings_env(settings), "PYTHONPATH": str(ROOT)}
        key = bench_database(settings, base, cleanup)
        started = time.monotonic()
        process = _start(
            [
                BIN / "gunicorn",
                *(["--config", config] if config is not None else []),
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
        yield url, process.pid, key, time.monotonic() - started


def measure(
    settings, workers: int, way: str, calls: int, log: Path, names: list[str], config: Path | None
) -> dict:
    shared = way != "each"
    env = {"API_SHARED_TOKENIZER": "true" if shared else "false"}
    with api(settings, workers, env, log, config) as (url, arbiter, key, startup):
        headers = {"Authorization": f"Bearer {key}"}
        text = "The quick brown fox jumps over the lazy dog. " * 40
        for i in range(calls):  # new connections: gunicorn spreads them over its workers
            body = {"prompt": text, "model": names[i % len(names)]}
            r = requests.post(url + "/tokenize", json=body, headers=headers, timeout=30)
            r.raise_for_status()
        time.sleep(1.0)
        pids = children(arbiter)
        per_worker = [smaps(pid) for pid in pids]
        master = smaps(arbiter)
        warned = "after parallelism has already been used" in log.read_text()
    return {
        "way": way,
        "shared": shared,
        "workers": len(pids),
        "startup_s": startup,
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
    parser.add_argument("--models", type=int, default=1, help="served models, each its own tokenizer")
    parser.add_argument(
        "--baseline-config", type=Path, help="a third way: sharing on under this gunicorn config"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/out/api_memory.json"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    configs: dict[str, Path | None] = {"each": None, "shared": None}
    if args.baseline_config is not None:
        configs["baseline"] = args.baseline_config.resolve()
    with tempfile.TemporaryDirectory(prefix="genq-bench-tokenizer-") as folder:
        started = time.monotonic()
        models = [synthetic_tokenizer(Path(folder) / "m0", args.merges)]
        for i in range(1, args.models):  # the same files in a directory of its own: loaded on their own
            models.append(Path(shutil.copytree(models[0], Path(folder) / f"m{i}")))
        print(
            f"{args.models} tokenizers: {args.merges} merges, {time.monotonic() - started:.1f} s to build",
            flush=True,
        )
        names = ["m0", *(f"m{i}" for i in range(1, args.models))]
        served = ",".join(
            f"m{i}={model}" for i, model in enumerate(models) if i
        )  # m0 is MODEL (MODEL_NAME m0)
        runs = []
        for round_ in range(args.rounds):
            ways = list(configs) if round_ % 2 == 0 else list(reversed(configs))  # alternate which goes first
            for way in ways:
                settings = bench_settings(model=str(models[0]), model_name="m0", served_models=served)
                log = args.out.parent / f"api_memory_{way}.log"
                run = measure(settings, args.api_workers, way, args.requests, log, names, configs[way])
                run["round"] = round_
                runs.append(run)
                print(
                    f"round {round_} {way:8} workers={run['workers']} start-up {run['startup_s']:.1f} s | "
                    f"worker PSS {run['worker_mean']['Pss'] / 1024:.1f} MiB RSS {run['worker_mean']['Rss'] / 1024:.1f}"
                    f" MiB private dirty {run['worker_mean']['Private_Dirty'] / 1024:.1f} MiB | arbiter PSS "
                    f"{run['arbiter']['Pss'] / 1024:.1f} MiB | all processes PSS {run['total_pss_kb'] / 1024:.1f} MiB"
                    f"{' | tokenizers parallelism warning' if run['tokenizers_parallelism_warning'] else ''}",
                    flush=True,
                )
    for way in configs:
        totals = [r["total_pss_kb"] / 1024 for r in runs if r["way"] == way]
        workers = [r["worker_mean"]["Pss"] / 1024 for r in runs if r["way"] == way]
        startups = [r["startup_s"] for r in runs if r["way"] == way]
        print(
            f"{way:8}: all processes PSS median {statistics.median(totals):.1f} MiB, per worker "
            f"{statistics.median(workers):.1f} MiB, start-up median {statistics.median(startups):.1f} s"
        )
    args.out.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, indent=1)
    )


if __name__ == "__main__":
    main()
