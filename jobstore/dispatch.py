"""The broker side of a job: how "job X is ready to run" goes to Redis.

The API (sending) and the workers (consuming) must agree on the Redis priority emulation: kombu
keeps one Redis list per priority step, `generate` for 0 and `generate:N` for N, and a worker's BRPOP
lists them in `priority_steps` order, so priority 0 is taken first. A sender with other
`priority_steps` would file messages under the wrong list, hence one configuration for both.
"""

from __future__ import annotations

import base64
import itertools
import json
import uuid
from collections.abc import Iterable

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


class BulkSender:
    """Sends "run job X" for many jobs at once (a batch's): the messages `send_job` would send, built here
    from one template and LPUSHed many per command, `pipeline_size` per round trip.

    Celery's own send_task costs ~0.5 ms of Python per message on a small machine, more than 10,000 jobs
    per batch can afford; a message is a header dict and a base64 body, so this builds each one from a
    template Celery made (tests/jobstore/test_dispatch.py checks it equals Celery's, ids aside)."""

    def __init__(self, app: Celery, settings: StoreSettings, pipeline_size: int = 2000):
        self.settings, self.pipeline_size = settings, pipeline_size
        self.redis = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
        template = app.amqp.as_task_v2("", TASK, args=["-"], kwargs={}, ignore_result=None)
        self._embed = json.dumps(template.body[2])
        # the message as JSON once, with a {slot} where each message differs (json.dumps of the whole
        # dict per message cost more than the rest of a batch's sending)
        slots = {name: f"\x00{name}\x00" for name in ("task", "argsrepr", "body", "priority", "tag")}
        message = {
            "body": slots["body"],
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": dict(
                template.headers, id=slots["task"], root_id=slots["task"], argsrepr=slots["argsrepr"]
            ),
            "properties": dict(
                template.properties,
                reply_to=app.thread_oid,
                delivery_mode=2,
                correlation_id=slots["task"],
                delivery_info={"exchange": "", "routing_key": QUEUE},
                priority=slots["priority"],
                body_encoding="base64",
                delivery_tag=slots["tag"],
            ),
        }
        text = json.dumps(message).replace("{", "{{").replace("}", "}}")
        for name, slot in slots.items():
            quoted = json.dumps(slot)
            placeholder = "{" + name + "}"  # priority is a number; the rest are strings
            text = text.replace(quoted, placeholder if name == "priority" else f'"{placeholder}"')
        self._template = text

    def message(self, job_id: uuid.UUID, priority: int) -> str:
        """The message Celery would send for `generate(job_id)` at `priority`, as kombu stores it in Redis."""
        job = str(job_id)  # a uuid's text needs no JSON escaping
        body = f'[["{job}"], {{}}, {self._embed}]'.encode()
        return self._template.format(
            task=uuid.uuid4(),
            argsrepr=f"['{job}']",
            body=base64.b64encode(body).decode(),
            priority=int(priority),
            tag=uuid.uuid4(),
        )

    def send(self, jobs: Iterable[tuple[uuid.UUID, int]]) -> int:
        """Send every (job id, priority), in order; returns how many were sent. Consecutive jobs of one
        priority go in one LPUSH of many values (Redis pushes them one after another, as as many LPUSHes
        would: the first is taken first), `pipeline_size` messages per round trip. A failure part way
        leaves the rest unsent, their rows queued with enqueued_at NULL: the reconciler sends them."""
        sent = pending = 0
        with self.redis.pipeline(transaction=False) as pipe:
            for priority, run in itertools.groupby(jobs, key=lambda job: job[1]):
                key = queue_key(self.settings, QUEUE, priority)
                while chunk := list(itertools.islice(run, self.pipeline_size - pending)):
                    pipe.lpush(key, *(self.message(job_id, priority) for job_id, _ in chunk))
                    pending += len(chunk)
                    if pending >= self.pipeline_size:
                        pipe.execute()
                        sent, pending = sent + pending, 0
            pipe.execute()
        return sent + pending

    def close(self) -> None:
        self.redis.close()
