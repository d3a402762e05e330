"""Cancelling a job from the API: the row first (the record), then the count and the event, once a cancel.

Used by POST /jobs/<id>/cancel and by a follower whose caller left or ran out of time (webapi/following.py).
"""

from __future__ import annotations

import uuid

from jobstore import jobs
from jobstore.models import Job, JobStatus
from webapi.extensions import Services
from webapi.metrics import JOBS_CANCELLED


def cancel(found: Services, job_id: uuid.UUID, tenant_id: uuid.UUID) -> tuple[Job | None, bool]:
    """Cancel the tenant's job if it is queued or running: the job as it now is (None: not the tenant's) and
    whether this call cancelled it. A cancel is counted and announced to every API process's followers
    (a token event) once, by the call that made it; database errors are the caller's."""
    with found.autocommit.connect() as conn:
        job, cancelled = jobs.cancel_job(conn, job_id, tenant_id)
    if cancelled:
        JOBS_CANCELLED.labels(str(job.priority)).inc()
        found.hub.publish_status([(job_id.hex, JobStatus.CANCELLED.value)])
    return job, cancelled
