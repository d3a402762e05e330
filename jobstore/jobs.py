"""Job state transitions, each one atomic SQL statement on the job row.

    create ─▶ queued ──claim──▶ running ──finish──▶ succeeded
                ▲                │  │ └───fail────▶ failed
                │                │  ├─(lease expired: requeue_expired)─▶ queued
                │                │  └─(worker shutting down: release_job)─▶ queued
                └─────cancel─────┴──────cancel────▶ cancelled

A worker changes a running job only while it holds the lease (`worker_id` matches); every write it
makes renews the lease. When a call returns False the job is no longer the worker's (cancelled, or
its lease expired and the job went back to the queue), and the worker must stop working on it.
The caller owns the transaction: these functions never commit. The worker runs them on an autocommit
connection (each one statement); the reconciler in a transaction.
"""

from __future__ import annotations

import functools
import hashlib
import json
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import (
    ColumnElement,
    Connection,
    Integer,
    String,
    bindparam,
    delete,
    func,
    inspect,
    literal,
    literal_column,
    or_,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB, insert
from sqlalchemy.orm import Session

from jobstore.job_events import EventKind
from jobstore.models import Batch, BatchStatus, Job, JobStatus

ACTIVE = (JobStatus.QUEUED, JobStatus.RUNNING)
FINISHED = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)
JOBS = Job.__table__
_ATTRIBUTE = {
    attr.columns[0].key: attr.key for attr in inspect(Job).column_attrs
}  # "metadata" -> "metadata_"
RECONCILER_LOCK = 0x67656E71  # pg advisory lock id ("genq") taken by the reconciler
# pg advisory locks (int4, int4) of POST /jobs near a tenant's cap: (this, the tenant's key); the one-bigint
# locks (the reconciler's) are another key space
TENANT_CAP_LOCKS = 0x6A6F6273  # "jobs"


class IdempotencyConflict(Exception):
    """The Idempotency-Key was used before by the same tenant with a different request."""


def request_fingerprint(request: Mapping) -> str:
    """A stable hash of a validated request body, to compare requests sharing an Idempotency-Key."""
    return hashlib.sha256(json.dumps(request, sort_keys=True, default=str).encode()).hexdigest()


def create_job(
    db: Session | Connection,
    tenant_id: uuid.UUID,
    request: Mapping,
    *,
    prompt_tokens: int | None = None,
    idempotency_key: str | None = None,
    max_queued: int | None = None,
    traceparent: str | None = None,
) -> tuple[Job | None, bool]:
    """Insert a queued job from a validated request, in one statement; returns (job, created).

    - With `max_queued`, the job is inserted only while the tenant has fewer queued jobs; at the cap
      this returns (None, False). The count is inside the insert, and the insert first takes the
      tenant's transaction-level advisory lock, so submissions racing each other are counted one after
      another: `db` must then be in a transaction (the lock is held until it commits; on an autocommit
      connection the next submission's count could miss this insert).
    - With an `idempotency_key` this tenant used before, returns that job (created=False), or raises
      IdempotencyConflict when its request differed. A known key wins over the cap.

    - `traceparent`: the W3C traceparent of the request creating it (contract/tracing.py), kept on the row so
      that every worker's spans of the job join that request's trace.

    `db` may be a Session or a Core Connection (the API uses an autocommit connection: no BEGIN, no
    COMMIT round trip). The returned Job is a plain object, attached to no session.
    """
    from contract.requests import job_columns

    values = dict(
        job_columns(request),
        tenant_id=tenant_id,
        status=JobStatus.QUEUED,
        prompt_tokens=prompt_tokens,
        idempotency_key=idempotency_key,
        request_hash=request_fingerprint(request) if idempotency_key else None,
    )
    if traceparent is not None:  # a column named only when set: the statement of an untraced API is unchanged
        values["traceparent"] = traceparent
    if max_queued is not None:
        values["max_queued"] = max_queued
        tenant_key = int.from_bytes(
            tenant_id.bytes[:4], "big", signed=True
        )  # tenants sharing one: serialized
        db.execute(select(func.pg_advisory_xact_lock(TENANT_CAP_LOCKS, tenant_key)))
    row = db.execute(_insert_job(tuple(values)), values).one_or_none()
    if row is not None:
        return _job_from_row(row), True
    existing = job_for_key(db, tenant_id, idempotency_key) if idempotency_key else None
    if existing is None:
        if max_queued is None:
            raise AssertionError("an insert without a cap or a key returned no row")
        return None, False  # the tenant is at its cap
    if existing.request_hash != values["request_hash"]:
        raise IdempotencyConflict(idempotency_key)
    return existing, False


