"""The broker side of a job: how "job X is ready to run" goes to Redis.

The API (sending) and the workers (consuming) must agree on the Redis priority emulation: kombu
keeps one Redis list per priority step, `generate` for 0 and `generate:N` for N, and a worker's BRPOP
lists them in `priority_steps` order, so priority 0 is taken first. A sender with other
`priority_steps` would file messages under the wrong list, hence one configuration for both.
"""

from __future__ import annotations

import uuid

import redis
from celery import Celery

from jobstore.settings import StoreSettings

QUEUE = "generate"
TASK = "generate"
DEFAULT_PRIORITY = 5  # 0 is the most urgent, 9 the least
PRIORITIES = range(10)
SEP = ":"


def celery_config(settings: StoreSettings) -> dict:
    """Celery settings shared by every process that sends or consumes jobs."""
    transport = {
        "queue_order_strategy": "priority",
        "priority_steps": list(PRIORITIES),
        "sep": SEP,
    }
    if settings.redis_key_prefix:
        transport["global_keyprefix"] = settings.redis_key_prefix
    return dict(
        broker_url=settings.redis_url,
        broker_transport_options=transport,
        broker_connection_retry_on_startup=True,
        task_default_queue=QUEUE,
        task_default_priority=DEFAULT_PRIORITY,
        task_ignore_result=True,  # results live in Postgres
    )


def make_celery(settings: StoreSettings, name: str = "genq") -> Celery:
    """A Celery app that can send jobs (the API uses this; workers/celery.py extends it)."""
    app = Celery(name, set_as_current=False)
    app.conf.update(celery_config(settings))
    return app


def send_job(app: Celery, job_id: uuid.UUID, priority: int) -> None:
    """Put "run job `job_id`" on the `generate` queue with the job's priority.

    Sent through the default exchange straight to the queue: kombu's Redis transport then needs no
    lookup of the `generate` exchange's bindings (a Redis round trip per message)."""
    app.send_task(TASK, args=[str(job_id)], exchange="", routing_key=QUEUE, priority=priority)


# Kombu LPUSHes a message and consumers BRPOP, so the right end of a list is its head. This moves the
# message naming ARGV[1] (the job id, plain in its headers' argsrepr) from near the left end, where a
# send just put it, to the head. Returns 1 if it was found among the first ARGV[2] messages.
_TO_HEAD = """
for i = 0, tonumber(ARGV[2]) - 1 do
  local message = redis.call('LINDEX', KEYS[1], i)
  if not message then return 0 end
  if string.find(message, ARGV[1], 1, true) then
    redis.call('LREM', KEYS[1], 1, message)
    redis.call('RPUSH', KEYS[1], message)
    return 1
  end
end
return 0
"""


def move_to_head(client: redis.Redis, settings: StoreSettings, job_id: uuid.UUID, priority: int) -> bool:
    """Move the message just sent for `job_id` to the head of its priority's list, so it is taken next
    among equals: a job handed back, or a message a full worker declined, keeps its place ahead of the
    jobs of its priority that came after it. False if it was not near the tail (taken already)."""
    return bool(client.eval(_TO_HEAD, 1, queue_key(settings, QUEUE, priority), str(job_id), 64))


def queue_key(settings: StoreSettings, queue: str, priority: int) -> str:
    """The Redis list holding `queue`'s messages of `priority` (kombu's naming: the plain name for 0)."""
    return (
        f"{settings.redis_key_prefix}{queue}{SEP}{priority}"
        if priority
        else f"{settings.redis_key_prefix}{queue}"
    )
