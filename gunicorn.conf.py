"""gunicorn settings for the API: `gunicorn "webapi:create_app()"` reads this file from the working
directory. Command-line flags (--bind, --workers, ...) override it; so do the variables below.

Worker class: gevent (API_WORKER_CLASS; gunicorn's, as webapi/gevent_worker.py subclasses it). A call that
waits on a job (a streamed or synchronous /v1 completion, GET /jobs/<id>/events, GET /jobs/<id>?wait=)
follows it (webapi/following.py) through the process's token-event hub (webapi/hub.py): under gevent that is a greenlet
waiting on a queue, a few kB, so one process holds thousands (API_WORKER_CONNECTIONS sockets, of which
COMPLETION_SLOTS may wait; beyond, a waiting call answers 429 naming COMPLETION_SLOTS). Measured on the 2-core development machine (bench/job_cpu.py, issue 25; that run
is in bench/RESULTS.md's git history): gevent against gthread (8 threads) for POST /jobs and for streams.
gthread (API_THREADS threads, at most threads - 2 waiting) and sync (no waiting calls: COMPLETION_SLOTS=0,
they answer 503) remain available. 2 processes per core keep the cores busy (2 x cores + 1 measured no
better). A sync or gthread worker is held by a slow client for a whole upload: in front of untrusted or slow
clients, put a buffering proxy (nginx) before it.

Metrics: every worker process counts its own requests, so the processes share their counters through
prometheus_client's multiprocess mode: each writes its values to files in PROMETHEUS_MULTIPROC_DIR
(a fresh temporary directory unless set), and /metrics adds up the files of all of them. The hooks
below empty the directory when gunicorn starts (counts of an earlier run would be added in), mark a
worker's live gauges dead when it exits (its counters stay: what it counted happened), and remove the
directory at exit if it was made here.
"""

import gc
import glob
import os
import shutil
import tempfile
import warnings

from contract.cpus import available_cpus
from jobstore.db import check_deployment_connections, default_api_workers

bind = f"{os.environ.get('API_HOST', '127.0.0.1')}:{os.environ.get('API_PORT', '8000')}"
worker_kind = os.environ.get("API_WORKER_CLASS", "gevent")
# gevent: gunicorn's gevent worker, with one system call per streamed chunk (webapi/gevent_worker.py)
worker_class = {"gevent": "webapi.gevent_worker.GeventWorker"}.get(worker_kind, worker_kind)
# 2 per CPU of the cgroup quota (not the host's), at most 6 (jobstore.db.API_WORKERS_CAP: with DB_POOL_SIZE 10
# each, one host's API, worker and beat fit Postgres' default max_connections)
workers = int(os.environ.get("API_WORKERS") or default_api_workers(available_cpus()))
threads = int(os.environ.get("API_THREADS", 8 if worker_kind == "gthread" else 1))
worker_connections = int(os.environ.get("API_WORKER_CONNECTIONS", 10000))  # gevent: open sockets per process
# calls waiting on a job at once per process (ApiSettings.completion_slots). gevent: most of its connections,
# the rest kept for quick calls; gthread: all threads but two; sync: none (a wait would hold the process)
_slots = {"gevent": max(0, worker_connections - 1000), "gthread": max(0, threads - 2)}
os.environ.setdefault("COMPLETION_SLOTS", str(_slots.get(worker_kind, 0)))
# "" turns the access log off; with LOG_FORMAT=json it is off unless set: the app logs each request as JSON
# (webapi/request_log.py), with its request id, tenant and job
_json_logs = (os.environ.get("LOG_FORMAT") or "text").strip().lower() == "json"
accesslog = os.environ.get("API_ACCESS_LOG", "" if _json_logs else "-") or None
if _json_logs:  # gunicorn's own lines as JSON from its first ("Starting gunicorn"), and the app's (root)
    _handler = {"formatter": "json", "filters": ["context"], "class": "logging.StreamHandler"}
    logconfig_dict = {
        "version": 1,
        "disable_existing_loggers": False,
        "root": {"level": "WARNING", "handlers": ["error_console"]},  # as in text mode: webapi logs INFO
        "loggers": {
            "gunicorn.error": {"level": "INFO", "handlers": ["error_console"], "propagate": False},
            "gunicorn.access": {"level": "INFO", "handlers": ["console"], "propagate": False},
        },
        "filters": {"context": {"()": "contract.log_setup.ContextFilter"}},
        "formatters": {"json": {"()": "contract.log_setup.json_formatter", "process": "api"}},
        "handlers": {
            "console": {**_handler, "stream": "ext://sys.stdout"},
            "error_console": {**_handler, "stream": "ext://sys.stderr"},
        },
    }
# The arbiter imports ssl before a gevent worker patches it (redis, for the start-up checks; transformers, for the
# tokenizer), so gevent warns in each worker that modules holding the unpatched SSLContext would not be
# cooperative: redis.asyncio.connection, anyio's TLS streams and truststore, none of which the API uses on Linux
# (its Redis client is redis-py's synchronous one, and a Hub download's context is ssl.SSLContext looked up when
# made, which is gevent's by then). Only that warning is silenced.
warnings.filterwarnings("ignore", message="Monkey-patching ssl after ssl has already been imported")
preload_app = False  # each worker builds its own app: no database or Redis connection crosses a fork
# (the tokenizer alone is loaded before the fork, once per host: load_tokenizer_before_fork below)
# SIGTERM (a redeploy): each process stops accepting and lets the calls in flight, streams included, go on
# for this long before they are cut (a cut stream resumes with Last-Event-ID). docker-compose.yml's
# stop_grace_period and deploy/kubernetes' terminationGracePeriodSeconds are longer, so that gunicorn, not a
# SIGKILL, ends them (tests/deployment checks the chain)
graceful_timeout = 30