@functools.lru_cache(maxsize=16)
def _insert_job(names: tuple[str, ...]):
    """The INSERT for a job with these column values (and "max_queued": the cap), built once per shape.

    Capped: INSERT INTO jobs (...) SELECT :values... WHERE (the tenant's queued jobs) < :max_queued.
    An Idempotency-Key already used inserts nothing (the partial unique index; NULL keys never clash).
    """
    columns = [name for name in names if name != "max_queued"]
    if "max_queued" in names:
        queued = (
            select(func.count())
            .select_from(JOBS)
            .where(
                JOBS.c.tenant_id == bindparam("tenant_id"),
                JOBS.c.status == JobStatus.QUEUED,
                JOBS.c.batch_id.is_(None),  # a batch's jobs have limits of their own
            )
            .scalar_subquery()
        )
        values = select(*[bindparam(name, type_=JOBS.c[name].type) for name in columns])
        stmt = insert(JOBS).from_select(columns, values.where(queued < bindparam("max_queued")))
    else:
        stmt = insert(JOBS).values({name: bindparam(name, type_=JOBS.c[name].type) for name in columns})
    return stmt.on_conflict_do_nothing(
        index_elements=["tenant_id", "idempotency_key"], index_where=text("idempotency_key IS NOT NULL")
    ).returning(*JOBS.c)


def check_job_row(job: Job, max_model_len: int | None = None) -> None:
    """ValueError unless the stored request is one the API could have accepted (JobCreate, and token ids plus
    max_tokens within `max_model_len`; a text prompt's length is checked by the engine, which tokenizes it)."""
    from pydantic import ValidationError

    from contract.requests import JobCreate, request_fields

    if job.prompt is not None:
        try:
            job.prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("prompt: the stored bytes are not valid UTF-8") from None
    fields = request_fields(job)
    fields["stop"] = list(fields["stop"] or [])
    if fields["input_ids"] is not None:
        fields["input_ids"] = list(fields["input_ids"])
    try:
        JobCreate.model_validate(fields)
    except ValidationError as exc:
        raise ValueError(
            "; ".join(f"{'.'.join(map(str, e['loc'])) or 'job'}: {e['msg']}" for e in exc.errors())
        ) from None
    if not isinstance(job.output_token_ids, list) or len(job.output_token_ids) > job.max_tokens:
        raise ValueError("output_token_ids: more tokens than max_tokens")
    if max_model_len is not None and job.max_tokens + len(job.input_ids or ()) > max_model_len:
        raise ValueError(
            f"max_tokens: {len(job.input_ids or ())} prompt tokens + max_tokens {job.max_tokens} > "
            f"max_model_len {max_model_len}"
        )


def job_for_key(db: Session | Connection, tenant_id: uuid.UUID, idempotency_key: str) -> Job | None:
    """The tenant's job created with this Idempotency-Key, if any (a plain Job, attached to no session)."""
    row = db.execute(
        select(*JOBS.c).where(JOBS.c.tenant_id == tenant_id, JOBS.c.idempotency_key == idempotency_key)
    ).one_or_none()
    return None if row is None else _job_from_row(row)


def get_job(db: Session | Connection, job_id: uuid.UUID, tenant_id: uuid.UUID | None = None) -> Job | None:
    """The job as stored now (a plain Job, attached to no session), or None when it does not exist or
    belongs to another tenant."""
    stmt = select(*JOBS.c).where(JOBS.c.id == job_id)
    if tenant_id is not None:
        stmt = stmt.where(JOBS.c.tenant_id == tenant_id)
    row = db.execute(stmt).one_or_none()
    return None if row is None else _job_from_row(row)


