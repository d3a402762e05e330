"""Jobs in Postgres: tables, sessions, state transitions, tenants and keys, the Batch API's files and
batches. The settings, request schema and message formats every process shares live in contract/."""

from jobstore.models import ApiKey, Base, Job, JobStatus, Tenant

__all__ = ["ApiKey", "Base", "Job", "JobStatus", "Tenant"]