# Set before any worker imports prometheus_client (it picks its storage at import); a config reload
# (SIGHUP) runs this file again and keeps the directory made the first time.
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="genq-api-metrics-")
    os.environ["GENQ_OWN_METRICS_DIR"] = "1"
os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)


def on_starting(server):
    """Check that the deployment's Postgres connections fit the server (a clear error naming the settings
    rather than "too many clients" under load) and Redis' eviction policy (a warning unless noeviction),
    then start every count at zero: files left by an earlier run in the same directory would be added in."""
    check_postgres_connections(server)
    from contract.redis_client import warn_unless_noeviction
    from contract.settings import StoreSettings

    warn_unless_noeviction(StoreSettings.from_env().redis_url, server.log)
    for path in glob.glob(os.path.join(os.environ["PROMETHEUS_MULTIPROC_DIR"], "*.db")):
        os.remove(path)
    load_tokenizer_before_fork(server)


def configured_checkpoints() -> list[str]:
    """The checkpoints of the models this API is configured with (MODEL first, then SERVED_MODELS), each once, at
    most as many as the tokenizer cache holds (batching/tokenizer.py's load_tokenizer): the tokenizers to load
    before the fork. A model only a worker announces (not in SERVED_MODELS) is loaded by each worker on first use."""
    from batching.tokenizer import load_tokenizer
    from contract.settings import ApiSettings

    checkpoints = list(dict.fromkeys(ApiSettings.from_env().configured_models().values()))
    return checkpoints[: load_tokenizer.cache_parameters()["maxsize"]]


def load_tokenizer_before_fork(server):
    """One tokenizer per model per host: the tokenizer of each configured model (configured_checkpoints) is loaded
    here, in gunicorn's arbiter, before it forks its workers, which find them loaded (webapi/prompts.py's cache)
    and share their memory copy-on-write instead of each loading its own (API_SHARED_TOKENIZER=false: each
    worker loads its own, as before). bench/api_memory.py measures it (--models: a fleet's other models).

    Fork-safe as done here: the tokenizer is only loaded, never used, in the arbiter. Its first encode starts
    the Rust tokenizer's thread pool (rayon), and a process forked after that has parallelism turned off
    (TOKENIZERS_PARALLELISM=false, with a warning); each worker encodes first after the fork (post_worker_init).
    No database or Redis connection is made here for the workers (preload_app stays off).

    gc.freeze() moves what is loaded by now out of the collector's sight, so that no worker's collection walks
    (and so writes to, copying) the shared objects."""
    if os.environ.get("API_SHARED_TOKENIZER", "true").strip().lower() in ("0", "false", "no", "off"):
        return
    from webapi.prompts import tokenizer_for

    loaded = []
    for model in configured_checkpoints():
        try:
            tokenizer_for(model)
        except Exception as exc:  # noqa: BLE001 - each worker loads it then (and reports why not)
            server.log.warning("tokenizer of %s not loaded before the workers start: %s", model, exc)
            continue
        loaded.append(model)
    if loaded:
        gc.collect()
        gc.freeze()
        server.log.info("tokenizers loaded once for the workers: %s", ", ".join(loaded))


def check_postgres_connections(server):
    """jobstore.db.check_deployment_connections with this server's process count: TooManyConnections stops
    gunicorn before a worker starts; a database that does not answer yet is only logged (the API answers 503
    and /readyz fails until it does)."""
    from sqlalchemy.exc import OperationalError

    from contract.settings import Settings

    try:
        check = check_deployment_connections(Settings.from_env(), api_workers=server.cfg.workers)
    except OperationalError as exc:
        server.log.warning("Postgres connections not checked, the database does not answer: %s", exc)
        return
    if check is not None:
        server.log.info("%s", check.describe())


def child_exit(server, worker):
    """A worker process ended (stopped, killed, recycled): drop its live gauges; its counters stay."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def on_exit(server):
    if os.environ.get("GENQ_OWN_METRICS_DIR"):
        shutil.rmtree(os.environ["PROMETHEUS_MULTIPROC_DIR"], ignore_errors=True)


def post_worker_init(worker):
    """Load each configured model's tokenizer (the arbiter's, already loaded: load_tokenizer_before_fork) and
    compile its chat template before the first request (a request would otherwise wait for them); then what is
    loaded by now (modules, the app, the tokenizers) lives as long as the process: keep it out of the garbage
    collector's way, so that a full collection walks only the objects of requests."""
    from webapi.prompts import warm_up

    for model in configured_checkpoints():
        try:
            warm_up(model)
        except Exception as exc:  # noqa: BLE001 - the first request that needs it loads it (and reports why not)
            worker.log.warning("tokenizer of %s not loaded ahead of requests: %s", model, exc)
    gc.freeze()
