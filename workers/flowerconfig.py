"""Flower settings: `celery -A workers flower --conf=workers/flowerconfig.py`.

- Basic auth always: FLOWER_BASIC_AUTH=user:password, or a random password printed at start.
- Queue lengths per priority: Flower's broker page (and /api/queues/length) sums a queue's priority
  lists into one number; here each priority step gets its own row, `generate` (0) to `generate:9`,
  next to the total, the lists named by contract/dispatch.py (the module that knows kombu's naming).
"""

# Tornado reads every top-level name that matches a Flower option (`logging` is one), so modules
# are imported under private names.
import logging as _logging
import os as _os
import secrets as _secrets

from flower.utils.broker import RedisBase as _RedisBase

from contract.dispatch import list_name as _list_name

port = int(_os.environ.get("FLOWER_PORT", "5555"))
address = _os.environ.get("FLOWER_ADDRESS", "127.0.0.1")
basic_auth = [_os.environ.get("FLOWER_BASIC_AUTH", "")]
if not basic_auth[0]:
    basic_auth = [f"admin:{_secrets.token_urlsafe(12)}"]
    _logging.getLogger("flower").warning("FLOWER_BASIC_AUTH is not set; log in with %s", basic_auth[0])


async def _queues_per_priority(self, names):
    """One row per (queue, priority step) plus the queue's total, e.g. `generate priority 0`."""
    names = list(names)
    async with self.redis.pipeline() as pipeline:
        for name in names:
            for priority in self.priority_steps:
                pipeline.llen(_list_name(self.broker_prefix, name, priority))
        lengths = iter(await pipeline.execute())
    rows = []
    for name in names:
        counts = [next(lengths) for _ in self.priority_steps]
        rows.append({"name": name, "messages": sum(counts)})
        rows += [
            {"name": f"{name} priority {p}", "messages": n}
            for p, n in zip(self.priority_steps, counts, strict=True)
        ]
    if hasattr(self.redis, "aclose"):
        await self.redis.aclose()
    return rows


_RedisBase.queues = _queues_per_priority
