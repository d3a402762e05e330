"""Settings, read from the environment by pydantic-settings: one object per component.

    StoreSettings   Postgres, Redis and the model's limits: what every process shares (migrations, CLI)
    WorkerSettings  + the engine, the job lifecycle and a worker's intake (workers/celery.py reads it)
    ApiSettings     + the API's limits (webapi.create_app reads it)
    Settings        all of them: a whole stack in one process (tests, benchmarks)

Each field is read from the variable of its upper-case name (DATABASE_URL); unset or empty means the
default, which works on a developer machine with local Postgres and Redis. `.env.example` documents
each variable. A process reads its settings once, with `from_env()`, at its entry point.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict
from typing_extensions import Self

from contract.cpus import available_cpus


class StoreSettings(BaseSettings):
    model_config = SettingsConfigDict(frozen=True, env_ignore_empty=True, extra="forbid")

    # --- where things live
    database_url: str = "postgresql+psycopg://postgres@127.0.0.1:5432/genq"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_key_prefix: str = ""  # prefixes every broker key (isolates test runs sharing one Redis)
    db_connect_timeout: float = 3.0  # seconds to connect to Postgres before giving up (the API answers 503)

    # --- the deployment's Postgres connections, checked against max_connections when the API starts
    # (jobstore.db.check_deployment_connections): API instances (gunicorn masters: hosts, pods) and Celery
    # worker processes sharing this server at most (with autoscaling, the most replicas)
    api_instances: int = Field(1, ge=1)
    worker_instances: int = Field(1, ge=0)
    db_check_connections: bool = True  # false: start without comparing them to the server's max_connections

    # --- logs of every process (contract/log_setup.py): text, or one JSON object a line with request_id,
    # job_id and tenant where known
    log_format: Literal["text", "json"] = "text"
    # OpenTelemetry traces (contract/tracing.py, the `otel` extra); also on when OTEL_EXPORTER_OTLP_ENDPOINT is set
    tracing: bool = False

    # --- the model (read by the API for its limits and by the worker for its engine)
    model: str = "tiny-llama"
    # the name jobs give for MODEL (vLLM's --served-model-name); empty: MODEL itself
    model_name: str = Field("", max_length=200, pattern=r"^[^\s:,=]*$")
    # the fleet's default model, whose queue is plain `generate` (contract/dispatch.py): the name a job without
    # `model` gets. Empty: this process's MODEL_NAME (one model: nothing to set). A worker serving another model
    # than the default sets it to the default's name, so that it takes `generate.<its name>` and no other queue
    default_model: str = Field("", max_length=200, pattern=r"^[^\s:,=]*$")
    # prompt tokens + max_tokens must fit (also the engine's limit); tiny-llama's own is 2048
    max_model_len: int = 2048
    # --- the fleet (contract/fleet.py): each worker announces what it serves this often; a worker not heard
    # from for three of these is taken as gone
    fleet_heartbeat_seconds: float = Field(5.0, gt=0)

    # --- token events (contract/token_events.py): seconds of live output Redis keeps for streaming readers
    events_retention_seconds: float = Field(60.0, gt=0)

    # --- deadlines (issue 44): a job's deadline is at risk with less slack than this; the engine then runs it
    # ahead of its class (batching/admission_order.py), and its status says so (deadline_status)
    deadline_margin_seconds: float = Field(5.0, ge=0)

    def served_model_name(self) -> str:
        """The name jobs give for this process's MODEL: MODEL_NAME, or MODEL itself."""
        return self.model_name or self.model

    def fleet_default_model(self) -> str:
        """The name of the fleet's default model (a job that names none runs on it): DEFAULT_MODEL, or this
        process's own served name."""
        return self.default_model or self.served_model_name()

    @classmethod
    def from_env(cls, **overrides: Any) -> Self:
        """This component's settings from os.environ (overrides win); a bad value names its variable."""
        try:
            return cls(**overrides)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])).upper()}={e.get('input')!r}: {e['msg']}" for e in exc.errors()
            )
            raise ValueError(f"invalid settings: {problems}") from None

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes`, validated like values from the environment (tests, benchmarks)."""
        return self.model_validate({**self.model_dump(), **changes})


class WorkerSettings(StoreSettings):
    # --- engine sizes (None: the engine's own default)
    dtype: str = "auto"
    device: str = "auto"
    # GPUs one worker's engine spans (tensor parallel: heads, MLP and KV cache split over them; rank r on cuda:r)
    tensor_parallel_size: int = Field(1, ge=1)
    max_num_seqs: int | None = None  # None: the engine's default (256)
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    # K/V in the model's dtype (auto, exact) or int8 with a scale per token and KV head: about twice the sequences
    # in the same memory, approximate (docs/models.md#8-bit-kv-cache)
    kv_cache_dtype: Literal["auto", "int8"] = "auto"
    num_device_blocks: int | None = None
    num_host_blocks: int | None = None
    # auto: Triton on CUDA, the C++ kernels on the CPU; or triton, cpu_kernel, torch
    attention_backend: str = "auto"
    cuda_graphs: bool = True  # CUDA: steps replay captured graphs of the forward
    # schedule the next engine step while the device runs this one (None: on with CUDA, off on the CPU)
    async_scheduling: bool | None = None
    # torch threads of the worker's engine process. None: OMP_NUM_THREADS if set, else cores - 1, leaving one
    # core to the worker's job I/O, Postgres and Redis (on 2 cores, 2 threads stepped slower than 1 under load)
    engine_threads: int | None = None
    # order of the waiting jobs of one priority, in the queue's window and in the engine: fcfs (by arrival),
    # predicted (predicted shortest first, by prompt + predicted output tokens, with aging; deadlines at risk
    # first), or preemptive: predicted, and within a class a running job that has made more tokens yields its slot
    # to a waiting one (least attained service, batching/scheduler.py; its KV swapped to host memory, resumed,
    # never recomputed); the worker holds 3x max_num_seqs jobs so that short ones reach the engine
    # (worker_capacity), and shares what it holds beyond slots + reserve with idle workers (worker_base_capacity).
    # Issue 44's workload (160 jobs of one priority, 11 long, 47 with deadlines) through the whole stack, the three
    # policies at once (bench/within_class_stack.py, bench/RESULTS.md), against fcfs: preemptive mean 0.54x and
    # 0.34x, p99 1.22x and 0.94x, throughput 0.98x and 1.11x (2026-11-27 10:32 and 10:40, loaded); predicted 0.70x
    # and 0.61x in the same runs (0.61-0.99x by round earlier), missing issue 44's 0.6x. The default since the
    # service tests (tests/workers, reliability, webapi, contract) pass under it: preemptive
    scheduling_policy: Literal["fcfs", "predicted", "preemptive"] = "preemptive"
    # aging (predicted, preemptive): no job is overtaken by one of its priority arriving more than this many s later
    scheduling_aging_seconds: float = Field(30.0, ge=0)

    # --- the job lifecycle
    lease_seconds: float = 30.0  # a running job whose worker stops renewing is re-dispatched after this
    progress_interval: float = 0.5  # seconds between progress writes (and cancel checks) of a running job
    reconcile_interval: float = 10.0  # seconds between reconciler runs (celery beat)
    enqueue_grace_seconds: float = 10.0  # a queued job not sent to Redis after this is sent by the reconciler
    resend_after_seconds: float = 3600.0  # a queued job sent this long ago, still unclaimed, is sent again
    db_retry_seconds: float = 60.0  # a worker retries a failing database write (with backoff) this long
    job_retention_days: float | None = None  # finished jobs older than this are deleted; None: kept forever

    # --- a worker's intake (workers/intake.py)
    # jobs held beyond max_num_seqs; None: max(2, max_num_seqs // 8), or 2 x max_num_seqs under preemptive
    worker_reserve: int | None = None
    queue_watch_interval: float = 0.05  # seconds between looks at Redis for more urgent work, while full
    # messages a worker with room takes from Redis at once (one BLMPOP, one claim statement)
    intake_pull: int = Field(64, ge=1)
    max_handbacks: int = 3  # a job is handed back for more urgent work at most this often

    # --- a worker's metrics (workers/metrics.py)
    worker_metrics_port: int = 9808  # each worker process serves Prometheus metrics here; 0 turns them off
    worker_metrics_address: str = "0.0.0.0"  # the address that server listens on

    def engine_options(self) -> dict:
        """Keyword arguments for batching.EngineConfig; unset sizes are left to the engine."""
        options = dict(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            tensor_parallel_size=self.tensor_parallel_size,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            num_device_blocks=self.num_device_blocks,
            num_host_blocks=self.num_host_blocks,
            attention_backend=self.attention_backend,
            cuda_graphs=self.cuda_graphs,
            async_scheduling=self.async_scheduling,
            scheduling_policy=self.scheduling_policy,
            aging_seconds=self.scheduling_aging_seconds,
            deadline_margin_seconds=self.deadline_margin_seconds,
        )
        return {k: v for k, v in options.items() if v is not None}

    def engine_thread_count(self) -> int | None:
        """torch threads for the worker's engine process; None leaves torch's own default (OMP_NUM_THREADS)."""
        if self.engine_threads is not None:
            return self.engine_threads
        if os.environ.get("OMP_NUM_THREADS"):  # torch's own variable, read by torch itself
            return None
        return max(1, available_cpus() - 1)

    def worker_capacity(self, max_num_seqs: int) -> int:
        """Jobs a worker holds at most: what its engine runs at once, plus a reserve waiting in the engine. Under
        preemptive the reserve is twice the slots: the engine's running jobs yield only to jobs it holds, and the
        ideal worker (bench/within_class_model.py) got the whole gain holding 3x its slots (0.43x fcfs's mean
        latency, 0.79x holding 8 + 2)."""
        if self.worker_reserve is not None:
            reserve = self.worker_reserve
        elif self.scheduling_policy == "preemptive":
            reserve = 2 * max_num_seqs
        else:
            reserve = max(2, max_num_seqs // 8)
        return max_num_seqs + reserve

    def worker_base_capacity(self, max_num_seqs: int) -> int:
        """Jobs a worker takes as fast as they come: its slots and the small reserve (max(2, max_num_seqs // 8)),
        at most worker_capacity. Beyond it (the reserve preemptive adds) a worker takes only messages no idle worker
        waits for, and hands held jobs that are not running back to a worker that finds the queue empty
        (workers/intake.py): several workers on one queue share its work as with a small reserve."""
        return min(self.worker_capacity(max_num_seqs), max_num_seqs + max(2, max_num_seqs // 8))


class ApiSettings(StoreSettings):
    # --- the API
    # other names a /v1 request's `model` may give for MODEL (comma-separated); any other name answers 404
    # model_not_found. Replies name MODEL.
    model_aliases: str = ""
    # models the fleet serves besides MODEL (comma-separated `name=model` pairs, `model` a Hugging Face id or a
    # path; or a bare name when both are the same): a job for one is accepted while no worker of it is live, and
    # waits. Any model a live worker announces is served too (webapi/fleet.py)
    served_models: str = ""
    max_body_bytes: int = 1 << 20  # larger request bodies answer 413
    max_queued_per_tenant: int = 1000  # a tenant with this many queued jobs gets 429 on POST /jobs
    max_queued_jobs: int = 20000  # all tenants together: beyond this many queued jobs, POST /jobs answers 429
    rate_limit: str = "50/second;2000/minute"  # per API key, Flask-Limiter syntax; counters live in Redis
    auth_cache_seconds: float = 5.0  # an API process trusts a key it looked up for this long (revocation lag)
    # /metrics' per-tenant gauges: this many tenants by name (the busiest today), the rest as "other"; 0: none
    usage_metrics_tenants: int = Field(20, ge=0)
    admin_key: str = ""  # opens the admin page (/admin); empty: the page answers 404
    batch_priority: int = (
        8  # priority of a batch's jobs unless its metadata.priority sets one (0 most urgent)
    )
    max_batch_requests: int = 50000  # lines (requests) a batch input file may hold; OpenAI's limit
    max_file_bytes: int = 209715200  # bytes a batch input file may hold (200 MiB); OpenAI's limit
    # seconds a batch has to complete: its completion_window, "24h" (the one window OpenAI and genq accept),
    # means this long; a batch not done by then is ended `expired` (tests shorten it)
    batch_window_seconds: float = Field(24 * 3600.0, gt=0)
    # POST /v1/chat/completions and /v1/completions wait for their job in the API process (webapi/completions.py):
    # at most this many at once per process (beyond: 429 + Retry-After; 0 turns them off, answering 503).
    # gunicorn.conf.py sets it from its threads (gthread: threads - 2; sync: 0, a wait would hold the process)
    completion_slots: int = Field(4, ge=0)
    completion_timeout_seconds: float = Field(600.0, gt=0)  # a completion not done by then is cancelled (503)
    # a call following a job (a stream, ?wait) reads its row again after this long without an event of it
    # (doubling while quiet, up to 6x): a last resort, lost events are announced (contract/token_events.py's LOST_FIELD)
    events_resync_seconds: float = Field(30.0, gt=0)
    # Postgres connections each API process keeps (and uses at most): a burst of calls waits its turn for one
    # rather than opening and closing connections of its own (each a Postgres backend started and stopped)
    db_pool_size: int = Field(10, ge=1)
    log_level: str = "INFO"

    def alias_names(self) -> frozenset[str]:
        """MODEL_ALIASES: other names for the fleet's default model."""
        return frozenset(name.strip() for name in self.model_aliases.split(",") if name.strip())

    def configured_models(self) -> dict[str, str]:
        """SERVED_MODELS as {name: model}, with the default model (MODEL under its served name) first."""
        configured = {self.fleet_default_model(): self.model}
        for entry in filter(None, (part.strip() for part in self.served_models.split(","))):
            name, _, model = entry.partition("=")
            configured.setdefault(name.strip(), model.strip() or name.strip())
        return configured


class Settings(WorkerSettings, ApiSettings):
    """Every component's settings in one object: a whole stack in one process (tests, benchmarks)."""
