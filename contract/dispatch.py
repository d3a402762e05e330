"""The broker side of a job: how "job X is ready to run" goes to Redis.

The API (sending) and the workers (consuming) must agree on the Redis priority emulation: kombu
keeps one Redis list per priority step, `generate` for 0 and `generate:N` for N, and a worker's BRPOP
lists them in `priority_steps` order, so priority 0 is taken first. A sender with other
`priority_steps` would file messages under the wrong list, hence one configuration for both.

Queues per model: the fleet's default model (DEFAULT_MODEL, or the process's MODEL_NAME) keeps the queue
`generate`, so a stack with one model has the lists it always had; another model's queue is
`generate.<name>` (`model_queue`), with the same ten priority lists. Every function here that reads or writes
a list takes the queue (default `generate`).
"""

from __future__ import annotations

import base64
import functools
import itertools
import json
import re
import uuid
from collections.abc import Iterable

import redis
from celery import Celery
from kombu import Exchange, Queue

from contract.redis_client import celery_broker, redis_client
from contract.settings import StoreSettings

QUEUE = "generate"
TASK = "generate"
DEFAULT_PRIORITY = 5  # 0 is the most urgent, 9 the least
PRIORITIES = range(10)
SEP = ":"
SEND_POOL_WAIT_SECONDS = 60.0  # a send waits this long for one of the sender's connections (all busy)
MODEL_SEP = "."  # `generate.<model name>`: another model's queue


def model_queue(settings: StoreSettings, model: str | None) -> str:
    """The queue of jobs for the model named `model` (None: the fleet's default, as a job row written before
    jobs named their model): `generate` for the fleet's default model, `generate.<name>` for any other."""
    if model is None or model == settings.fleet_default_model():
        return QUEUE
    return f"{QUEUE}{MODEL_SEP}{model}"


def is_job_queue(queue: str) -> bool:
    """Whether `queue` is a model's job queue (`generate`, `generate.<name>`), which a worker's intake takes."""
    return queue == QUEUE or queue.startswith(QUEUE + MODEL_SEP)


