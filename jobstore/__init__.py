"""Jobs in Postgres: models, sessions, state transitions, and the settings every process shares."""

from jobstore.models import ApiKey, Base, Job, JobStatus, Tenant
from jobstore.settings import Settings

__all__ = ["ApiKey", "Base", "Job", "JobStatus", "Settings", "Tenant"]