def list_jobs(
    session: Session,
    tenant_id: uuid.UUID,
    *,
    status: JobStatus | None = None,
    limit: int = 20,
    before: tuple[datetime, uuid.UUID] | None = None,
) -> list[Job]:
    """A tenant's jobs, newest first, starting after the (created_at, id) position `before`."""
    stmt = select(Job).where(Job.tenant_id == tenant_id)
    if status is not None:
        stmt = stmt.where(Job.status == status)
    if before is not None:
        stmt = stmt.where(tuple_(Job.created_at, Job.id) < tuple_(*before))
    return list(session.scalars(stmt.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)))


def jobs_ended_after(
    db: Session | Connection, tenant_id: uuid.UUID, after: tuple[datetime, uuid.UUID], limit: int
) -> list[Job]:
    """A tenant's jobs that ended after the (finished_at, id) position `after`, in that order (plain Jobs):
    GET /jobs/ended, what a client following many jobs reads instead of a GET per job."""
    stmt = (
        select(*JOBS.c)
        .where(
            JOBS.c.tenant_id == tenant_id,
            JOBS.c.finished_at.is_not(None),
            tuple_(JOBS.c.finished_at, JOBS.c.id) > tuple_(*after),
        )
        .order_by(JOBS.c.finished_at, JOBS.c.id)
        .limit(limit)
    )
    return [_job_from_row(row) for row in db.execute(stmt)]