def celery_config(settings: StoreSettings) -> dict:
    """Celery settings shared by every process that sends or consumes jobs."""
    transport = {
        "queue_order_strategy": "priority",
        "priority_steps": list(PRIORITIES),
        "sep": SEP,
    }
    if settings.redis_key_prefix:
        transport["global_keyprefix"] = settings.redis_key_prefix
    broker_url, broker_options = celery_broker(settings.redis_url)  # Sentinel, unix://: kombu's spelling
    transport.update(broker_options)
    return dict(
        broker_url=broker_url,
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


def send_job(app: Celery, job_id: uuid.UUID, priority: int, queue: str = QUEUE) -> None:
    """Put "run job `job_id`" on the `generate` queue with the job's priority. The message's task id is the job's
    id: however often a job is sent (handed back, recovered), it is one task (workers/job_tasks.py).

    Sent through the default exchange straight to the queue: kombu's Redis transport then needs no
    lookup of the `generate` exchange's bindings (a Redis round trip per message)."""
    job = str(job_id)
    app.send_task(TASK, args=[job], task_id=job, queue=_direct(queue), priority=priority)


@functools.cache
def _direct(queue: str) -> Queue:
    """`queue` reached through the default exchange (""): Celery takes a Queue's exchange and routing key as
    they are, where `exchange=""` alone would be taken for "none given" and routed through the default
    queue's exchange (`generate`), whatever the routing key."""
    return Queue(queue, Exchange(""), routing_key=queue)


def send_to_head(
    app: Celery,
    client: redis.Redis,
    settings: StoreSettings,
    job_id: uuid.UUID,
    priority: int,
    queue: str = QUEUE,
) -> bool:
    """Send job `job_id` and put its message at the head of its priority's list (`move_to_head`): a job taken
    from the queue before and back in it (handed back, declined, or recovered from a dead worker) is taken
    before the jobs of its priority that waited behind it. False if Redis failed the move (it waits at the tail)."""
    send_job(app, job_id, priority, queue)
    try:
        move_to_head(client, settings, job_id, priority, queue)  # False: a worker took it already
    except redis.RedisError:
        return False
    return True


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


def move_to_head(
    client: redis.Redis, settings: StoreSettings, job_id: uuid.UUID, priority: int, queue: str = QUEUE
) -> bool:
    """Move the message just sent for `job_id` to the head of its priority's list, so it is taken next
    among equals: a job handed back, or a message a full worker declined, keeps its place ahead of the
    jobs of its priority that came after it. False if it was not near the tail (taken already)."""
    return bool(client.eval(_TO_HEAD, 1, queue_key(settings, queue, priority), str(job_id), 64))


# the job id in a message's headers, where Celery (and BulkSender) put the task's args: "argsrepr": "['<id>']"
_ARGSREPR = re.compile(rb'"argsrepr": "\[\'([0-9a-f-]{36})\'\]"')


def take_messages(
    client: redis.Redis,
    settings: StoreSettings,
    priorities: Iterable[int],
    count: int,
    wait: float | None,
    queue: str = QUEUE,
) -> list[tuple[uuid.UUID | None, int]]:
    """Take up to `count` messages from the most urgent non-empty list of `priorities`, at its head, as kombu's
    consumer would: one LMPOP, or with `wait` one BLMPOP, which waits up to `wait` seconds for a message while
    those lists are empty. (job id, priority) of each, in the order they were sent; a message naming no job gives
    None. A worker's intake takes its jobs this way (workers/intake.py)."""
    keys = [queue_key(settings, queue, p) for p in priorities]
    if wait is None:
        reply = client.lmpop(len(keys), *keys, direction="RIGHT", count=count)
    else:
        reply = client.blmpop(wait, len(keys), *keys, direction="RIGHT", count=count)
    if not reply:
        return []
    key, messages = reply
    priority = list(priorities)[keys.index(key.decode() if isinstance(key, bytes) else key)]
    return [(job_of(message), priority) for message in messages]


# The most urgent non-empty list of KEYS (most urgent first): {its index, its length, the job ids named by its
# ARGV[1] messages at the head, tail end first ("" for a message naming none)}; nil when every list is empty.
_PEEK = r"""
for i, key in ipairs(KEYS) do
  local length = redis.call('LLEN', key)
  if length > 0 then
    local ids = {}
    for _, message in ipairs(redis.call('LRANGE', key, -tonumber(ARGV[1]), -1)) do
      ids[#ids + 1] = string.match(message, '"argsrepr": "%[\'([%x%-]+)\'%]"') or ''
    end
    return {i - 1, length, ids}
  end
end
return nil
"""


def peek_head(
    client: redis.Redis,
    settings: StoreSettings,
    priorities: Iterable[int],
    window: int,
    queue: str = QUEUE,
) -> tuple[int, int, list[uuid.UUID | None]] | None:
    """Look, taking nothing, at the most urgent non-empty list of `priorities` (what `take_messages` would take
    from): (its priority, how many messages wait in it, the jobs named by its `window` messages at the head, next
    first; None for a message naming no job), or None when every list is empty. One short script in Redis,
    which sends back job ids, not messages."""
    priorities = list(priorities)
    keys = [queue_key(settings, queue, p) for p in priorities]
    reply = client.eval(_PEEK, len(keys), *keys, window)
    if not reply:
        return None
    index, length, ids = reply
    named = [uuid.UUID(i.decode()) if i else None for i in reversed(ids)]
    return priorities[index], int(length), named


# Takes the messages naming ARGV[2..] (job ids) from among the ARGV[1] messages at the head of KEYS[1]; returns
# the ids of those taken (a message another worker took meanwhile is not there any more). Takes nothing while any
# of KEYS[2..] (more urgent lists) holds a message: one sent since the caller looked goes first.
_TAKE = r"""
for i = 2, #KEYS do
  if redis.call('LLEN', KEYS[i]) > 0 then return {} end
end
local wanted = {}
for i = 2, #ARGV do wanted[ARGV[i]] = true end
local taken = {}
for _, message in ipairs(redis.call('LRANGE', KEYS[1], -tonumber(ARGV[1]), -1)) do
  local id = string.match(message, '"argsrepr": "%[\'([%x%-]+)\'%]"')
  if id and wanted[id] then
    redis.call('LREM', KEYS[1], -1, message)
    taken[#taken + 1] = id
    wanted[id] = nil
  end
end
return taken
"""


def take_jobs(
    client: redis.Redis,
    settings: StoreSettings,
    priority: int,
    job_ids: Iterable[uuid.UUID],
    window: int,
    queue: str = QUEUE,
    more_urgent: Iterable[int] = (),
) -> list[tuple[uuid.UUID, int]]:
    """Take the messages naming `job_ids` from among the `window` messages at the head of `priority`'s list,
    wherever they stand there (a worker ordering the waiting jobs of a class: workers/queue_order.py), in one
    script, so two workers never take the same message. (job id, priority) of each taken, in the order of
    `job_ids`; one taken by another worker meanwhile is left out. The messages left keep their order. Nothing
    is taken while a list of `more_urgent` priorities holds a message (sent since the caller looked)."""
    wanted = [str(job_id) for job_id in job_ids]
    if not wanted:
        return []
    keys = [queue_key(settings, queue, p) for p in (priority, *more_urgent)]
    taken = {i.decode() for i in client.eval(_TAKE, len(keys), *keys, window, *wanted)}
    return [(uuid.UUID(job_id), priority) for job_id in wanted if job_id in taken]


def job_of(message: bytes) -> uuid.UUID | None:
    """The job a `generate` message names (its headers' argsrepr), None if it names none."""
    found = _ARGSREPR.search(message)
    return uuid.UUID(found.group(1).decode()) if found else None


# For each list of KEYS: {its length, the job ids named by its ARGV[1] messages at the head, tail end first ("" for
# a message naming none)}. One script: the lists are seen at one moment, and only ids leave Redis.
_HEADS = r"""
local heads = {}
for i, key in ipairs(KEYS) do
  local ids = {}
  for _, message in ipairs(redis.call('LRANGE', key, -tonumber(ARGV[1]), -1)) do
    ids[#ids + 1] = string.match(message, '"argsrepr": "%[\'([%x%-]+)\'%]"') or ''
  end
  heads[i] = {redis.call('LLEN', key), ids}
end
return heads
"""


def waiting_jobs(
    client: redis.Redis, settings: StoreSettings, limit: int, queue: str = QUEUE
) -> dict[int, tuple[int, list[uuid.UUID]]]:
    """For each priority: how many messages wait in its list, and the jobs named by the `limit` messages at
    its head (the next to be taken, next first), all read in one script, so the lists are seen at one moment."""
    keys = [queue_key(settings, queue, p) for p in PRIORITIES]
    replies = client.eval(_HEADS, len(keys), *keys, limit)
    return {
        p: (int(length), [uuid.UUID(i.decode()) for i in reversed(ids) if i])
        for p, (length, ids) in zip(PRIORITIES, replies, strict=True)
    }


# Which of ARGV[3..] (job ids) the messages KEYS[1][ARGV[1] .. ARGV[1] + ARGV[2] - 1] name.
_FIND = r"""
local sought = {}
for i = 3, #ARGV do sought[ARGV[i]] = true end
local found = {}
local first = tonumber(ARGV[1])
for _, message in ipairs(redis.call('LRANGE', KEYS[1], first, first + tonumber(ARGV[2]) - 1)) do
  local id = string.match(message, '"argsrepr": "%[\'([%x%-]+)\'%]"')
  if id and sought[id] then
    found[#found + 1] = id
    sought[id] = nil
  end
end
return found
"""


def jobs_in_queue(
    client: redis.Redis,
    settings: StoreSettings,
    priority: int,
    job_ids: Iterable[uuid.UUID],
    chunk: int = 1000,
    queue: str = QUEUE,
) -> set[uuid.UUID]:
    """Which of `job_ids` a message waiting in `priority`'s list names. The list is read `chunk` messages per
    call (each a short script in Redis, so a long list never blocks Redis for long), from its tail: a message
    pushed meanwhile shifts the rest towards the head, where they are still read."""
    sought = {str(job_id) for job_id in job_ids}
    key, found, first = queue_key(settings, queue, priority), set(), 0
    while sought and first < client.llen(key):
        hits = {hit.decode() for hit in client.eval(_FIND, 1, key, first, chunk, *sought)}
        found |= hits
        sought -= hits
        first += chunk
    return {uuid.UUID(job_id) for job_id in found}


def queue_lengths(
    client: redis.Redis, settings: StoreSettings, queues: Iterable[str]
) -> dict[str, list[int]]:
    """Messages waiting in each priority's list of each of `queues` (index: priority), read in one MULTI."""
    queues = list(queues)
    with client.pipeline(transaction=True) as pipe:
        for queue in queues:
            for p in PRIORITIES:
                pipe.llen(queue_key(settings, queue, p))
        lengths = iter(pipe.execute())
    return {queue: [next(lengths) for _ in PRIORITIES] for queue in queues}


def queue_key(settings: StoreSettings, queue: str, priority: int) -> str:
    """The Redis list holding `queue`'s messages of `priority` (kombu's naming: the plain name for 0)."""
    return list_name(settings.redis_key_prefix, queue, priority)


def list_name(prefix: str, queue: str, priority: int) -> str:
    """`queue_key` under key prefix `prefix` (Flower's, which it reads from the broker options)."""
    return f"{prefix}{queue}{SEP}{priority}" if priority else f"{prefix}{queue}"


def bounded_redis(
    url: str, *, timeout: float, max_connections: int = 64, pool_timeout: float | None = None
) -> redis.Redis:
    """A Redis client whose callers share at most `max_connections` connections, waiting for one when all are
    busy (up to `pool_timeout` seconds; None: `timeout`). redis-py's default pool opens one per concurrent
    caller and keeps it: 1,000 calls arriving at once on a gevent API process opened 1,000 connections, each
    costing more CPU (its handshake, the client's driver-info lookup) than the command it ran."""
    return redis_client(url, timeout=timeout, max_connections=max_connections, pool_timeout=pool_timeout)


class BulkSender:
    """Sends "run job X" for one job (POST /jobs) or many at once (a batch's): the messages `send_job` would
    send, built here from one template and LPUSHed many per command, `pipeline_size` per round trip.

    Celery's own send_task costs ~0.5 ms of Python per message on a small machine, more than 10,000 jobs
    per batch can afford; a message is a header dict and a base64 body, so this builds each one from a
    template Celery made (tests/contract/test_dispatch.py checks it equals Celery's, ids aside)."""

    def __init__(self, app: Celery, settings: StoreSettings, pipeline_size: int = 2000):
        self.settings, self.pipeline_size = settings, pipeline_size
        # A busy pool is the process's own back-pressure, not Redis failing: under gevent a connection is held
        # from a command's send until its greenlet's next turn at the CPU, and with 1,000 requests in one
        # process (two busy cores) a turn took over 5 s: 121 of 1,000 sends gave up waiting for a connection
        # and their jobs waited for the reconciler. Redis down fails at the connect, within `timeout`.
        self.redis = bounded_redis(settings.redis_url, timeout=5, pool_timeout=SEND_POOL_WAIT_SECONDS)
        template = app.amqp.as_task_v2("", TASK, args=["-"], kwargs={}, ignore_result=None)
        self._embed = json.dumps(template.body[2])
        # the message as JSON once, with a {slot} where each message differs (json.dumps of the whole
        # dict per message cost more than the rest of a batch's sending)
        slots = {name: f"\x00{name}\x00" for name in ("task", "argsrepr", "body", "priority", "tag", "queue")}
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
                delivery_info={"exchange": "", "routing_key": slots["queue"]},
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

    def message(self, job_id: uuid.UUID, priority: int, queue: str = QUEUE) -> str:
        """The message Celery would send for `generate(job_id)` at `priority` on `queue`, as kombu stores it."""
        job = str(job_id)  # a uuid's text needs no JSON escaping
        body = f'[["{job}"], {{}}, {self._embed}]'.encode()
        return self._template.format(
            task=job,
            argsrepr=f"['{job}']",
            body=base64.b64encode(body).decode(),
            priority=int(priority),
            tag=uuid.uuid4(),
            queue=json.dumps(queue)[1:-1],
        )

    def send_one(self, job_id: uuid.UUID, priority: int, queue: str = QUEUE) -> None:
        """Send "run job `job_id`" at `priority`: one LPUSH of the message `send_job` would send, built from
        the template (Celery's send_task costs ~10x the CPU: a third of POST /jobs' in the API)."""
        self.redis.lpush(queue_key(self.settings, queue, priority), self.message(job_id, priority, queue))

    def send(self, jobs: Iterable[tuple[uuid.UUID, int]], queue: str = QUEUE) -> int:
        """Send every (job id, priority) to `queue`, in order; returns how many were sent. Consecutive jobs of one
        priority go in one LPUSH of many values (Redis pushes them one after another, as as many LPUSHes
        would: the first is taken first), `pipeline_size` messages per round trip. A failure part way
        leaves the rest unsent, their rows queued with enqueued_at NULL: the reconciler sends them."""
        sent = pending = 0
        with self.redis.pipeline(transaction=False) as pipe:
            for priority, run in itertools.groupby(jobs, key=lambda job: job[1]):
                key = queue_key(self.settings, queue, priority)
                while chunk := list(itertools.islice(run, self.pipeline_size - pending)):
                    pipe.lpush(key, *(self.message(job_id, priority, queue) for job_id, _ in chunk))
                    pending += len(chunk)
                    if pending >= self.pipeline_size:
                        pipe.execute()
                        sent, pending = sent + pending, 0
            pipe.execute()
        return sent + pending

    def close(self) -> None:
        self.redis.close()
