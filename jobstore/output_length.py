"""A job's predicted output length: what its tenant's recent jobs produced, capped by its max_tokens.

The engine orders the waiting jobs of one priority by predicted cost (batching/admission_order.py); the
output length is the part of the cost a job does not state. Tenants differ far more than their jobs do
(a chat client asks for tens of tokens, a summarizer for hundreds, a writer for thousands), so the
statistic is per tenant, and per model (two models answer the same prompt at different lengths):

    predicted = min(max_tokens, mean output tokens of the tenant's last RECENT_JOBS succeeded jobs on the model)

and max_tokens with no history. It is bounded (RECENT_JOBS rows, read through the index of a tenant's
succeeded jobs in the order they ended) and cheap: one query for any number of jobs.

The history of a job is the tenant's jobs that **had finished before it was created** (and so were created
before it too), the last RECENT_JOBS of them to finish: a fixed set of rows, so the prediction (and with it
the order of waiting jobs) is the same whenever it is computed, by a worker that restarts and queues the job
again included. (Taken in creation order instead, the walk to them passed every job created before it that
was still queued or running when it was created: a tenant's whole backlog, ~1,000 rows a job for genq-batch
at its queued-job cap, read twice a job, by the window's costs and by the claim's prediction.)

`queued_costs` gives the same prediction for jobs still waiting in Redis, with what else places them in their
class (workers/queue_order.py): a worker choosing which waiting messages to take reads it for a window of them.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, Integer, Text, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, TIMESTAMP, UUID
from sqlalchemy.orm import Session

RECENT_JOBS = 32  # the history of a prediction: enough for a stable mean, few enough to read at once


@dataclass(frozen=True, slots=True)
class JobShape:
    """What a prediction needs of a job: its tenant, when it was created, its max_tokens, its model (None:
    the fleet's default, as the job's row holds it)."""

    tenant_id: uuid.UUID
    created_at: datetime
    max_tokens: int
    model: str | None = None


def predict_output_tokens(max_tokens: int, recent_outputs: Sequence[int]) -> int:
    """The statistic: the mean of the recent outputs (rounded up), capped by max_tokens; max_tokens alone
    without history."""
    if not recent_outputs:
        return max_tokens
    return min(max_tokens, -(-sum(recent_outputs) // len(recent_outputs)))


def predicted_output_tokens(db: Session | Connection, jobs: Sequence[JobShape]) -> list[int]:
    """Each job's prediction, from its tenant's history before it (see the module's doc), in one query."""
    if not jobs:
        return []
    rows = db.execute(
        _HISTORY,
        {
            "tenants": [j.tenant_id for j in jobs],
            "created": [j.created_at for j in jobs],
            "models": [j.model for j in jobs],
            "limit": RECENT_JOBS,
        },
    ).all()
    history: dict[int, list[int]] = {}
    for index, outputs in rows:
        history[index] = outputs
    return [predict_output_tokens(j.max_tokens, history.get(i + 1, [])) for i, j in enumerate(jobs)]


@dataclass(frozen=True, slots=True)
class QueuedCost:
    """What places a queued job within its class: when it was created, the tokens it is predicted still to
    compute (its prompt and any tokens a past run saved, then its predicted output beyond those), its
    predicted output alone, and its deadline."""

    created_at: datetime
    tokens_left: int
    output_left: int
    deadline: datetime | None


def queued_costs(db: Session | Connection, job_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, QueuedCost]:
    """The cost of each of `job_ids` that is queued (others are left out), its prediction as
    `predicted_output_tokens` makes it, in one query."""
    if not job_ids:
        return {}
    costs = {}
    for job_id, created, deadline, prompt, saved, max_tokens, outputs in db.execute(
        _QUEUED, {"ids": list(job_ids), "limit": RECENT_JOBS}
    ):
        output_left = max(0, predict_output_tokens(max_tokens, outputs) - saved)
        costs[job_id] = QueuedCost(created, prompt + saved + output_left, output_left, deadline)
    return costs


# For each (tenant, created_at) asked about, the output lengths of that tenant's last RECENT_JOBS succeeded jobs
# to finish before then. The inner query walks ix_jobs_tenant_succeeded (migration 0017) backwards from `created`,
# past the other models' jobs among them.
_HISTORY = text(
    """
    SELECT asked.i, array(
        SELECT cardinality(j.output_token_ids) FROM jobs j
        WHERE j.tenant_id = asked.tenant_id AND j.finished_at < asked.created
          AND j.status = 'succeeded' AND j.model IS NOT DISTINCT FROM asked.model
        ORDER BY j.finished_at DESC, j.id DESC
        LIMIT :limit
    )
    FROM unnest(:tenants, :created, :models) WITH ORDINALITY AS asked(tenant_id, created, model, i)
    """
).bindparams(
    bindparam("tenants", type_=ARRAY(UUID(as_uuid=True))),
    bindparam("created", type_=ARRAY(TIMESTAMP(timezone=True))),
    bindparam("models", type_=ARRAY(Text())),
    bindparam("limit", type_=Integer),
)

# The queued jobs among :ids, each with its history as _HISTORY reads it.
_QUEUED = text(
    """
    SELECT j.id, j.created_at, j.deadline, coalesce(j.prompt_tokens, 0), coalesce(cardinality(j.output_token_ids), 0),
           j.max_tokens, array(
        SELECT cardinality(h.output_token_ids) FROM jobs h
        WHERE h.tenant_id = j.tenant_id AND h.finished_at < j.created_at
          AND h.status = 'succeeded' AND h.model IS NOT DISTINCT FROM j.model
        ORDER BY h.finished_at DESC, h.id DESC
        LIMIT :limit
    )
    FROM jobs j WHERE j.id = ANY(:ids) AND j.status = 'queued'
    """
).bindparams(bindparam("ids", type_=ARRAY(UUID(as_uuid=True))), bindparam("limit", type_=Integer))
