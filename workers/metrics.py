"""Prometheus metrics of a worker process: its engine and the jobs it runs.

Served on WORKER_METRICS_PORT (default 9808; 0 turns it off) by prometheus_client's own HTTP thread,
started once per worker process when Celery's worker_init fires, so it answers while the `threads`
pool runs jobs. The engine host's reader thread calls `observe_steps()` with every report from
the engine process; the job book and intake call `job_done()` when the worker's hold on a job ends. Only this
module knows the metric names. Every sample it serves carries the label `model`: the served name of the model
this worker runs (MODEL_NAME, or MODEL), one value a process, so a fleet's dashboards split by model (and
summing over it gives what one model's stack showed before).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from datetime import datetime, timezone

from celery.signals import worker_init
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric

from workers.outcomes import Outcome
from workers.weighted_histogram import WeightedHistogram

log = logging.getLogger(__name__)

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
_FAST = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

RUNNING = Gauge("genq_engine_running_sequences", "Sequences in the running batch")
WAITING = Gauge("genq_engine_waiting_sequences", "Sequences waiting to start in the engine")
SWAPPED = Gauge("genq_engine_swapped_sequences", "Preempted sequences whose KV cache is in host memory")
DEVICE_KV = Gauge("genq_engine_device_kv_usage", "Fraction of device KV cache blocks in use")
HOST_KV = Gauge("genq_engine_host_kv_usage", "Fraction of host (swap) KV cache blocks in use")
STEP_TOKENS = Gauge("genq_engine_step_tokens", "Tokens scheduled in the last engine step")
STEP_SEQS = Gauge("genq_engine_step_sequences", "Sequences in the last engine step")
STEP_TIME = Histogram("genq_engine_step_seconds", "Time of one engine step", buckets=_FAST)
STEPS = Counter("genq_engine_steps_total", "Engine steps")
PROMPT_TOKENS = Counter(
    "genq_engine_prompt_tokens_total", "Prompt tokens computed (prefill, recompute included)"
)
GENERATED = Counter("genq_engine_generated_tokens_total", "Tokens generated")
PREEMPTIONS = Counter(
    "genq_engine_preemptions_total", "Sequences preempted by a more urgent one or for KV space"
)
SWAPPED_OUT = Counter("genq_engine_swapped_out_blocks_total", "KV blocks copied device -> host")
SWAPPED_IN = Counter("genq_engine_swapped_in_blocks_total", "KV blocks copied host -> device")
RECOMPUTED = Counter(
    "genq_engine_recomputed_tokens_total", "Tokens recomputed after a preemption without swap"
)
PREFIX_QUERIED = Counter(
    "genq_engine_prefix_cache_queried_tokens_total",
    "Tokens of sequences that started from scratch (looked up in the prefix cache)",
)
PREFIX_HITS = Counter(
    "genq_engine_prefix_cache_hit_tokens_total", "Of those, tokens whose KV came from the prefix cache"
)
PREFIX_HIT_RATE = Gauge(
    "genq_engine_prefix_cache_hit_rate", "Prefix cache hit tokens / queried tokens since the engine started"
)
PREFIX_CACHED_BLOCKS = Gauge(
    "genq_engine_prefix_cache_device_blocks", "Device KV blocks holding cached KV (in use or free)"
)
PREFIX_EVICTIONS = Counter(
    "genq_engine_prefix_cache_evictions_total", "Cached device KV blocks handed out for other KV"
)
PREFIX_HOST_BLOCKS = Gauge(
    "genq_engine_prefix_cache_host_blocks", "Host KV blocks holding cached KV evicted from the device"
)
PREFIX_OFFLOADED = Counter(
    "genq_engine_prefix_cache_offloaded_blocks_total", "Evicted device blocks whose KV the host pool kept"
)
PREFIX_HOST_HITS = Counter(
    "genq_engine_prefix_cache_host_hit_tokens_total", "Hit tokens whose KV was copied back from the host"
)
ATTENTION_PATH = Gauge(
    "genq_engine_attention_path",
    "1 for the attention path the engine runs (triton, cpu_kernel; torch is the slower fallback)",
    ["path"],
)
ABORTED = Counter("genq_engine_aborted_requests_total", "Requests aborted in the engine (cancel, lost lease)")

TTFT = Histogram("genq_job_ttft_seconds", "Job submission to its first token", ["priority"], buckets=_LATENCY)
TBT = WeightedHistogram(  # observed a step at a time: a step's equal gaps in one call
    "genq_job_time_between_tokens_seconds",
    "Time between two tokens of a request, per token",
    "priority",
    buckets=_FAST,
)
LATENCY = Histogram(
    "genq_job_latency_seconds",
    "Job submission to its final state (succeeded or failed)",
    ["priority"],
    buckets=_LATENCY,
)
JOBS = Counter(
    "genq_worker_jobs_total",
    "Jobs this worker stopped holding, by outcome (workers/outcomes.py: "
    "succeeded, failed, stopped = cancelled or lease lost, preempted = handed back for a more urgent "
    "job, handed_back / left = worker shutting down, engine_lost = handed back when the engine process died, discarded = finished after losing the lease, "
    "dropped = message for a job not queued, declined = message sent back while full)",
    ["priority", "outcome"],
)
HELD = Gauge("genq_worker_held_jobs", "Jobs this worker holds (in its engine)")
CAPACITY = Gauge(
    "genq_worker_capacity", "Jobs this worker holds at most before it only takes more urgent ones"
)
FAILURES = Counter(
    "genq_job_failures_total", "Jobs failed by this worker, by error code", ["priority", "code"]
)
DEADLINES = Counter(
    "genq_job_deadlines_total",
    "Jobs with a deadline this worker ended, by whether they met it (met: succeeded by the deadline; missed: "
    "succeeded later, or failed), as their deadline_status says",
    ["model", "outcome"],
)

# engine counters already seen, so Prometheus counters advance by the difference (reader thread only)
_seen: dict[str, float] = {}
# request id -> time of its last token, for time-between-tokens (the engine host's reader thread only)
_last_token: dict[str, float] = {}
_server_lock = threading.Lock()
_server_started = False


def observe_steps(stats: dict, step_times: list[float], tokens) -> None:
    """After one report of the engine (one or more steps): gauges and counters from engine.stats() after
    the last, each step's time, and token timings from `tokens`, one (request id, priority, tokens made
    since its last report, finished) per request that changed."""
    RUNNING.set(stats["num_running"])
    WAITING.set(stats["num_waiting"])
    SWAPPED.set(stats["num_swapped"])
    DEVICE_KV.set(stats["device_kv_usage"])
    HOST_KV.set(stats["host_kv_usage"])
    STEP_TOKENS.set(stats["last_step_num_tokens"])
    STEP_SEQS.set(stats["last_step_num_seqs"])
    PREFIX_HIT_RATE.set(stats["prefix_cache_hit_rate"])
    PREFIX_CACHED_BLOCKS.set(stats["num_cached_device_blocks"])
    PREFIX_HOST_BLOCKS.set(stats["num_cached_host_blocks"])
    for seconds in step_times:
        STEP_TIME.observe(seconds)
    for counter, key in (
        (STEPS, "num_steps"),
        (PROMPT_TOKENS, "num_prompt_tokens_computed"),
        (GENERATED, "num_generated_tokens"),
        (PREEMPTIONS, "num_preemptions"),
        (SWAPPED_OUT, "num_blocks_swapped_out"),
        (SWAPPED_IN, "num_blocks_swapped_in"),
        (RECOMPUTED, "num_recomputed_tokens"),
        (ABORTED, "num_aborted"),
        (PREFIX_QUERIED, "num_prefix_cache_queried_tokens"),
        (PREFIX_HITS, "num_prefix_cache_hit_tokens"),
        (PREFIX_EVICTIONS, "num_prefix_cache_evictions"),
        (PREFIX_OFFLOADED, "num_prefix_cache_offloaded_blocks"),
        (PREFIX_HOST_HITS, "num_prefix_cache_host_hit_tokens"),
    ):
        value = stats[key]
        if value > _seen.get(key, 0):
            counter.inc(value - _seen.get(key, 0))
        _seen[key] = value
    _observe_token_gaps(tokens)


def _observe_token_gaps(tokens) -> None:
    """Each request's tokens of this report: the time since its previous token, split evenly among them.
    Requests whose previous token came at the same time (nearly all: the step before) are counted together."""
    now = time.monotonic()
    gaps: dict[tuple[int, float, int], int] = {}  # (priority, previous token's time, tokens made) -> requests
    for request_id, priority, made, finished in tokens:
        last = _last_token.pop(request_id, None)
        if last is not None and made:
            key = (priority, last, made)
            gaps[key] = gaps.get(key, 0) + 1
        if not finished:
            _last_token[request_id] = now if made or last is None else last
    for (priority, last, made), requests in gaps.items():
        TBT.observe(str(priority), (now - last) / made, made * requests)
    if len(_last_token) > 10_000:  # requests aborted without a final output; forget the stalest
        for request_id, _ in sorted(_last_token.items(), key=lambda kv: kv[1])[:5_000]:
            del _last_token[request_id]


def job_done(job, first_token_at: datetime | None, outcome: Outcome, error_code: str | None = None) -> None:
    """When a worker's hold on a job ends: latency, TTFT (from its first token in this hold, if any) and
    outcome per priority."""
    priority = str(job.priority)
    now = datetime.now(timezone.utc)
    if outcome in (Outcome.SUCCEEDED, Outcome.FAILED):
        LATENCY.labels(priority).observe((now - job.created_at).total_seconds())
    if first_token_at is not None and not job.output_token_ids:  # a resumed job's first token is not its TTFT
        TTFT.labels(priority).observe((first_token_at - job.created_at).total_seconds())
    JOBS.labels(priority, outcome.value).inc()
    if outcome is Outcome.FAILED:
        FAILURES.labels(priority, error_code or "unknown").inc()
    deadline = getattr(job, "deadline", None)  # a job row has one (None: no deadline)
    if deadline is not None and outcome in (Outcome.SUCCEEDED, Outcome.FAILED):
        met = outcome is Outcome.SUCCEEDED and now <= deadline
        DEADLINES.labels(_served_model(), "met" if met else "missed").inc()


@functools.cache
def _served_model() -> str:
    """The served name of the model this worker runs (a job's model: a worker serves one)."""
    from workers.celery import settings  # the worker's settings, read once

    return settings.served_model_name()


def set_attention_path(path: str) -> None:
    for known in ("triton", "cpu_kernel", "torch"):
        ATTENTION_PATH.labels(known).set(1 if known == path else 0)


def set_intake(held: int, capacity: int) -> None:
    HELD.set(held)
    CAPACITY.set(capacity)


class ModelLabelled:
    """A registry's metrics with the label model=<name> added to every sample: the constant label the worker's
    endpoint serves them with (prometheus_client has no constant labels of its own)."""

    def __init__(self, model: str, registry: CollectorRegistry = REGISTRY):
        self.model, self.registry = model, registry

    def collect(self):
        for family in self.registry.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [s._replace(labels={"model": self.model, **s.labels}) for s in family.samples]
            yield labelled


def model_registry(model: str) -> CollectorRegistry:
    """What the worker's endpoint serves: this process's metrics, each sample labelled with `model`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ModelLabelled(model))
    return registry


def start_server(port: int | None = None) -> int | None:
    """Serve this process's metrics over HTTP once; returns the port, or None if off or the port is taken."""
    global _server_started
    from workers.celery import settings  # the worker's settings, read once

    port = settings.worker_metrics_port if port is None else port
    with _server_lock:
        if _server_started or port == 0:
            return None
        try:
            start_http_server(
                port,
                addr=settings.worker_metrics_address,
                registry=model_registry(settings.served_model_name()),
            )
        except OSError as exc:
            log.error(
                "worker metrics NOT served: port %d is unavailable (%s); another worker on this host? "
                "give each worker its own WORKER_METRICS_PORT (0 turns metrics off)",
                port,
                exc,
            )
            return None
        _server_started = True
    log.info("worker metrics on http://0.0.0.0:%d/metrics", port)
    return port


@worker_init.connect
def _serve_metrics(**_) -> None:
    start_server()
