"""Jobs in Postgres: models, sessions, state transitions, and the settings every process shares."""

from jobstore.models import ApiKey, Base, Job, JobStatus, Tenant
from jobstore.settings import ApiSettings, Settings, StoreSettings, WorkerSettings

__all__ = [
    "ApiKey",
    "ApiSettings",
    "Base",
    "Job",
    "JobStatus",
    "Settings",
    "StoreSettings",
    "Tenant",
    "WorkerSettings",
]