def mark_enqueued(db: Session | Connection, job_ids: Sequence[uuid.UUID]) -> None:
    """Record that a message for these queued jobs went to Redis."""
    db.execute(
        update(JOBS)
        .where(JOBS.c.id.in_(job_ids), JOBS.c.status == JobStatus.QUEUED)
        .values(enqueued_at=func.now())
    )


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The model a worker serves, as a claim checks it: its served name, and whether it is the fleet's default
    (whose jobs include the rows that name no model)."""

    name: str
    is_default: bool


def claim_job(
    db: Session | Connection,
    job_id: uuid.UUID,
    worker_id: str,
    lease_seconds: float,
    model: ServedModel | None = None,
) -> Job | None:
    """queued → running for `worker_id` with a fresh lease; the job (a plain Job), or None if it is not queued
    (or, with `model`, is another model's: a message filed under the wrong queue never runs on the wrong model).
    The one-job case of claim_jobs (the same statement)."""
    claimed = claim_jobs(db, [(job_id, worker_id)], lease_seconds, model)
    return claimed[0] if claimed else None


def claim_jobs(
    db: Session | Connection,
    claims: Sequence[tuple[uuid.UUID, str]],
    lease_seconds: float,
    model: ServedModel | None = None,
) -> list[Job]:
    """claim_job for many jobs in one statement: each (job id, worker_id) whose job is queued becomes running
    under that lease; the claimed jobs (plain Jobs, in no particular order). A worker's intake claims what
    it took from Redis in one pull this way."""
    if not claims:
        return []
    rows = db.execute(
        _CLAIM_MANY,
        {
            "ids": [c[0] for c in claims],
            "workers": [c[1] for c in claims],
            "lease": lease_seconds,
            **_model_params(model),
        },
    )
    return [_job_from_row(row) for row in rows]


def _model_params(model: ServedModel | None) -> dict:
    """The claim's model parameters: no model, any job; else the model's jobs (NULL ones for the default)."""
    return {
        "served_model": None if model is None else model.name,
        "served_is_default": model is None or model.is_default,
    }


# a job's model matches the claim's (no model given: any job; the default model: NULL too)
_MODEL_MATCHES = (
    "(CAST(:served_model AS varchar) IS NULL OR j.model = CAST(:served_model AS varchar) "
    "OR (CAST(:served_is_default AS boolean) AND j.model IS NULL))"
)


_CLAIM_MANY = text(
    "UPDATE jobs AS j SET status = 'running', worker_id = v.worker, "
    "lease_expires_at = now() + make_interval(secs => CAST(:lease AS double precision)), "
    "started_at = coalesce(j.started_at, now()), attempts = j.attempts + 1, "
    # a re-claim's time and worker (the first claim's time is started_at): job_events.EventKind.CLAIMED
    "events = CASE WHEN j.attempts = 0 THEN j.events ELSE coalesce(j.events, CAST('[]' AS jsonb)) || "
    f"jsonb_build_array(jsonb_build_object('kind', '{EventKind.CLAIMED.value}', 'at', now(), "
    "'attempt', j.attempts + 1, 'worker', v.worker)) END "
    "FROM unnest(CAST(:ids AS uuid[]), CAST(:workers AS varchar[])) AS v(id, worker) "
    "WHERE j.id = v.id AND j.status = 'queued' AND " + _MODEL_MATCHES + " "
    # the columns by name, in the model's order: `.columns()` maps them by position, and a table grown by
    # migrations (ADD COLUMN goes last) has another physical order than the model declares
    "RETURNING " + ", ".join(f'j."{c.name}"' for c in JOBS.c)
).columns(*JOBS.c)


@dataclass(frozen=True, slots=True)
class Output:
    """What a worker writes of one running job: the tokens and text beyond what the row already holds.

    `kept_tokens` / `kept_text_bytes` say how much of the stored output stays; `new_tokens` / `text_tail`
    follow it. The write is idempotent (written twice, the row is the same), so a retry after a lost
    reply cannot duplicate tokens, and each write sends only what is new."""

    job_id: uuid.UUID
    worker_id: str  # the lease
    kept_tokens: int
    new_tokens: Sequence[int]
    kept_text_bytes: int
    text_tail: bytes
    first_token_at: datetime | None = None
    finish_reason: str | None = None  # with prompt_tokens: the final write
    prompt_tokens: int | None = None
    logprobs: dict | None = None  # the final write of a job that asked for log probabilities
    # the row's events (job_events.py) the same way: the first `kept_events` stay, `new_events` follow
    kept_events: int = 0
    new_events: Sequence[dict] = ()


def save_progress(
    db: Session | Connection, outputs: Sequence[Output], lease_seconds: float
) -> set[tuple[uuid.UUID, str]]:
    """Append each running job's new tokens and renew its lease, in one statement whatever the number of jobs.

    Returns the (job id, worker_id) pairs whose lease held; an output missing from it is no longer its
    worker's (cancelled, or its lease lapsed and the job went back to the queue, perhaps to be claimed
    again under another lease of the same worker): the worker must stop that attempt."""
    if not outputs:
        return set()
    return set(map(tuple, db.execute(_PROGRESS, dict(_output_params(outputs), lease=lease_seconds))))


def finish_jobs(db: Session | Connection, outputs: Sequence[Output]) -> set[tuple[uuid.UUID, str]]:
    """running → succeeded with the full output (the rows' tokens + the new ones), in one statement;
    returns the (job id, worker_id) pairs whose lease held, and those this same claim had already finished:
    a write retried after its connection broke may have been committed before the answer was lost (the
    database cut mid-commit), and is then this worker's success, not a job taken from it."""
    if not outputs:
        return set()
    params = _output_params(outputs)
    params.update(
        reasons=[o.finish_reason for o in outputs],
        prompt_counts=[o.prompt_tokens for o in outputs],
        logprobs=[None if o.logprobs is None else json.dumps(o.logprobs) for o in outputs],
    )
    ours = set(map(tuple, db.execute(_FINISH, params)))
    others = {(o.job_id, o.worker_id) for o in outputs} - ours
    if others:  # rare: another worker's now, cancelled, or finished by this claim's earlier try
        finished = db.execute(
            select(JOBS.c.id, JOBS.c.worker_id).where(
                JOBS.c.id.in_([job_id for job_id, _ in others]), JOBS.c.status == JobStatus.SUCCEEDED
            )
        )
        ours |= others & set(map(tuple, finished))
    return ours


def finish_job(
    db: Session | Connection,
    job_id: uuid.UUID,
    worker_id: str,
    *,
    token_ids: Sequence[int],
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    first_token_at: datetime | None = None,
) -> bool:
    """running → succeeded with this whole output; False if the job is no longer the worker's."""
    output = Output(
        job_id, worker_id, 0, token_ids, 0, text.encode("utf-8"), first_token_at, finish_reason, prompt_tokens
    )
    return (job_id, worker_id) in finish_jobs(db, [output])


def _output_params(outputs: Sequence[Output]) -> dict:
    """Bind parameters of the outputs: one array per field; the new tokens of all jobs back to back in
    one flat array, job i's at the 1-based slice [lo_i:hi_i]."""
    flat: list[int] = []
    lo, hi = [], []
    for o in outputs:
        lo.append(len(flat) + 1)
        flat.extend(o.new_tokens)
        hi.append(len(flat))
    return dict(
        ids=_array_literal(o.job_id.hex for o in outputs),
        workers=[o.worker_id for o in outputs],
        kept=_array_literal(o.kept_tokens for o in outputs),
        lo=_array_literal(lo),
        hi=_array_literal(hi),
        tokens=_array_literal(flat),
        text_kept=_array_literal(o.kept_text_bytes for o in outputs),
        tails=[o.text_tail for o in outputs],
        firsts=[o.first_token_at for o in outputs],
        events_kept=_array_literal(o.kept_events for o in outputs),
        events_new=_jsonb_array_literal(list(o.new_events) if o.new_events else None for o in outputs),
    )


def _array_literal(values) -> str:
    """A Postgres array's text form of integers or hex uuids (no quoting needed), for a CAST in the statement:
    psycopg dumps a list element by element in Python, 4x the client CPU of this for a progress write of 256
    jobs' 2,800 new tokens (2.1 against 0.5 ms)."""
    return "{" + ",".join(map(str, values)) + "}"


def _jsonb_array_literal(values) -> str:
    """A Postgres jsonb[] array's text form (None: NULL), as _array_literal's, for the same reason."""
    return "{" + ",".join("NULL" if v is None else _quoted(json.dumps(v)) for v in values) + "}"


def _quoted(element: str) -> str:
    return '"' + element.replace("\\", "\\\\").replace('"', '\\"') + '"'


# One row per job from parallel arrays: the statement's text is the same for 1 job or 500 (planned once).
_OUTPUT_ROWS = """
    unnest(CAST(:ids AS uuid[]), CAST(:workers AS varchar[]), CAST(:kept AS integer[]), CAST(:lo AS integer[]),
           CAST(:hi AS integer[]), CAST(:text_kept AS integer[]), CAST(:tails AS bytea[]),
           CAST(:firsts AS timestamptz[]), CAST(:events_kept AS integer[]), CAST(:events_new AS jsonb[]){extra})
      AS v(id, worker, kept, lo, hi, text_kept, tail, first, events_kept, events_new{extra_names})"""
# events: the first events_kept entries and the new ones (so written twice, the row is the same); a job with no
# new events (nearly all) keeps its value untouched
_APPENDED = """
    output_token_ids = j.output_token_ids[1:v.kept] || (CAST(:tokens AS integer[]))[v.lo:v.hi],
    output_text = substring(j.output_text FROM 1 FOR v.text_kept) || v.tail,
    first_token_at = coalesce(j.first_token_at, v.first),
    events = CASE WHEN v.events_new IS NULL THEN j.events ELSE coalesce(jsonb_path_query_array(
        j.events, '$[0 to $n]', jsonb_build_object('n', v.events_kept - 1)), CAST('[]' AS jsonb)) || v.events_new END,
    updated_at = now()"""
_LEASED = "WHERE j.id = v.id AND j.status = 'running' AND j.worker_id = v.worker RETURNING j.id, j.worker_id"
_PROGRESS = text(f"""UPDATE jobs AS j SET {_APPENDED},
    lease_expires_at = now() + make_interval(secs => CAST(:lease AS double precision))
    FROM {_OUTPUT_ROWS.format(extra="", extra_names="")} {_LEASED}""")
_FINISH = text(f"""UPDATE jobs AS j SET {_APPENDED},
    status = 'succeeded', finished_at = now(), lease_expires_at = NULL,
    finish_reason = v.reason, prompt_tokens = v.prompt_count, logprobs = v.logprobs
    FROM {
    _OUTPUT_ROWS.format(
        extra=", CAST(:reasons AS varchar[]), CAST(:prompt_counts AS integer[]), CAST(:logprobs AS jsonb[])",
        extra_names=", reason, prompt_count, logprobs",
    )
} {_LEASED}""")


def _leased(**values):
    """UPDATE of a running job leased by :worker (bind parameters :job, :worker)."""
    return (
        update(JOBS)
        .where(
            JOBS.c.id == bindparam("job"),
            JOBS.c.status == JobStatus.RUNNING,
            JOBS.c.worker_id == bindparam("worker"),
        )
        .values(**values)
    )


def fail_job(
    db: Session | Connection,
    job_id: uuid.UUID,
    worker_id: str,
    *,
    code: str,
    message: str,
    events: Sequence[dict] = (),
) -> bool:
    """running → failed with an error (and the events the worker recorded since its last write); False if the
    job is no longer the worker's."""
    values: dict[str, object] = dict(
        status=JobStatus.FAILED,
        finished_at=func.now(),
        lease_expires_at=None,
        error_code=code,
        error_message=message,
    )
    if events:
        values["events"] = _events_appended(events)
    return _update_leased(db, job_id, worker_id, **values)


def cancel_job(db: Session | Connection, job_id: uuid.UUID, tenant_id: uuid.UUID) -> tuple[Job | None, bool]:
    """queued/running → cancelled. Returns the job as it now is (any status; None if not the tenant's) and
    whether this call cancelled it (False for a job already cancelled or ended: count a cancel once)."""
    row = db.execute(
        update(JOBS)
        .where(JOBS.c.id == job_id, JOBS.c.tenant_id == tenant_id, JOBS.c.status.in_(ACTIVE))
        .values(
            status=JobStatus.CANCELLED,
            finished_at=func.now(),
            lease_expires_at=None,
            finish_reason=func.coalesce(JOBS.c.finish_reason, "abort"),
        )
        .returning(*JOBS.c)
    ).one_or_none()
    if row is not None:
        return _job_from_row(row), True
    return get_job(db, job_id, tenant_id), False


def release_job(
    db: Session | Connection,
    job_id: uuid.UUID,
    worker_id: str,
    *,
    token_ids: Sequence[int],
    text: str,
    preempted: bool = False,
    reason: str | None = None,
    events: Sequence[dict] = (),
) -> bool:
    """running → queued, keeping the tokens so far and dropping the lease, so that a worker resumes the job
    at once: a worker shutting down hands its jobs back, and a full worker hands back its least urgent job
    when more urgent work waits in Redis (`preempted`: counted in `handbacks`, which bounds how often one
    job is preempted). The row's events get the worker's `events` not yet written and a handed_back entry
    (`reason`: why, as the worker's outcome names it). False if the job is no longer the worker's."""
    handed_back = _event_entry(
        EventKind.HANDED_BACK,
        reason=literal(reason or ("preempted" if preempted else "handed_back"), String),
        tokens=literal(len(token_ids), Integer),
        worker=JOBS.c.worker_id,
    )
    values = dict(
        status=JobStatus.QUEUED,
        worker_id=None,
        lease_expires_at=None,
        enqueued_at=None,
        output_token_ids=list(token_ids),
        output_text=text,
        events=_events_appended(events, handed_back),
    )
    if preempted:
        values["handbacks"] = JOBS.c.handbacks + 1
    return _update_leased(db, job_id, worker_id, **values)


def forget_sent(session: Session, sent_before_seconds: float = 0.0) -> int:
    """Mark queued jobs sent to Redis more than `sent_before_seconds` ago as never sent, so the reconciler
    sends them again (Redis lost its data, or the message went missing); returns how many."""
    result = session.execute(
        update(Job)
        .where(
            Job.status == JobStatus.QUEUED,
            Job.enqueued_at.is_not(None),
            Job.enqueued_at <= func.now() - timedelta(seconds=sent_before_seconds),
        )
        .values(enqueued_at=None)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount


BATCH_ENDED = (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)


def purge_finished(session: Session, older_than_days: float, limit: int) -> int:
    """Delete at most `limit` finished jobs (succeeded, failed, cancelled) that finished more than
    `older_than_days` ago; returns how many. Rows another transaction holds are left for next time."""
    doomed = (
        select(Job.id)
        .where(
            Job.status.in_(FINISHED),
            Job.finished_at < func.now() - timedelta(days=older_than_days),
            # a Batch API job goes only once its batch's output file is written
            Job.batch_id.is_(None) | Job.batch_id.in_(select(Batch.id).where(Batch.status.in_(BATCH_ENDED))),
        )
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    result = session.execute(
        delete(Job).where(Job.id.in_(doomed.scalar_subquery())).execution_options(synchronize_session=False)
    )
    return result.rowcount


def requeue_expired(session: Session) -> list[tuple[uuid.UUID, int]]:
    """running → queued for jobs whose lease expired (their worker died); they keep their tokens.

    Returns their (id, priority), to be sent to Redis again at once."""
    rows = session.execute(
        update(Job)
        .where(Job.status == JobStatus.RUNNING, Job.lease_expires_at < func.now())
        .values(
            status=JobStatus.QUEUED,
            worker_id=None,
            lease_expires_at=None,
            enqueued_at=None,
            events=_events_appended((), _event_entry(EventKind.LEASE_EXPIRED, worker=JOBS.c.worker_id)),
        )
        .returning(Job.id, Job.priority)
        .execution_options(synchronize_session=False)  # no ORM object to update, no SQL to evaluate in Python
    )
    return [(row.id, row.priority) for row in rows]


def unsent_jobs(session: Session, grace_seconds: float, limit: int = 1000) -> list[tuple[uuid.UUID, int]]:
    """(id, priority) of queued jobs never sent to Redis, committed more than `grace_seconds` ago."""
    rows = session.execute(
        select(Job.id, Job.priority)
        .where(
            Job.status == JobStatus.QUEUED,
            Job.enqueued_at.is_(None),
            Job.created_at < func.now() - timedelta(seconds=grace_seconds),
        )
        .order_by(Job.priority, Job.created_at)
        .limit(limit)
    )
    return [(row.id, row.priority) for row in rows]


def sent_at(db: Session | Connection, job_ids: Collection[uuid.UUID]) -> dict[uuid.UUID, datetime]:
    """When the message of each of these jobs that is queued and recorded as sent went to Redis."""
    if not job_ids:
        return {}
    rows = db.execute(
        select(JOBS.c.id, JOBS.c.enqueued_at).where(
            JOBS.c.id.in_(job_ids), JOBS.c.status == JobStatus.QUEUED, JOBS.c.enqueued_at.is_not(None)
        )
    )
    return {row.id: row.enqueued_at for row in rows}


def sent_before(
    db: Session | Connection,
    cutoffs: Mapping[int, datetime | None],
    excluded: Collection[uuid.UUID] = (),
    limit: int = 1000,
    model: ServedModel | None = None,
) -> list[tuple[uuid.UUID, int]]:
    """(id, priority) of queued jobs of each priority in `cutoffs` recorded as sent before its cutoff (None:
    before this transaction began), leaving out `excluded`, of `model` only when given; the longest sent first."""
    if not cutoffs:
        return []
    before = [
        (JOBS.c.priority == p) & (JOBS.c.enqueued_at < (func.now() if cutoff is None else cutoff))
        for p, cutoff in cutoffs.items()
    ]
    stmt = select(JOBS.c.id, JOBS.c.priority).where(
        JOBS.c.status == JobStatus.QUEUED, JOBS.c.enqueued_at.is_not(None), or_(*before)
    )
    if excluded:
        stmt = stmt.where(JOBS.c.id.not_in(excluded))
    if model is not None:
        stmt = stmt.where(_of_model(model))
    return [(row.id, row.priority) for row in db.execute(stmt.order_by(JOBS.c.enqueued_at).limit(limit))]


def _of_model(model: ServedModel):
    same = JOBS.c.model == model.name
    return or_(same, JOBS.c.model.is_(None)) if model.is_default else same


def queued_models(db: Session | Connection) -> set[str | None]:
    """The models of the queued jobs (None: rows that name none, the fleet's default model's)."""
    return set(db.scalars(select(JOBS.c.model).where(JOBS.c.status == JobStatus.QUEUED).distinct()))


def models_of(db: Session | Connection, job_ids: Collection[uuid.UUID]) -> dict[uuid.UUID, str | None]:
    """The model each of these jobs names (None: the fleet's default), to send it to its model's queue."""
    if not job_ids:
        return {}
    return dict(db.execute(select(JOBS.c.id, JOBS.c.model).where(JOBS.c.id.in_(list(job_ids)))).all())


def try_reconciler_lock(session: Session) -> bool:
    """Take the reconciler's transaction-scoped lock; False if another reconciler holds it."""
    return session.scalar(select(func.pg_try_advisory_xact_lock(RECONCILER_LOCK)))


def queued_by_tenant(db: Session | Connection) -> dict[uuid.UUID, int]:
    """Queued jobs per tenant submitted through POST /jobs, not a batch's (tenants with none are left out)."""
    return dict(
        db.execute(
            select(JOBS.c.tenant_id, func.count())
            .where(JOBS.c.status == JobStatus.QUEUED, JOBS.c.batch_id.is_(None))
            .group_by(JOBS.c.tenant_id)
        ).all()
    )


def _job_from_row(row) -> Job:
    """A Job (transient, in no session) from a row of all the jobs table's columns.

    Built as the ORM's own loading builds an instance (the class manager's `new_instance`, values put in
    its `__dict__`), not through the constructor: that fires an attribute event per column, a third of a
    POST /jobs' database work for an object that is only read."""
    job = _new_job()
    job.__dict__.update(zip(_attribute_names(row._fields), row))
    return job


_new_job = inspect(Job).class_manager.new_instance


@functools.lru_cache(maxsize=16)
def _attribute_names(fields: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(_ATTRIBUTE.get(key, key) for key in fields)


_NO_EVENTS = literal_column("CAST('[]' AS jsonb)", JSONB)


def _event_entry(kind: EventKind, **fields) -> ColumnElement:
    """An entry of jobs.events stamped with the statement's now(): {"kind", "at", **fields} (SQL values)."""
    args: list = [
        literal_column("'kind'"),
        literal_column(f"'{kind.value}'"),
        literal_column("'at'"),
        func.now(),
    ]
    for name, value in fields.items():
        args += [literal_column(f"'{name}'"), value]
    return func.jsonb_build_object(*args, type_=JSONB)


def _events_appended(recorded: Sequence[dict], *entries: ColumnElement) -> ColumnElement:
    """jobs.events with the worker's `recorded` entries, then `entries` (SQL), appended."""
    appended: ColumnElement = func.coalesce(JOBS.c.events, _NO_EVENTS)
    if recorded:
        appended = appended.op("||", return_type=JSONB)(literal(list(recorded), JSONB))
    if entries:
        appended = appended.op("||", return_type=JSONB)(func.jsonb_build_array(*entries, type_=JSONB))
    return appended


def _update_leased(db: Session | Connection, job_id: uuid.UUID, worker_id: str, /, **values) -> bool:
    """Apply `values` to a running job leased by `worker_id`; True if it was."""
    return db.execute(_leased(**values), {"job": job_id, "worker": worker_id}).rowcount == 1


def live_deadline_counts(db: Session | Connection, margin_seconds: float) -> dict[tuple[JobStatus, str], int]:
    """Queued and running jobs whose deadline has passed ("missed") or is less than `margin_seconds` away
    ("at_risk"), by status: one read of the index of live jobs with a deadline (ix_jobs_live_deadline)."""
    soon = func.now() + func.make_interval(0, 0, 0, 0, 0, 0, margin_seconds)
    missed = func.count().filter(Job.deadline < func.now())
    rows = db.execute(
        select(Job.status, missed, func.count() - missed)
        .where(Job.deadline.is_not(None), Job.status.in_(ACTIVE), Job.deadline < soon)
        .group_by(Job.status)
    ).all()
    counts = {(status, state): 0 for status in ACTIVE for state in ("missed", "at_risk")}
    for status, n_missed, n_at_risk in rows:
        counts[(JobStatus(status), "missed")] = n_missed
        counts[(JobStatus(status), "at_risk")] = n_at_risk
    return counts
