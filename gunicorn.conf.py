"""gunicorn settings for the API: `gunicorn "webapi:create_app()"` reads this file from the working
directory. Command-line flags (--bind, --workers, ...) override it; so do the variables below.

Measured on the 2-core development machine (bench/RESULTS.md, issue 6): sync workers accept ~20% more
POST /jobs per second than threaded ones (each request is Python work between short waits on Postgres
and Redis, so threads only add GIL contention), and 2 processes per core keep the cores busy (2 x cores + 1 measured no better).
A sync worker is held by a slow client for the whole upload: in front of untrusted or slow clients,
put a buffering proxy (nginx) before it, or set API_WORKER_CLASS=gthread.
"""

import gc
import os

from jobstore.cpus import available_cpus

bind = f"{os.environ.get('API_HOST', '127.0.0.1')}:{os.environ.get('API_PORT', '8000')}"
worker_class = os.environ.get("API_WORKER_CLASS", "sync")
workers = int(os.environ.get("API_WORKERS", 2 * available_cpus()))  # CPUs of the cgroup quota, not the host
threads = int(os.environ.get("API_THREADS", 4 if worker_class == "gthread" else 1))
accesslog = os.environ.get("API_ACCESS_LOG", "-") or None  # "" turns the access log off
preload_app = False  # each worker builds its own app: no database or Redis connection crosses a fork


def post_worker_init(worker):
    """What is loaded by now (modules, the app) lives as long as the process: keep it out of the garbage
    collector's way, so that a full collection walks only the objects of requests."""
    gc.freeze()
